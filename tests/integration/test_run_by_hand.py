"""The many-machines layout of docs/multinode.md, on one machine with processes started by hand: `tidal
broker`, `tidal rollout --broker ...` nodes and `torchrun -m tidal.cli train --broker ...`. A second node
joins mid-run, the first leaves with SIGTERM, and the second finishes the job's remaining steps.

As on a shared network (docs/multinode.md, CURVE), the broker serves only allowed keys: each node and the
trainer connect with their own, set in the job's config."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tidal.bootstrap import init_hf_model
from tidal.broker.testing import make_curve_keys
from tidal.config import RunConfig
from tidal.configio import dump_config, load_config
from tidal.procs import free_port, wait_for_tcp
from tidal.rollout.tasks import prepare_task

REPO = Path(__file__).parents[2]
STEPS = 10


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _tidal(*args: str) -> list[str]:
    return [sys.executable, "-m", "tidal.cli", *args]


def _steps_done(metrics: Path) -> int:
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _wait(predicate, timeout_s: float, what: str, procs: dict[str, subprocess.Popen], logs: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        dead = {n: p.returncode for n, p in procs.items() if p.poll() not in (None, 0)}
        if dead:
            raise AssertionError(f"{dead} died waiting for {what}:\n{_tails(logs)}")
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}:\n{_tails(logs)}")


def _tails(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(logs.glob("*.log")))


@pytest.mark.slow
def test_broker_nodes_and_trainer_started_by_hand_with_a_node_joining_and_one_leaving(tmp_path: Path):
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    keys = make_curve_keys(tmp_path)
    curve = [
        "broker.curve.enabled=true",
        f"broker.curve.server_secret_key_file={keys['broker_secret']}",
        f"broker.curve.allowed_client_keys_dir={keys['allowed']}",
        f"rollout.agent.curve_secret_key_file={keys['node_secret']}",
        f"rollout.agent.curve_server_key_file={keys['broker']}",
        f"trainer.curve_secret_key_file={keys['trainer_secret']}",
        f"trainer.curve_server_key_file={keys['broker']}",
    ]
    config = load_config(
        RunConfig,
        "configs/tiny.yaml",
        [f"run_dir={run_dir}", "task.num_train=2000", "task.num_eval=50", "broker.batch_groups=4", *curve],
    )
    files = prepare_task(config, run_dir)
    init = init_hf_model(config.model, files.tokenizer, run_dir / "init_hf")
    config_path = tmp_path / "job.yaml"
    dump_config(config, config_path)

    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["broker"] = _start(
            _tidal("broker", str(config_path), f"broker.bind={address}", f"broker.data.path={files.train}"),
            logs / "broker.log",
        )
        wait_for_tcp("127.0.0.1", port, 60, procs["broker"])
        node = ["rollout", str(config_path), f"model.path={init}", "--broker", address]
        procs["node0"] = _start(_tidal(*node, "--name", "node0"), logs / "node0.log")
        procs["trainer"] = _start(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node=1",
                f"--master-port={free_port()}",
                "-m",
                "tidal.cli",
                "train",
                str(config_path),
                f"trainer.steps={STEPS}",
                "--broker",
                address,
                f"--init={init}",
                f"--out={run_dir / 'train'}",
            ],
            logs / "trainer.log",
        )
        metrics = run_dir / "metrics.jsonl"
        _wait(lambda: _steps_done(metrics) >= 1, 300, "a step with node0", procs, logs)
        procs["node1"] = _start(_tidal(*node, "--name", "node1"), logs / "node1.log")
        procs["node0"].send_signal(signal.SIGTERM)  # the rest of the job waits for node1
        assert procs["node0"].wait(timeout=60) == 0, _tails(logs)
        after_node0 = _steps_done(metrics)
        assert after_node0 < STEPS, "node0 alone finished the job"
        assert procs["trainer"].wait(timeout=400) == 0, _tails(logs)
        procs["node1"].send_signal(signal.SIGTERM)
        assert procs["node1"].wait(timeout=60) == 0, _tails(logs)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)

    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    submitted = {
        name: int(re.findall(r"stopped: (\d+) groups submitted", (logs / f"{name}.log").read_text())[-1])
        for name in ("node0", "node1")
    }
    assert submitted["node0"] > 0 and submitted["node1"] > 0, submitted
