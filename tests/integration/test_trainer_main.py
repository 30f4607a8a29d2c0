"""``tidal train`` under torchrun against a real broker process, fed by a scripted rollout node.

The scripted node (a thread in this test, registered with the broker like a rollout node) leases prompt
groups and submits scored groups with synthetic tokens: no engine is needed because the trainer only consumes
groups; with no engine registered the trainer skips weight sync. The trainer runs 2 processes (EP2 on the
tiny MoE model), checkpoints, exits, and a second launch resumes from the checkpoint with more steps: it
must continue the policy version and ask for the next batch, never repeating one. Its data holds six
steps: the second launch asks for eight and ends, exported and saying why, once the data is exhausted.

It trains fully sharded (``fsdp2``) with recomputed proximal logprobs (token-level TIS) and a KL term to a
reference model, two minibatches per batch: the proximal logprobs are the batch's starting policy, so the
PPO ratio is exactly 1 on a batch's first minibatch step and not on its second (one update later).

The broker asks for CURVE, as on a shared network (docs/multinode.md): the node and the trainer connect
with their own allowed keys (``trainer.curve_*_key_file``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tidal.broker.client import BrokerClient
from tidal.broker.curve import CurveClientKeys
from tidal.broker.testing import fake_group, make_curve_keys, start_broker
from tidal.procs import free_port, kill_tree, stop


def _feed(address: str, curve: CurveClientKeys, stop_event: threading.Event) -> None:
    with BrokerClient(address, timeout_s=10, curve=curve) as client:
        client.register("rollout", "scripted-node")
        while not stop_event.is_set():
            lease = client.lease(4)
            if lease is None:
                stop_event.wait(0.05)
                continue
            version = client.policy_version()
            client.submit(
                lease.lease_id, [fake_group(g, version=version, response_len=5) for g in lease.groups]
            )


def _train_cmd(
    tmp: Path, address: str, steps: int, keys: dict[str, Path], out: Path | None = None
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tidal.torchrun",  # as `tidal run` launches it: the trainer's own exit code comes through
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        "-m",
        "tidal.cli",
        "train",
        f"run_dir={tmp}",
        "trainer.nproc=2",
        "trainer.mesh.ep=2",
        f"trainer.steps={steps}",
        "trainer.checkpoint_every=2",
        "trainer.minibatches_per_batch=2",
        "trainer.micro_batch_tokens=64",
        "trainer.optimizer.kind=fsdp2",
        "trainer.optimizer.warmup_steps=0",  # the first step moves the weights
        "trainer.loss.recompute_proximal_logprobs=true",
        "trainer.loss.tis=token",
        "trainer.loss.kl_coef=0.01",
        f"broker.bind={address}",
        f"trainer.curve_secret_key_file={keys['trainer_secret']}",
        f"trainer.curve_server_key_file={keys['broker']}",
        "--out",
        str(out or tmp / "train"),
    ]


def _train(
    tmp: Path, address: str, steps: int, keys: dict[str, Path], out: Path | None = None
) -> subprocess.CompletedProcess:
    cmd = _train_cmd(tmp, address, steps, keys, out)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, start_new_session=True)


@pytest.fixture
def fed_broker(tmp_path):
    yield from _fed_broker(tmp_path, rows=64)


@pytest.fixture
def finite_broker(tmp_path):
    """Six prompts, one epoch: three batches of two groups, six steps of two minibatches."""
    yield from _fed_broker(tmp_path, rows=6, data={"epochs": 1})


def _fed_broker(tmp_path, rows: int, **settings):
    """A CURVE broker with the scripted node feeding it; yields (address, keys)."""
    keys = make_curve_keys(tmp_path)
    curve = {
        "enabled": True,
        "server_secret_key_file": str(keys["broker_secret"]),
        "allowed_client_keys_dir": str(keys["allowed"]),
    }
    broker, address = start_broker(
        tmp_path / "broker", rows, group_size=4, batch_groups=2, max_staleness=4, curve=curve, **settings
    )
    node_keys = CurveClientKeys.from_files(keys["node_secret"], keys["broker"])
    stop_event = threading.Event()
    feeder = threading.Thread(target=_feed, args=(address, node_keys, stop_event), daemon=True)
    feeder.start()
    try:
        yield address, keys
    finally:
        stop_event.set()
        feeder.join(10)
        stop(broker)


def _policy_version(address: str, keys: dict[str, Path]) -> int:
    trainer_keys = CurveClientKeys.from_files(keys["trainer_secret"], keys["broker"])
    with BrokerClient(address, timeout_s=10, curve=trainer_keys) as client:
        return client.policy_version()


@pytest.mark.slow
def test_train_pulls_batches_checkpoints_resumes_and_ends_with_the_data(tmp_path, finite_broker):
    address, keys = finite_broker
    first = _train(tmp_path, address, steps=4, keys=keys)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    # asked for 8 steps, the data holds 6: the run ends early, saying why, and is exported (a finished run)
    second = _train(tmp_path, address, steps=8, keys=keys)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    assert "tidal train: the run ends early after step 6 of 8 (broker batch 2): the broker's data is" in (
        second.stderr
    )
    version = _policy_version(address, keys)
    # a trainer with no checkpoint (another --out) on this run would ask for batch 0, trained long ago
    stray = _train(tmp_path, address, steps=8, keys=keys, out=tmp_path / "elsewhere")
    assert stray.returncode == 2, stray.stdout[-3000:] + stray.stderr[-5000:]
    assert (
        f"the broker's run has trained through batch 2 (reported by a trainer's checkpoint), but it has no "
        f"checkpoint in {tmp_path / 'elsewhere'}"
    ) in stray.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # two minibatches per batch: two optimizer steps (two policy versions) per broker batch
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["batch_id"] for r in records] == [0, 0, 1, 1, 2, 2]
    assert version == 6
    assert all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in records)  # finite, training
    first_minibatch, second_minibatch = records[0::2], records[1::2]
    assert [r["actor/ratio_mean"] for r in first_minibatch] == [1.0, 1.0, 1.0]
    assert all(r["actor/ratio_mean"] != 1.0 for r in second_minibatch)
    assert all(r["loss/kl"] >= 0 for r in records) and records[-1]["loss/kl"] > 0
    latest = json.loads((tmp_path / "train" / "checkpoints" / "latest").read_text())
    assert latest["step"] == 6 and latest["last_batch_id"] == 2
    assert (tmp_path / "final_hf" / "config.json").exists()


@pytest.mark.slow
def test_sigterm_stops_at_a_batch_boundary_with_a_checkpoint_that_a_restart_continues(tmp_path, fed_broker):
    """SIGTERM to the trainer's process group (what `tidal run`'s stop and Slurm send; torchrun forwards its
    own) mid-run, with no periodic checkpoint due: both ranks finish the batch, save and exit, so a restart
    repeats no step. Before, the trainer died mid-step and every step since the last checkpoint was redone."""
    address, keys = fed_broker
    metrics = tmp_path / "metrics.jsonl"
    cmd = [*_train_cmd(tmp_path, address, steps=200, keys=keys), "trainer.checkpoint_every=1000"]
    log = tmp_path / "trainer.log"  # a file, not a pipe nobody reads while it runs
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-5000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        kill_tree(proc)
    err = log.read_text()
    # not 0, a finished run: a supervisor restarts it (tidal.torchrun passes the trainer's own code on)
    assert proc.returncode == 143, err[-5000:]
    done = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert f"stopped by SIGTERM after step {done[-1]}" in err, err[-5000:]
    latest = json.loads((tmp_path / "train" / "checkpoints" / "latest").read_text())
    assert latest["step"] == done[-1] and done == list(range(1, done[-1] + 1))
    assert latest["last_batch_id"] == (done[-1] - 1) // 2  # two minibatch steps per batch: at a boundary
    assert not (tmp_path / "final_hf").exists()  # not exported: the run is not finished

    more = _train(tmp_path, address, steps=done[-1] + 2, keys=keys)
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-5000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, done[-1] + 3))  # continued from the stop's checkpoint, nothing redone
    assert _policy_version(address, keys) == done[-1] + 2
