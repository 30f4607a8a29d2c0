"""Broker + rollout nodes (each with its own embedded engine) + a test consumer, all real processes.

The consumer plays the trainer: it pulls batches and publishes a new policy version after each, which
(with max_staleness=0) is what lets the broker lease the next batch's prompts. That makes the schedule
deterministic: node a fills batch 0, then takes a lease it never finishes (its engine is frozen) and is
SIGKILLed; node b joins late and must deliver every remaining prompt, a's included.
"""

import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tidal.broker.client import BrokerClient
from tidal.broker.testing import start_broker
from tidal.cli import load_run_config
from tidal.model_identity import model_identity
from tidal.procs import free_port, kill_tree, python_cmd, spawn, stop, tail
from tidal.rollout.tasks.arithmetic import make_records

GROUP_SIZE = 4
BATCH_GROUPS = 4
NUM_PROMPTS = 16
MAX_NEW_TOKENS = 6
TINY_MODEL = load_run_config("configs/tiny.yaml", []).model


def child_pids(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_node(tmp_path: Path, address: str, name: str, *overrides: str):
    cmd = python_cmd(
        "rollout",
        "configs/tiny.yaml",
        *overrides,
        f"run_dir={tmp_path / 'run'}",
        f"rollout.sampling.max_new_tokens={MAX_NEW_TOKENS}",
        "rollout.heartbeat_s=0.5",
        "rollout.agent.lease_poll_s=0.1",
        "rollout.agent.drain_timeout_s=10",
        "--broker",
        address,
        "--name",
        name,
    )
    return spawn(cmd, log_path=tmp_path / f"node-{name}.log")


def wait_until(predicate, timeout_s: float, what: str, logs=()):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(
        f"timed out after {timeout_s}s waiting for {what}\n" + "\n".join(tail(p) for p in logs)
    )


def node_named(stats: dict, name: str) -> dict | None:
    return next((n for n in stats["nodes"].values() if n["name"] == name), None)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_nodes_deliver_every_prompt_once_through_a_sigkill_and_a_late_join(tmp_path):
    rows, _ = make_records(digits=2, num_train=NUM_PROMPTS, num_eval=4, seed=0)
    broker, address = start_broker(
        tmp_path / "broker",
        rows=rows,
        group_size=GROUP_SIZE,
        batch_groups=BATCH_GROUPS,
        max_staleness=0,
        staleness_policy="keep",  # the engines never get new weights here; keep their version-0 groups
        lease_timeout_s=3.0,
        node_timeout_s=2.0,
        data={"epochs": 1, "shuffle": False},
    )
    logs = [tmp_path / "node-a.log", tmp_path / "node-b.log", tmp_path / "broker" / "broker.log"]
    node_a = node_b = None
    consumer = BrokerClient(address, timeout_s=10.0)
    try:
        consumer.register("trainer", "test-consumer")
        node_a = start_node(tmp_path, address, "a")

        def next_batch(after: int, timeout_s: float = 120.0):
            return wait_until(
                lambda: consumer.get_batch(after, timeout_s=0.5), timeout_s, f"batch {after + 1}", logs
            )

        batches = [next_batch(-1)]
        assert {g.meta["node"] for g in batches[0].groups} == {"a"}

        # freeze a's engine, open the next batch, and let a lease it: those prompts are now on a
        engines_a = child_pids(node_a.pid)
        assert len(engines_a) == 1, f"node a should run one engine child, has {engines_a}"
        os.kill(engines_a[0], signal.SIGSTOP)
        consumer.publish_version(1)
        wait_until(
            lambda: (node_named(consumer.stats(), "a") or {}).get("groups_in_flight") == BATCH_GROUPS,
            30,
            "node a to hold a lease of a whole batch",
            logs,
        )
        kill_tree(node_a, signal.SIGKILL)  # its engine dies too: parent-death signal
        node_a.wait(10)
        wait_until(lambda: not alive(engines_a[0]), 10, "node a's engine to die with it")

        node_b = start_node(tmp_path, address, "b")  # joins late
        while True:
            batch = next_batch(batches[-1].batch_id)
            batches.append(batch)
            consumer.publish_version(batch.batch_id + 1)
            if sum(len(b.groups) for b in batches) == NUM_PROMPTS:
                break

        groups = [g for b in batches for g in b.groups]
        rows_seen = sorted(g.meta["row"] for g in groups)
        assert rows_seen == list(range(NUM_PROMPTS)), "every prompt exactly once"
        assert {g.meta["node"] for b in batches[1:] for g in b.groups} == {"b"}
        stats = consumer.stats()
        assert stats["finished"]
        assert stats["counters"]["expired_leases"] >= 1  # a's lease went back to the queue

        prompts = {i: r["prompt"] for i, r in enumerate(rows)}
        for g in groups:
            assert len(g.samples) == GROUP_SIZE
            for s in g.samples:
                n = s.response_ids.size
                assert 1 <= n <= MAX_NEW_TOKENS
                assert s.logprobs.shape == (n,) and s.versions.shape == (n,)
                assert np.all(s.logprobs <= 0) and np.all(s.versions == 0)
                assert s.finish_reason in ("stop", "length")
                assert s.reward in (0.0, 1.0)
                # prompt ids are <bos> + one token per character of the row's prompt
                assert s.prompt_ids.size == 1 + len(prompts[g.meta["row"]])
                assert s.finish_reason == "length" or s.response_ids[-1] == 2  # stops on <eos>

        engines_b = child_pids(node_b.pid)
        assert stop(node_b, timeout_s=30) == 0  # SIGTERM: drains, leaves, stops its engine
        assert not any(alive(p) for p in engines_b)
        assert node_named(consumer.stats(), "b") is None  # it left the broker
    finally:
        for proc in (node_a, node_b):
            if proc is not None:
                stop(proc)
        consumer.close()
        stop(broker)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_prompt_no_engine_can_take_is_dropped_after_its_failures_and_the_run_goes_on(tmp_path):
    rows, _ = make_records(digits=2, num_train=7, num_eval=2, seed=0)
    # longer than the tiny engine's context (rollout.engine.max_seq_len=32): every attempt is refused
    poison = {**rows[0], "prompt": "1+" * 30 + "1=", "reward_model": {"style": "rule", "ground_truth": "31"}}
    rows = [*rows[:3], poison, *rows[3:]]
    logs = [tmp_path / "node-a.log", tmp_path / "broker" / "broker.log"]
    with one_epoch_job(tmp_path, rows, batch_groups=7, max_staleness=4, max_group_failures=3) as job:
        address, consumer, nodes = job
        node = start_node(tmp_path, address, "a")
        nodes.append(node)
        batch = wait_until(lambda: consumer.get_batch(-1, timeout_s=0.5), 120, "the batch of 7 groups", logs)
        assert sorted(g.meta["row"] for g in batch.groups) == [0, 1, 2, 4, 5, 6, 7]
        stats = wait_until(
            lambda: (s := consumer.stats())["finished"] and s, 30, "the broker to finish", logs
        )
        assert stats["counters"]["failed_groups"] == 1
        assert node.poll() is None, "the node gave up: " + tail(logs[0])
        broker_log = (tmp_path / "broker" / "broker.log").read_text()
        assert "group 0:3 dropped after 3 failed attempts" in broker_log
        assert "longer than the model's context length" in broker_log


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_node_whose_weights_the_broker_would_drop_waits_for_newer_ones(tmp_path):
    """A node that starts behind the trainer (started mid-run, or every process of a resumed run) loads the
    run's first weights. Under the `drop` policy its groups would all be dropped as stale and its prompts
    used up (seen: a resumed run whose one remaining epoch went that way), so it leases nothing until its
    engines serve a version within max_staleness. Here the new version arrives through SGLang's
    /update_weight_version, as the trainer's sync names it."""
    rows, _ = make_records(digits=2, num_train=4, num_eval=2, seed=0)
    logs = [tmp_path / "node-a.log", tmp_path / "broker" / "broker.log"]
    with one_epoch_job(tmp_path, rows, batch_groups=4, max_staleness=1) as job:
        address, consumer, nodes = job
        consumer.publish_version(3)
        nodes.append(start_node(tmp_path, address, "a"))
        wait_until(
            lambda: "waiting for the trainer's weights" in logs[0].read_text(), 60, "the node to wait", logs
        )
        time.sleep(1.0)  # it goes on waiting: nothing leased
        stats = consumer.stats()
        assert (stats["in_flight_groups"], stats["cursor"]["pos"]) == (0, 0)
        (url,) = node_named(stats, "a")["meta"]["engines"]
        httpx.post(f"{url}/update_weight_version", json={"new_version": "3"}, timeout=10).raise_for_status()
        batch = wait_until(lambda: consumer.get_batch(-1, timeout_s=0.5), 120, "the batch", logs)
        assert sorted(g.meta["row"] for g in batch.groups) == [0, 1, 2, 3]
        assert {int(g.min_version) for g in batch.groups} == {3}
        assert consumer.stats()["counters"]["dropped_stale_groups"] == 0
        assert "engines now serve weights of version 3; leasing again" in logs[0].read_text()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_nodes_serving_another_model_than_the_trainers_stop_with_a_config_error_and_lose_no_prompt(tmp_path):
    """Their samples would be trained as the policy's (seen: a node started by hand with another config
    joined and leased); their token ids could even lie beyond the trainer's vocabulary. One that joined
    before the trainer leases nothing and is let go when the trainer registers, one that joins after is
    refused."""
    rows, _ = make_records(digits=2, num_train=4, num_eval=2, seed=0)
    logs = [tmp_path / f"node-{n}.log" for n in ("early", "late")] + [tmp_path / "broker" / "broker.log"]
    with one_epoch_job(tmp_path, rows, trainer_registers=False, batch_groups=4, max_staleness=1) as job:
        address, consumer, nodes = job
        early = start_node(tmp_path, address, "early", "model.hidden_size=64")
        nodes.append(early)
        wait_until(lambda: node_named(consumer.stats(), "early"), 120, "the early node to register", logs)
        time.sleep(1.0)  # it leases nothing
        assert consumer.stats()["cursor"]["pos"] == 0
        consumer.register("trainer", "test-consumer", {"model": model_identity(TINY_MODEL)})
        late = start_node(tmp_path, address, "late", "model.hidden_size=64")
        nodes.append(late)
        for node, log in zip((early, late), logs, strict=False):
            assert wait_until(lambda n=node: n.poll(), 120, "the node to exit", logs) == 2, tail(log)
            text = log.read_text()
            assert (
                "(model_mismatch): rollout node" in text
                and "serves qwen3_moe (vocab 32, hidden 64, 2 layers" in text
            )
            assert "but the trainer trains qwen3_moe (vocab 32, hidden 128, 2 layers" in text
        broker_log = logs[2].read_text()
        assert "let go: rollout node 'early' serves" in broker_log
        assert "refused: broker" not in broker_log and "refused: rollout node 'late' serves" in broker_log
        # a node of the trainer's model takes every prompt, those the early one held included
        nodes.append(start_node(tmp_path, address, "same"))
        batch = wait_until(lambda: consumer.get_batch(-1, timeout_s=0.5), 120, "the batch", logs)
        assert sorted(g.meta["row"] for g in batch.groups) == [0, 1, 2, 3]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_node_waiting_for_a_broker_that_does_not_answer_stops_on_sigterm(tmp_path):
    """Seen by hand: a node started after its job's broker had stopped went on waiting for it through a
    SIGTERM (rollout.agent.broker_wait_s, 600 s); `timeout` and a supervisor's stop could not end it."""
    log = tmp_path / "node-late.log"
    node = start_node(tmp_path, f"tcp://127.0.0.1:{free_port()}", "late", "rollout.agent.broker_timeout_s=1")
    try:
        wait_until(lambda: "no reply from the broker" in log.read_text(), 90, "the node to wait", [log])
        engines = child_pids(node.pid)
        node.send_signal(signal.SIGTERM)
        assert node.wait(15) == 0, tail(log)
        assert "stopped while waiting for the broker" in log.read_text()
        assert not [pid for pid in engines if alive(pid)]
    finally:
        kill_tree(node)


@contextlib.contextmanager
def one_epoch_job(tmp_path: Path, rows, trainer_registers: bool = True, **settings):
    """A broker over ``rows`` (one epoch, in order) and a consumer registered as the trainer; yields
    (address, consumer, nodes): the node processes the test appends are stopped at the end."""
    broker, address = start_broker(
        tmp_path / "broker",
        rows=rows,
        group_size=GROUP_SIZE,
        data={"epochs": 1, "shuffle": False},
        **settings,
    )
    consumer = BrokerClient(address, timeout_s=10.0)
    nodes = []
    try:
        # as the trainer does: with the identity of the model it trains, the one configs/tiny.yaml builds
        if trainer_registers:
            consumer.register("trainer", "test-consumer", {"model": model_identity(TINY_MODEL)})
        yield address, consumer, nodes
    finally:
        for node in nodes:
            stop(node)
        consumer.close()
        stop(broker)
