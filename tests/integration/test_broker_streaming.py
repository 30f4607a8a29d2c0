"""Protocol v3's streamed submits against a real broker on loopback: cumulative acknowledgements, sent
only once journaled, and the client's window of unacknowledged bytes."""

import asyncio
from pathlib import Path

import msgpack
import pytest
import zmq

from tidal.broker import protocol as proto
from tidal.broker.client import AsyncBrokerClient, BrokerClient
from tidal.broker.codec import encode_group, lease_from_wire
from tidal.broker.testing import fake_group, start_broker
from tidal.procs import stop


@pytest.fixture
def broker(tmp_path):
    proc, address = start_broker(tmp_path, 64, group_size=2, batch_groups=4, max_staleness=100)
    yield address
    stop(proc)


def _recv(sock: zmq.Socket) -> tuple[int, str, dict]:
    assert sock.poll(10_000), "no reply from the broker"
    return proto.decode_reply(sock.recv_multipart()[0])


def test_submits_sent_back_to_back_are_acknowledged_cumulatively_and_errors_stay_their_own(broker):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker)
    try:
        sock.send_multipart([proto.encode_envelope("register", 1, {"role": "rollout", "name": "raw"})])
        node_id = _recv(sock)[2]["node_id"]
        sock.send_multipart([proto.encode_envelope("lease", 2, {"max_groups": 6})])
        lease = lease_from_wire(_recv(sock)[2]["lease"])
        frames = [bytes(encode_group(fake_group(pg))) for pg in lease.groups]
        # Six submits in one burst, one of them on an unknown lease: nothing waits for a reply.
        rids = list(range(10, 17))
        for i, rid in enumerate(rids):
            lease_id = "no-such-lease" if i == 3 else lease.lease_id
            frame = frames[i if i < 3 else i - 1]
            body = {"lease_id": lease_id, "groups": 1}
            sock.send_multipart([proto.encode_envelope("submit", rid, body), frame])
        acked, errors, messages = 0, [], 0
        while acked < rids[-1]:
            rid, type_, body = _recv(sock)
            messages += 1
            if type_ == "error":
                errors.append((rid, body["code"]))
                continue
            assert type_ == "ack" and body["node_id"] == node_id
            assert body["through"] > acked  # cumulative: each ack covers more
            acked = body["through"]
        assert errors == [(13, proto.LEASE_REJECTED)]
        assert messages <= len(rids)
        # Every acknowledged group is journaled and buffered: the stats count them, once.
        sock.send_multipart([proto.encode_envelope("stats", 99)])
        stats = _recv(sock)[2]
        assert stats["counters"]["accepted_groups"] == 6
        assert stats["counters"]["rejected_submissions"] == 1
    finally:
        sock.close(0)
        ctx.term()


def test_streamed_submits_resolve_with_their_groups_and_respect_the_window(broker):
    async def scenario() -> None:
        # Over the wire (the window bounds frames in flight; submits through shared memory have the ring)
        async with AsyncBrokerClient(broker, timeout_s=20, submit_memory=False) as client:
            await client.register("rollout", "streamer")
            lease = await client.lease(8)
            groups = [fake_group(pg, response_len=256) for pg in lease.groups]
            one = len(encode_group(groups[0]))
            # Room for one group frame only: a second submit waits until the first is acknowledged.
            client.max_unacked_bytes = one
            acks = []
            for g in groups:
                acks.append(await client.submit_streamed(lease.lease_id, [g]))
                assert client._unacked_bytes <= one
                assert all(a.done() for a in acks[:-1])
            results = await asyncio.gather(*acks)
            assert [r["accepted"] for r in results] == [[g.group_id] for g in groups]
            assert all(r["filtered"] == [] for r in results)
            assert client._unacked_bytes == 0
            assert (await client.stats())["counters"]["accepted_groups"] == len(groups)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_the_blocking_client_reads_acks_and_reports_filtered_groups(tmp_path):
    proc, address = start_broker(tmp_path, 16, group_size=2, batch_groups=2, dynamic_sampling=True)
    try:
        with BrokerClient(address, timeout_s=20) as client:
            client.register("rollout", "blocking")
            lease = client.lease(2)
            same, mixed = lease.groups
            out = client.submit(
                lease.lease_id, [fake_group(same, rewards=[1.0, 1.0]), fake_group(mixed, rewards=[0.0, 1.0])]
            )
            assert out == {"accepted": [mixed.group_id], "filtered": [same.group_id]}
            # A client of the previous protocol is told what changed.
            client._sock.send_multipart([msgpack.packb({"v": 2, "type": "stats", "id": 5, "body": {}})])
            rid, type_, body = _recv(client._sock)
            assert (rid, type_, body["code"]) == (5, "error", proto.BAD_VERSION)
            assert "v=3" in body["message"] and "ack" in body["message"]
    finally:
        stop(proc)


def _groups(batch):
    return [
        (g.group_id, [(s.response_ids.tobytes(), s.logprobs.tobytes(), s.reward) for s in g.samples])
        for g in batch.groups
    ]


def test_a_client_on_the_brokers_host_reads_batches_from_the_journal_others_get_frames(tmp_path):
    proc, address = start_broker(tmp_path, 32, group_size=2, batch_groups=2, max_staleness=100)
    try:
        with (
            BrokerClient(address, timeout_s=20) as node,
            BrokerClient(address, timeout_s=20, read_memory=False) as local,
            BrokerClient(address, timeout_s=20, read_journal=False) as remote,
        ):
            node.register("rollout", "n")
            for _ in range(2):
                lease = node.lease(2)
                node.submit(lease.lease_id, [fake_group(pg, response_len=50_000) for pg in lease.groups])
            first = local.get_batch(-1)
            assert local._local.batches_read == 1
            # The same batch on the wire (asked again before it is consumed) holds the same bytes.
            assert _groups(remote.get_batch(-1)) == _groups(first)
            assert all(not s.response_ids.flags.writeable for g in first.groups for s in g.samples)
            # A client that says it is elsewhere gets frames.
            local._local.host = "another-host"
            second = local.get_batch(0)
            assert local._local.batches_read == 1 and len(second.groups) == 2
            assert local.stats()["errors"] == {}
    finally:
        stop(proc)


def test_a_client_on_the_brokers_host_copies_batches_from_its_memory_and_falls_back_to_the_journal(tmp_path):
    proc, address = start_broker(tmp_path, 32, group_size=2, batch_groups=2, max_staleness=100)
    try:
        with (
            BrokerClient(address, timeout_s=20) as node,
            BrokerClient(address, timeout_s=20) as local,
            BrokerClient(address, timeout_s=20, read_journal=False) as remote,
        ):
            node.register("rollout", "n")
            for _ in range(3):
                lease = node.lease(2)
                node.submit(lease.lease_id, [fake_group(pg, response_len=50_000) for pg in lease.groups])
            first = local.get_batch(-1)
            assert (local._local.batches_copied, local._local.batches_read) == (1, 0)
            assert _groups(remote.get_batch(-1)) == _groups(first)
            assert all(not s.response_ids.flags.writeable for g in first.groups for s in g.samples)
            # Memory the broker no longer holds as it said (here: a checksum that cannot match) is
            # refused; the same reply's journal offsets serve the batch, and later ones come from there.
            real = local._local.memory.read
            local._local.memory.read = lambda pid, refs, rings: real(
                pid, [[a, n, crc ^ 1, *rest] for a, n, crc, *rest in refs], rings
            )
            second = local.get_batch(0)
            assert (local._local.batches_copied, local._local.batches_read) == (1, 1)
            assert local._local.memory is None
            assert _groups(remote.get_batch(0)) == _groups(second)
            assert len(local.get_batch(1).groups) == 2 and local._local.batches_read == 2
            assert local.stats()["errors"] == {}
    finally:
        stop(proc)


def test_a_broker_with_memory_reads_off_gives_local_clients_journal_offsets(tmp_path):
    proc, address = start_broker(tmp_path, 8, group_size=2, batch_groups=2, memory_reads=False)
    try:
        with BrokerClient(address, timeout_s=20) as node, BrokerClient(address, timeout_s=20) as local:
            node.register("rollout", "n")
            lease = node.lease(2)
            node.submit(lease.lease_id, [fake_group(pg, response_len=1000) for pg in lease.groups])
            assert len(local.get_batch(-1).groups) == 2
            assert (local._local.batches_copied, local._local.batches_read) == (0, 1)
    finally:
        stop(proc)


def test_a_broker_with_a_huge_page_heap_starts_itself_again_with_glibcs_tunables_and_serves(tmp_path):
    proc, address = start_broker(tmp_path, 8, group_size=2, batch_groups=2, huge_page_heap_bytes=32 << 20)
    try:
        # The same process (the launcher's pid) now runs with the tunables and faulted its heap in.
        raw = Path(f"/proc/{proc.pid}/environ").read_text()
        environ = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
        assert "glibc.malloc.hugetlb=1" in environ["GLIBC_TUNABLES"].split(":")
        assert "heap on huge pages, 32 MiB faulted in" in (tmp_path / "broker.log").read_text()
        with BrokerClient(address, timeout_s=20) as node, BrokerClient(address, timeout_s=20) as local:
            node.register("rollout", "n")
            lease = node.lease(2)
            node.submit(lease.lease_id, [fake_group(pg, response_len=1000) for pg in lease.groups])
            assert len(local.get_batch(-1).groups) == 2 and local._local.batches_copied == 1
    finally:
        stop(proc)


def test_a_client_asking_ahead_requests_the_next_batch_before_it_decodes_the_one_it_got(tmp_path):
    proc, address = start_broker(tmp_path, 32, group_size=2, batch_groups=2, max_staleness=100)
    try:
        with (
            BrokerClient(address, timeout_s=20) as node,
            BrokerClient(address, timeout_s=20, ask_ahead=True) as trainer,
        ):
            node.register("rollout", "n")
            sent = {}
            for _ in range(3):
                lease = node.lease(2)
                groups = [fake_group(pg, response_len=100) for pg in lease.groups]
                node.submit(lease.lease_id, groups)
                sent.update((g.group_id, g) for g in groups)
            trainer.register("trainer", "t")
            first = trainer.get_batch(-1)
            # another call while the request ahead is out: its reply is kept for the get_batch below
            assert trainer.stats()["batches"]["next"] == 2
            second = trainer.get_batch(0)
            third = trainer.get_batch(1)
            assert trainer.batches_asked_ahead == 2
            assert [b.batch_id for b in (first, second, third)] == [0, 1, 2]
            assert sorted(g.group_id for b in (first, second, third) for g in b.groups) == sorted(sent)
            for batch in (first, second, third):
                for g in batch.groups:
                    assert _groups(type(batch)(0, [g], 0)) == _groups(type(batch)(0, [sent[g.group_id]], 0))
    finally:
        stop(proc)
