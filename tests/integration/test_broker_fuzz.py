"""10,000 fuzzed frames over a real socket: each gets a reply, the broker counts them and keeps serving."""

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from tidal.broker import protocol as proto
from tidal.broker.client import BrokerClient
from tidal.broker.codec import encode_group, lease_from_wire
from tidal.broker.testing import fake_group, start_broker
from tidal.procs import stop

pytestmark = pytest.mark.slow

FRAMES_PER_EXAMPLE = 100
EXAMPLES = 100  # 10,000 frames in all

_scalars = hs.one_of(
    hs.none(),
    hs.booleans(),
    hs.integers(-(2**63), 2**64 - 1),
    hs.floats(allow_nan=True),
    hs.text(max_size=12),
    hs.binary(max_size=24),
)
_values = hs.recursive(
    _scalars,
    lambda inner: hs.lists(inner, max_size=3) | hs.dictionaries(hs.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_field_names = hs.sampled_from(
    [
        "role",
        "name",
        "max_groups",
        "lease_id",
        "groups",
        "version",
        "after",
        "batch_id",
        "group_ids",
        "meta",
        "num_groups",
        "x",
    ]
)
_bodies = hs.dictionaries(_field_names, _values, max_size=4)
# get_batch always carries timeout_s=0 so that no fuzzed request is left waiting for a batch; the fuzzing
# peer does not leave or re-register, so that its lease stays open and submissions reach the group decoder.
_types = hs.sampled_from(
    [t for t in proto.REQUESTS if t not in ("get_batch", "leave", "register")] + ["nope", ""]
)


V = proto.PROTOCOL_VERSION


@hs.composite
def _envelope_frames(draw):
    if draw(hs.booleans()):
        env = {
            "v": draw(hs.sampled_from([V, V, V, 0, 1, V + 1, str(V), None])),
            "type": draw(_types),
            "id": draw(hs.integers(0, 2**31)),
            "body": draw(_bodies),
        }
    else:
        env = {
            "v": V,
            "type": "get_batch",
            "id": draw(hs.integers(0, 2**31)),
            "body": {**draw(_bodies), "timeout_s": 0},
        }
    frames = [msgpack.packb(env)]
    if env["type"] == "submit" and draw(hs.booleans()):
        frames += draw(hs.lists(hs.binary(max_size=64), max_size=2))
    return frames


_frames = hs.one_of(
    hs.binary(max_size=64).map(lambda b: [b]),
    _values.map(lambda v: [msgpack.packb(v)]),
    _envelope_frames(),
    hs.lists(hs.binary(max_size=16), min_size=2, max_size=3),
)

# The fuzzing peer's real leases. Submissions go to one, so that they reach the group decoder; releases go
# to the other, because a mutated release that loses its group_ids releases its whole lease, and that must
# not end the submit lease early (every later submit would be refused before its group is looked at).
LIVE: dict[str, bytes | str] = {}


def _valid_messages() -> list[list[bytes]]:
    lease_id, group = LIVE["lease_id"], LIVE["group"]
    release = {"lease_id": LIVE["release_lease_id"], "group_ids": [LIVE["release_group_id"]]}
    return [
        [proto.encode_envelope("submit", 7, {"lease_id": lease_id, "groups": 1}), group],
        [proto.encode_envelope("lease", 8, {"max_groups": 1})],
        [proto.encode_envelope("heartbeat", 9)],
        [proto.encode_envelope("release", 10, release)],
        [proto.encode_envelope("get_batch", 11, {"after": -1, "timeout_s": 0})],
    ]


def _mutate(rnd, message: list[bytes], pool: list[list[bytes]]) -> list[bytes]:
    """Cheap structure-blind mutations of a (mostly) valid message: flips, cuts, growth, splices."""
    if b"get_batch" in message[0]:
        return message  # a mutated get_batch could lose its timeout and wait (legitimately) forever
    parts = [bytearray(p) for p in message]
    i = rnd.randrange(len(parts))
    op = rnd.randrange(6)
    if op == 0 and parts[i]:
        for _ in range(rnd.randint(1, 4)):
            parts[i][rnd.randrange(len(parts[i]))] ^= 1 << rnd.randrange(8)
    elif op == 1:
        del parts[i][rnd.randrange(len(parts[i]) + 1) :]
    elif op == 2:
        parts[i] += rnd.randbytes(rnd.randint(1, 32))
    elif op == 3:
        parts.insert(i, bytearray(parts[i])) if rnd.random() < 0.5 or len(parts) == 1 else parts.pop(i)
    elif op == 4:
        donor = rnd.choice(pool)
        parts[i] = bytearray(rnd.choice(donor))
    return [bytes(p) for p in parts]


@hs.composite
def _batches(draw):
    """100 messages: hypothesis draws seeds (structured and raw), a seeded mutator derives the rest."""
    seeds = draw(hs.lists(_frames, min_size=4, max_size=4)) + _valid_messages()
    rnd = draw(hs.randoms(use_true_random=False))
    return [_mutate(rnd, rnd.choice(seeds), seeds) for _ in range(FRAMES_PER_EXAMPLE)]


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    proc, address = start_broker(
        tmp, 32, group_size=2, batch_groups=2, max_staleness=1000, max_frame_bytes=64 << 10
    )
    yield address
    stop(proc)


@pytest.fixture(scope="module")
def fuzz_socket(broker):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker)
    sock.send_multipart([proto.encode_envelope("register", 1, {"role": "rollout", "name": "fuzzer"})])
    sock.send_multipart([proto.encode_envelope("lease", 2, {"max_groups": 4})])
    sock.send_multipart([proto.encode_envelope("lease", 3, {"max_groups": 4})])
    replies = {}
    for _ in range(3):
        assert sock.poll(10_000)
        rid, _type, body = proto.decode_reply(sock.recv_multipart()[0])
        replies[rid] = body
    submit_lease, release_lease = (lease_from_wire(replies[rid]["lease"]) for rid in (2, 3))
    pg = submit_lease.groups[0]
    LIVE.update(
        lease_id=submit_lease.lease_id,
        group=bytes(encode_group(fake_group(pg))),
        release_lease_id=release_lease.lease_id,
        release_group_id=release_lease.groups[0].group_id,
    )
    yield sock
    sock.close(0)
    ctx.term()


tally = {"sent": 0, "errors": 0}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(batch=_batches())
def test_fuzzed_frames_get_replies(fuzz_socket, batch):
    for frames in batch:
        fuzz_socket.send_multipart(frames)
    for _ in batch:
        assert fuzz_socket.poll(10_000), "the broker stopped answering"
        reply = fuzz_socket.recv_multipart()
        rid, type_, body = proto.decode_reply(reply[0])
        assert type_ in ("ok", "error", "ack")  # an accepted submit is acknowledged by an ack
        if type_ == "error":
            assert isinstance(body["code"], str) and body["message"]
            tally["errors"] += 1
    tally["sent"] += len(batch)


def test_after_the_fuzz_the_broker_serves_a_real_run(broker, fuzz_socket):
    if tally["sent"] == 0:
        pytest.skip("checks the broker after test_fuzzed_frames_get_replies; run the whole module")
    assert tally["sent"] == EXAMPLES * FRAMES_PER_EXAMPLE
    with BrokerClient(broker, timeout_s=10) as client:
        stats = client.stats()
        assert stats["errors"].get("internal", 0) == 0
        assert sum(stats["errors"].values()) == tally["errors"]
        assert stats["counters"]["bad_frames"] > 0
        for code in (proto.BAD_FRAME, proto.BAD_VERSION, proto.UNKNOWN_TYPE, proto.BAD_GROUP):
            assert stats["errors"].get(code, 0) > 0, f"the fuzz never produced a {code} frame"
        client.register("rollout", "after-fuzz")
        lease = client.lease(1)
        assert client.submit(lease.lease_id, [fake_group(pg) for pg in lease.groups])["accepted"]


def test_oversized_messages_are_refused_and_the_broker_keeps_serving(broker):
    with BrokerClient(broker, timeout_s=10) as client:
        before = client.stats()["errors"].get(proto.TOO_LARGE, 0)
        # Several parts that together pass the limit: refused with an error reply.
        env = proto.encode_envelope("submit", 1, {"lease_id": "x", "groups": 2})
        client._sock.send_multipart([env, b"x" * (40 << 10), b"y" * (40 << 10)])
        assert client._sock.poll(10_000)
        _, type_, body = proto.decode_reply(client._sock.recv_multipart()[0])
        assert (type_, body["code"]) == ("error", proto.TOO_LARGE)
        assert "max_frame_bytes" in body["message"]
        # One part over the limit: libzmq drops that connection before reading it; no reply is possible.
        ctx = zmq.Context()
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(broker)
        big.send(b"z" * (80 << 10))
        assert not big.poll(500)
        big.close(0)
        ctx.term()
        assert client.stats()["errors"][proto.TOO_LARGE] == before + 1
