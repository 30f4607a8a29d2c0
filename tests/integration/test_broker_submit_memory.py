"""Submits through memory shared with the broker (broker/submit_memory.py), against a real broker process
on loopback: the trainer gets every byte, however it reads (the broker's memory, the journal, the wire); a
full ring falls back to the wire; bad spans get error replies; a node killed after its acknowledgement
loses nothing."""

import asyncio
import os
import signal
import sys
import time
import zlib

import numpy as np
import pytest
import zmq

from tidal.broker import protocol as proto
from tidal.broker.client import AsyncBrokerClient, BrokerClient
from tidal.broker.codec import encode_group
from tidal.broker.local_journal import host_id
from tidal.broker.testing import start_broker
from tidal.broker.types import Group, PromptGroup, Sample
from tidal.procs import spawn, stop, tail

pytestmark = pytest.mark.skipif(
    not hasattr(os, "memfd_create") or host_id() is None, reason="needs memfd_create and a boot id (Linux)"
)


def _group(pg: PromptGroup, tokens: int = 300) -> Group:
    """A group whose content follows from its id alone (a killed node's groups can be rebuilt)."""
    rng = np.random.default_rng(zlib.crc32(pg.group_id.encode()))
    samples = [
        Sample(
            prompt_ids=rng.integers(0, 1000, 5, dtype=np.int32),
            response_ids=rng.integers(0, 1000, tokens, dtype=np.int32),
            logprobs=rng.standard_normal(tokens).astype(np.float32),
            versions=np.zeros(tokens, np.int32),
            reward=float(i % 2),
            finish_reason="stop",
            meta={"i": i},
        )
        for i in range(pg.n)
    ]
    return Group(group_id=pg.group_id, samples=samples)


def _same(a: Group, b: Group) -> None:
    assert a.group_id == b.group_id and len(a.samples) == len(b.samples)
    for x, y in zip(a.samples, b.samples, strict=True):
        for name in ("prompt_ids", "response_ids", "logprobs", "versions"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name))
        assert (x.reward, x.finish_reason, x.meta) == (y.reward, y.finish_reason, y.meta)


async def _submit_all(address: str, count: int, **client_args) -> tuple[dict[str, Group], AsyncBrokerClient]:
    client = AsyncBrokerClient(address, timeout_s=20, **client_args)
    await client.register("rollout", "shared")
    sent: dict[str, Group] = {}
    while len(sent) < count:
        lease = await client.lease(2)
        groups = [_group(pg) for pg in lease.groups]
        await client.submit(lease.lease_id, groups)
        sent.update((g.group_id, g) for g in groups)
    return sent, client


@pytest.mark.parametrize("reads", ["memory", "journal", "wire"], ids=["broker-memory", "journal", "wire"])
def test_groups_submitted_through_shared_memory_reach_the_trainer_bit_for_bit(tmp_path, reads):
    proc, address = start_broker(tmp_path, 32, group_size=4, batch_groups=4, max_staleness=100)
    try:

        async def produce():
            sent, client = await _submit_all(address, 8)
            assert client._ring is not None and client.span_submits > 0 and client.wire_submits == 0
            await client.close()
            return sent

        sent = asyncio.run(produce())
        trainer_args = {
            "memory": {},
            "journal": {"read_memory": False},
            "wire": {"read_journal": False},
        }[reads]
        with BrokerClient(address, timeout_s=20, **trainer_args) as trainer:
            trainer.register("trainer", "t")
            got = {}
            for after in (-1, 0):
                batch = trainer.get_batch(after, timeout_s=10)
                got.update((g.group_id, g) for g in batch.groups)
            assert sorted(got) == sorted(sent)
            if reads == "memory":  # copied from the trainer's own mapping of the node's ring
                assert trainer._local.memory.ring_frames == 8
            for gid, group in got.items():
                _same(group, sent[gid])
            stats = trainer.stats()
            assert stats["submit_memory"]["spans_taken"] == 8 and stats["submit_memory"]["wire_submits"] == 0
            assert stats["submit_memory"]["spans_held"] == 8  # nothing consumed yet
            trainer.report_consumed(1)
            assert trainer.stats()["submit_memory"]["spans_held"] == 0
    finally:
        stop(proc)


def test_a_full_ring_sends_submits_over_the_wire_and_consumed_groups_make_room(tmp_path):
    one = len(encode_group(_group(PromptGroup("g", None, 4))))  # type: ignore[arg-type]
    proc, address = start_broker(
        tmp_path,
        32,
        group_size=4,
        batch_groups=4,
        max_staleness=100,
        submit_memory_bytes=5 * one,  # room for four groups (each span is rounded up)
    )
    try:

        async def scenario():
            sent, client = await _submit_all(address, 8)
            assert client.span_submits == 2 and client.wire_submits == 2
            with BrokerClient(address, timeout_s=20) as trainer:
                trainer.register("trainer", "t")
                first = trainer.get_batch(-1, timeout_s=10)
                for g in first.groups:
                    _same(g, sent[g.group_id])
                trainer.report_consumed(first.batch_id)
                memory = trainer.stats()["submit_memory"]
                held = memory["spans_held"]
                assert memory["wire_submits"] == 2  # the broker counts what the node sent past its full ring
            lease = await client.lease(2)
            await client.submit(lease.lease_id, [_group(pg) for pg in lease.groups])
            assert client.span_submits == 3, "consumed groups gave their room back"
            await client.close()
            return held

        held = asyncio.run(scenario())
        assert held < 4
    finally:
        stop(proc)


def _recv(sock: zmq.Socket) -> tuple[int, str, dict]:
    assert sock.poll(10_000), "no reply from the broker"
    return proto.decode_reply(sock.recv_multipart()[0])


def test_bad_spans_get_an_error_reply_and_the_broker_keeps_serving(tmp_path):
    proc, address = start_broker(tmp_path, 16, group_size=2, batch_groups=2)
    ctx = zmq.Context()
    local, remote = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for sock in (local, remote):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        register = {"role": "rollout", "name": "raw", "host": host_id()}
        local.send_multipart([proto.encode_envelope("register", 1, register)])
        offer = _recv(local)[2]["submit_memory"]
        assert offer["bytes"] > 0
        remote.send_multipart([proto.encode_envelope("register", 1, {**register, "host": "elsewhere"})])
        assert "submit_memory" not in _recv(remote)[2]
        local.send_multipart([proto.encode_envelope("lease", 2, {"max_groups": 1})])
        lease_id = _recv(local)[2]["lease"]["lease_id"]
        bad = [
            (local, {"lease_id": lease_id, "groups": 1, "spans": [[0, offer["bytes"] + 1]]}, proto.BAD_FRAME),
            (local, {"lease_id": lease_id, "groups": 1, "spans": "nowhere"}, proto.BAD_FRAME),
            (local, {"lease_id": lease_id, "groups": 2, "spans": [[0, 64]]}, proto.BAD_FRAME),
            (local, {"lease_id": lease_id, "groups": 1, "spans": [[0, 64]]}, proto.BAD_GROUP),  # zeros
            (remote, {"lease_id": lease_id, "groups": 1, "spans": [[0, 64]]}, proto.NO_SUBMIT_MEMORY),
        ]
        for rid, (sock, body, code) in enumerate(bad, start=10):
            sock.send_multipart([proto.encode_envelope("submit", rid, body)])
            got_rid, type_, reply = _recv(sock)
            assert (got_rid, type_, reply["code"]) == (rid, "error", code), reply
        local.send_multipart([proto.encode_envelope("stats", 99)])
        stats = _recv(local)[2]
        assert stats["counters"]["accepted_groups"] == 0
        assert stats["submit_memory"]["spans_held"] == 0  # refused spans are given back
    finally:
        local.close(0)
        remote.close(0)
        ctx.term()
        stop(proc)


# A rollout node that submits through shared memory, says so once acknowledged, and waits to be killed.
NODE = """
import asyncio, sys
sys.path.insert(0, sys.argv[2])
from test_broker_submit_memory import _submit_all

async def main():
    sent, client = await _submit_all(sys.argv[1], 4)
    assert client.span_submits and not client.wire_submits
    print("ACKED " + " ".join(sorted(sent)), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_a_node_killed_after_its_acknowledgement_loses_no_group(tmp_path):
    proc, address = start_broker(tmp_path, 16, group_size=4, batch_groups=4, max_staleness=100)
    log = tmp_path / "node.log"
    node = spawn([sys.executable, "-c", NODE, address, os.path.dirname(__file__)], log_path=log)
    try:
        deadline = time.monotonic() + 60
        acked = None
        while acked is None and time.monotonic() < deadline:
            lines = (
                [ln for ln in log.read_text().splitlines() if ln.startswith("ACKED ")] if log.exists() else []
            )
            acked = lines[0].split()[1:] if lines else None
            assert node.poll() is None or acked, f"node exited:\n{tail(log)}"
            time.sleep(0.05)
        assert acked, f"no acknowledgement within 60 s:\n{tail(log)}"
        node.send_signal(signal.SIGKILL)
        node.wait(10)
        with BrokerClient(address, timeout_s=20) as trainer:
            trainer.register("trainer", "t")
            batch = trainer.get_batch(-1, timeout_s=10)
            assert sorted(g.group_id for g in batch.groups) == sorted(acked)
            for g in batch.groups:  # the bytes the node wrote before it died, as it wrote them
                _same(g, _group(PromptGroup(g.group_id, None, 4)))  # type: ignore[arg-type]
    finally:
        if node.poll() is None:
            node.kill()
        stop(proc)
