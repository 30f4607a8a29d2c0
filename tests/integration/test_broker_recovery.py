"""Real processes on loopback: a rollout node SIGKILLed mid-lease, and the broker SIGKILLed mid-run."""

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from tidal.broker.client import BrokerClient, BrokerTimeout, LeaseRejected
from tidal.broker.testing import fake_group, start_broker
from tidal.procs import free_port, kill_tree, spawn, stop, tail

pytestmark = pytest.mark.slow

# A rollout node that takes a lease, says which prompts it holds, and hangs (never heartbeats).
HANGING_NODE = """
import asyncio, json, sys
from tidal.broker.client import AsyncBrokerClient

async def main():
    client = AsyncBrokerClient(sys.argv[1], timeout_s=10)
    await client.register("rollout", "doomed")
    lease = await client.lease(4)
    print("LEASED " + json.dumps([g.group_id for g in lease.groups]), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def _wait_for_line(path, prefix, proc, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines() if path.exists() else []:
            if line.startswith(prefix):
                return line[len(prefix) :]
        assert proc.poll() is None, f"process exited early:\n{tail(path)}"
        time.sleep(0.05)
    raise TimeoutError(f"no {prefix!r} line in {path}:\n{tail(path)}")


def _drain(address, num_rows):
    """A healthy node and a trainer in one loop: returns the trained group ids, batch by batch."""
    trained: list[str] = []
    with BrokerClient(address, timeout_s=10) as node, BrokerClient(address, timeout_s=10) as trainer:
        node.register("rollout", "healthy")
        trainer.register("trainer", "t")
        after, deadline = -1, time.monotonic() + 60
        while time.monotonic() < deadline:
            lease = node.lease(3)
            if lease is not None:
                node.submit(lease.lease_id, [fake_group(pg) for pg in lease.groups])
            batch = trainer.get_batch(after, timeout_s=0.2)
            if batch is not None:
                trained += [g.group_id for g in batch.groups]
                trainer.publish_version(batch.batch_id + 1)
                trainer.report_consumed(batch.batch_id)
                after = batch.batch_id
            elif trainer.stats()["finished"]:
                return trained, trainer.stats()
    raise TimeoutError(f"run did not finish; trained {len(trained)} of {num_rows}")


def _tidal_journal(directory, *flags):
    """``tidal journal`` on a journal a killed broker left: (exit code, stdout)."""
    cmd = [sys.executable, "-m", "tidal.cli", "journal", str(directory), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


def test_node_killed_mid_lease_loses_no_prompt(tmp_path):
    proc, address = start_broker(
        tmp_path, 12, group_size=2, batch_groups=4, max_staleness=4, lease_timeout_s=1.0, data={"epochs": 1}
    )
    node = None
    try:
        log = tmp_path / "node.log"
        node = spawn([sys.executable, "-c", HANGING_NODE, address], log_path=log)
        held = json.loads(_wait_for_line(log, "LEASED ", node))
        assert len(held) == 4
        kill_tree(node, signal.SIGKILL)
        node.wait(10)
        trained, stats = _drain(address, 12)
        assert sorted(trained) == sorted(f"0:{i}" for i in range(12))  # every prompt, each once
        assert set(held) <= set(trained)
        assert stats["counters"]["expired_leases"] >= 1
    finally:
        if node is not None:
            stop(node)
        stop(proc)


def test_broker_killed_and_restarted_loses_no_acknowledged_group_and_duplicates_none(tmp_path):
    rows, port = 60, free_port()
    settings = dict(group_size=2, batch_groups=3, max_staleness=100, lease_timeout_s=2.0, data={"epochs": 1})
    proc, address = start_broker(tmp_path, rows, port=port, **settings)
    acked: set[str] = set()
    received: dict[int, list[str]] = {}
    mismatches: list[int] = []
    redelivered: list[int] = []
    trainer_restart = threading.Event()
    errors: list[BaseException] = []
    done = threading.Event()

    def node_loop():
        with BrokerClient(address, timeout_s=1.0) as c:
            while not done.is_set():
                try:
                    if c.node_id is None:
                        c.register("rollout", "n")
                    lease = c.lease(2)
                    if lease is None:
                        if c.heartbeat()["finished"]:
                            return
                        time.sleep(0.02)
                        continue
                    time.sleep(0.01)  # "generation"
                    c.submit(lease.lease_id, [fake_group(pg, response_len=16) for pg in lease.groups])
                    acked.update(pg.group_id for pg in lease.groups)
                except (BrokerTimeout, LeaseRejected):
                    continue

    def trainer_loop():
        consumed, after = -1, -1
        with BrokerClient(address, timeout_s=1.0) as c:
            while not done.is_set():
                if trainer_restart.is_set():
                    trainer_restart.clear()
                    after = consumed  # the trainer restarts from its last checkpoint
                try:
                    batch = c.get_batch(after, timeout_s=0.3)
                    if batch is None:
                        if c.stats()["finished"]:
                            return
                        continue
                    ids = [g.group_id for g in batch.groups]
                    if batch.batch_id in received:
                        redelivered.append(batch.batch_id)
                    if received.setdefault(batch.batch_id, ids) != ids:
                        mismatches.append(batch.batch_id)
                    c.publish_version(batch.batch_id + 1)
                    if batch.batch_id >= 1:  # the checkpoint of the step before is durable now
                        # durable first, reported second (as the trainer does): a report whose reply times
                        # out may still have reached the broker, so the restart point must not lag it
                        consumed = batch.batch_id - 1
                        c.report_consumed(batch.batch_id - 1)
                    after = batch.batch_id
                    time.sleep(0.02)
                except BrokerTimeout:
                    after = consumed

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # surfaced by the assertion below
                errors.append(exc)

        return run

    threads = [threading.Thread(target=guarded(f), daemon=True) for f in (node_loop, trainer_loop)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(received) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(received) >= 4, f"no progress before the crash:\n{tail(tmp_path / 'broker.log')}"
        kill_tree(proc, signal.SIGKILL)
        proc.wait(10)
        acked_before_crash = set(acked)
        code, out = _tidal_journal(tmp_path / "journal", "--format", "json")
        assert code == 0, out
        audit = json.loads(out)
        assert audit["problems"] == [] and audit["accepted"] >= len(acked_before_crash)
        time.sleep(0.5)
        proc, _ = start_broker(tmp_path, rows, port=port, **settings)
        trainer_restart.set()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), f"run did not finish:\n{tail(tmp_path / 'broker.log')}"
        assert not errors, errors
        assert redelivered, "the restarted trainer should have been given its unconsumed batch again"
        assert not mismatches, f"batches {mismatches} changed between deliveries"
        trained = [g for b in sorted(received) for g in received[b]]
        assert sorted(received) == list(range(len(received)))
        assert len(trained) == len(set(trained)), "a group was dispensed in two batches"
        assert acked_before_crash <= set(trained) and acked <= set(trained)
        assert sorted(trained) == sorted(f"0:{i}" for i in range(rows))
        assert "journal" in tail(tmp_path / "broker.log", 200)
    finally:
        done.set()
        stop(proc)


@pytest.mark.parametrize("writer", ["loop", "thread"])
def test_compaction_while_serving_answers_every_request_and_survives_a_kill(tmp_path, writer):
    """Compaction on every report: every reply still comes (none left waiting for the journal), and a
    broker SIGKILLed right after serves the next batch from the compacted log (its groups read from the
    earlier file the log refers to)."""
    port = free_port()
    settings = dict(
        port=port,
        group_size=2,
        batch_groups=2,
        max_staleness=100,
        journal={"writer": writer, "compact_every_bytes": 1, "compact_dead_per_live": 0},
    )
    proc, address = start_broker(tmp_path, 24, **settings)
    try:
        with BrokerClient(address, timeout_s=10) as node, BrokerClient(address, timeout_s=10) as trainer:
            node.register("rollout", "n")
            trainer.register("trainer", "t")
            for after in range(-1, 3):
                lease = node.lease(2)
                node.submit(lease.lease_id, [fake_group(pg) for pg in lease.groups])
                batch = trainer.get_batch(after, timeout_s=10)
                assert batch is not None and batch.batch_id == after + 1
                trainer.report_consumed(batch.batch_id)  # compacts: the reply must still come
            lease = node.lease(2)
            node.submit(lease.lease_id, [fake_group(pg) for pg in lease.groups])
            pending = sorted(pg.group_id for pg in lease.groups)
            trainer.report_consumed(2)  # compacts again with these groups live: they stay where they lie
            assert trainer.stats()["journal"]["bytes"] < 40_000  # compacted, not grown with every group
            deadline = time.monotonic() + 10  # the writer thread compacts after the reply
            while (
                not (kept := list((tmp_path / "journal").glob("journal.*.log")))
                and time.monotonic() < deadline
            ):
                time.sleep(0.01)
            assert len(kept) == 1, "only the file holding the live groups is kept"
            disk = trainer.stats()["journal"]
            assert disk["files_kept"] == 1 and disk["dir_bytes"] >= disk["bytes"]
        kill_tree(proc, signal.SIGKILL)
        proc.wait()
        code, out = _tidal_journal(tmp_path / "journal")
        assert code == 0 and "keeps 2 accepted groups" in out, out
        # where the live groups lie in the kept file (REF records, unless the last compaction ran before
        # they came), they were read back from it
        assert "read back and checked" in out or " REF" not in out, out
        proc, address = start_broker(tmp_path, **settings)
        with BrokerClient(address, timeout_s=10) as trainer:
            trainer.register("trainer", "t")
            batch = trainer.get_batch(3, timeout_s=10)
            assert batch is not None and sorted(g.group_id for g in batch.groups) == pending
    finally:
        stop(proc)


def test_a_broker_restarted_over_other_data_refuses_its_journal_and_says_why(tmp_path):
    proc, address = start_broker(tmp_path, 20, group_size=2)
    try:
        with BrokerClient(address, timeout_s=10) as node:
            node.register("rollout", "n")
            leased = sorted(pg.group_id for pg in node.lease(2).groups)
    finally:
        stop(proc)
    (tmp_path / "data.jsonl").unlink()  # start_broker writes rows again: 8 of them
    with pytest.raises(RuntimeError) as err:
        start_broker(tmp_path, 8, group_size=2)
    message = str(err.value)
    assert "exited with 2" in message and "written over other prompt data" in message, message
    assert "rows 20 -> 8" in message and "digest" in message
    # the journal is left as it was: over its own data the broker resumes it, the leased prompts first
    (tmp_path / "data.jsonl").unlink()
    proc, address = start_broker(tmp_path, 20, group_size=2)
    try:
        with BrokerClient(address, timeout_s=10) as node:
            node.register("rollout", "n")
            assert sorted(pg.group_id for pg in node.lease(2).groups) == leased
    finally:
        stop(proc)


def test_a_second_broker_on_the_same_journal_is_refused_and_a_killed_ones_lock_goes_with_it(tmp_path):
    proc, _ = start_broker(tmp_path, 20)
    try:
        with pytest.raises(RuntimeError) as err:
            start_broker(tmp_path, 20)  # another port, the same run_dir: the same journal
        message = str(err.value)
        assert "exited with 2" in message and f"in use by another broker (pid {proc.pid} " in message, message
        code, out = _tidal_journal(tmp_path / "journal")
        assert code == 0 and f"a broker is writing it now (pid {proc.pid} " in out, out
        kill_tree(proc, signal.SIGKILL)
        proc.wait(10)
        proc, address = start_broker(tmp_path, 20)  # the lock went with the process that held it
        with BrokerClient(address, timeout_s=10) as node:
            node.register("rollout", "n")
            assert node.lease(1) is not None
    finally:
        stop(proc)


def test_a_prompts_failed_attempts_survive_a_broker_killed_and_restarted(tmp_path):
    port = free_port()
    settings = dict(group_size=2, batch_groups=1, max_group_failures=2, max_staleness=4, data={"epochs": 1})
    proc, address = start_broker(tmp_path, 1, port=port, **settings)
    try:
        with BrokerClient(address, timeout_s=10) as node:
            node.register("rollout", "n")
            lease = node.lease(1)
            (bad,) = [g.group_id for g in lease.groups]
            assert node.release(lease.lease_id, error="SampleFailed: prompt too long") == 1
        # the reply came once the attempt was journaled: a kill now loses nothing
        kill_tree(proc, signal.SIGKILL)
        proc.wait(10)
        proc, address = start_broker(tmp_path, 1, port=port, **settings)
        with BrokerClient(address, timeout_s=10) as node:
            node.register("rollout", "n")
            lease = node.lease(1)
            assert [g.group_id for g in lease.groups] == [bad]
            # its second failed attempt, the first since the restart: dropped, not leased again
            assert node.release(lease.lease_id, error="SampleFailed: prompt too long") == 0
            stats = node.stats()
        assert stats["counters"]["failed_groups"] == 1 and stats["finished"]
    finally:
        stop(proc)
    code, out = _tidal_journal(tmp_path / "journal")
    assert code == 0 and "1 dropped as failed" in out, out
