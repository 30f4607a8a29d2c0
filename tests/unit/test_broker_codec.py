"""Group frames and the request envelope: round trips, zero-copy decoding, and refusals that say why."""

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from tidal.broker import protocol as proto
from tidal.broker.codec import decode_group, encode_group, inspect_group, lease_from_wire, lease_to_wire
from tidal.broker.protocol import ProtocolError, decode_request, encode_envelope
from tidal.broker.testing import fake_group
from tidal.broker.types import Group, Lease, PromptGroup, PromptRow, Sample


def _pg(gid="0:3", n=3):
    return PromptGroup(gid, PromptRow(3, "src", [{"role": "user", "content": "hi"}], "42", {"k": 1}), n)


def test_group_round_trip_keeps_every_field_and_dtype():
    g = fake_group(_pg(), version=7, response_len=5, rewards=[1.0, 0.0, 0.5])
    g.samples[1].loss_mask = np.array([1, 1, 0, 1, 0], np.uint8)
    out = decode_group(bytes(encode_group(g)))
    assert out.group_id == g.group_id and out.meta == g.meta
    for a, b in zip(g.samples, out.samples, strict=True):
        for name in ("prompt_ids", "response_ids", "logprobs", "versions"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
            assert getattr(b, name).dtype == getattr(a, name).dtype
        assert (a.reward, a.finish_reason, a.meta) == (b.reward, b.finish_reason, b.meta)
    np.testing.assert_array_equal(out.samples[1].loss_mask, [1, 1, 0, 1, 0])
    np.testing.assert_array_equal(out.samples[0].loss_mask, np.ones(5))  # None means all ones
    assert out.min_version == 7
    assert all(s.loss_mask is None for s in decode_group(encode_group(fake_group(_pg()))).samples)


def test_samples_of_different_lengths_come_back_apart():
    g = fake_group(_pg(n=3), response_len=4)
    g.samples[1].response_ids = np.arange(9, dtype=np.int32)
    g.samples[1].logprobs = np.linspace(-1, 0, 9, dtype=np.float32)
    g.samples[1].versions = np.full(9, 2, np.int32)
    g.samples[2].prompt_ids = np.zeros(0, np.int32)
    out = decode_group(encode_group(g))
    assert [len(s.response_ids) for s in out.samples] == [4, 9, 4]
    assert [len(s.prompt_ids) for s in out.samples] == [3, 3, 0]
    np.testing.assert_array_equal(out.samples[1].logprobs, g.samples[1].logprobs)


def test_decoded_arrays_are_views_into_the_frame():
    frame = encode_group(fake_group(_pg(), response_len=64))
    out = decode_group(frame)
    view = np.frombuffer(frame, np.uint8)
    for s in out.samples:
        assert np.shares_memory(s.logprobs, view) and np.shares_memory(s.response_ids, view)


def test_big_endian_arrays_arrive_little_endian_with_the_same_values():
    g = fake_group(_pg(n=1))
    g.samples[0].logprobs = np.array([-1.5, -2.25, 0.0, 3.0], dtype=">f4")
    out = decode_group(encode_group(g))
    assert out.samples[0].logprobs.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(out.samples[0].logprobs, [-1.5, -2.25, 0.0, 3.0])


def test_inspect_summarises_rewards_versions_and_tokens():
    g = fake_group(_pg(n=2), version=4, response_len=6, rewards=[1.0, 0.0])
    g.samples[1].versions = np.array([5, 5, 3, 5, 5, 5], np.int32)
    info = inspect_group(encode_group(g))
    assert (info.group_id, info.num_samples, info.rewards, info.min_version, info.num_tokens) == (
        "0:3",
        2,
        [1.0, 0.0],
        3,
        12,
    )


def test_inconsistent_response_arrays_are_refused_naming_the_array():
    g = fake_group(_pg(n=1))
    g.samples[0].logprobs = np.zeros(2, np.float32)
    with pytest.raises(ProtocolError, match="logprobs has"):
        decode_group(encode_group(g))


def test_array_running_past_the_frame_is_refused():
    frame = encode_group(fake_group(_pg(n=1), response_len=8))
    with pytest.raises(ProtocolError, match="runs past the frame"):
        decode_group(frame[:-8])


def test_disallowed_dtype_is_refused():
    g = Group(
        "0:1",
        [
            Sample(
                np.zeros(1, np.int32),
                np.zeros(2, np.int32),
                np.zeros(2, np.float32),
                np.zeros(2, np.int32),
                1.0,
                "stop",
            )
        ],
    )
    g.samples[0].versions = np.zeros(2, np.complex64)
    with pytest.raises(ProtocolError, match="not allowed"):
        decode_group(encode_group(g))


@settings(max_examples=300, deadline=None)
@given(hs.binary(max_size=512))
def test_random_bytes_never_decode_into_anything_but_a_protocol_error(data):
    try:
        decode_group(data)
    except ProtocolError as exc:
        assert exc.code == proto.BAD_GROUP


def test_lease_round_trip():
    lease = Lease("abc", 123.5, [_pg("1:0"), _pg("1:7")])
    assert lease_from_wire(msgpack.unpackb(msgpack.packb(lease_to_wire(lease)))) == lease


def _req(frames, limit=1 << 20):
    return decode_request(frames, limit)


def test_valid_request_decodes():
    req = _req([encode_envelope("lease", 5, {"max_groups": 2})])
    assert (req.type, req.id, req.body, req.attachments) == ("lease", 5, {"max_groups": 2}, [])


@pytest.mark.parametrize(
    ("frames", "code", "words"),
    [
        ([], proto.BAD_FRAME, "empty message"),
        ([b"\xc1garbage"], proto.BAD_FRAME, "not msgpack"),
        ([msgpack.packb([1, 2])], proto.BAD_FRAME, "must be a map"),
        (
            [msgpack.packb({"v": 99, "type": "stats", "id": 1, "body": {}})],
            proto.BAD_VERSION,
            f"v={proto.PROTOCOL_VERSION}",
        ),
        (
            [msgpack.packb({"v": 2, "type": "stats", "id": 1, "body": {}})],
            proto.BAD_VERSION,
            "cumulative 'ack' messages",
        ),
        (
            [msgpack.packb({"v": proto.PROTOCOL_VERSION, "type": "nope", "id": 1, "body": {}})],
            proto.UNKNOWN_TYPE,
            "unknown message type",
        ),
        (
            [msgpack.packb({"v": proto.PROTOCOL_VERSION, "type": "stats", "id": -1, "body": {}})],
            proto.BAD_FRAME,
            "non-negative",
        ),
        ([encode_envelope("lease", 1, {})], proto.BAD_FRAME, "lacks required field 'max_groups'"),
        ([encode_envelope("lease", 1, {"max_groups": "2"})], proto.BAD_FRAME, "must be int"),
        ([encode_envelope("lease", 1, {"max_groups": True})], proto.BAD_FRAME, "must be int"),
        (
            [encode_envelope("submit", 1, {"lease_id": "x", "groups": 2}), b"g"],
            proto.BAD_FRAME,
            "announces 2",
        ),
        ([encode_envelope("stats", 1), b"extra"], proto.BAD_FRAME, "announces 0"),
        ([encode_envelope("stats", 1), b"x" * 2048], proto.TOO_LARGE, "max_frame_bytes=1024"),
    ],
)
def test_bad_requests_are_refused_with_a_code_and_a_reason(frames, code, words):
    with pytest.raises(ProtocolError) as exc:
        _req(frames, limit=1024)
    assert exc.value.code == code
    assert words in exc.value.message


def test_peek_id_recovers_the_id_of_an_invalid_envelope():
    assert proto.peek_id(msgpack.packb({"v": 99, "id": 17})) == 17
    assert proto.peek_id(b"\xc1") is None


def test_encoding_into_a_supplied_buffer_gives_the_same_frame_and_the_pool_reuses_it():
    from tidal.broker.client import _BufferPool

    g = fake_group(_pg(), response_len=300)
    plain = encode_group(g)
    pool = _BufferPool()
    dirty = pool.take(len(plain))
    dirty[:] = 0xAB  # a reused buffer holds old bytes: padding must not leak them
    pool.give([dirty])
    frame = encode_group(g, pool.take)
    assert bytes(frame) == bytes(plain)
    assert np.shares_memory(frame, dirty)
    pool.give([frame])
    assert np.shares_memory(encode_group(g, pool.take), dirty)  # the same memory comes back


def test_the_buffer_pool_keeps_buffers_by_size_within_its_limit():
    from tidal.broker.client import _BufferPool

    pool = _BufferPool(max_bytes=1 << 20)
    small, large = pool.take(10_000), pool.take(300_000)
    assert len(small) >= 10_000 and len(large) >= 300_000
    pool.give([small, large])
    assert pool.held == len(small) + len(large)
    assert pool.take(10_000) is small  # its own size first
    assert pool.take(9_000) is large  # none of that size left: the smallest larger one
    assert pool.held == 0
    pool.give([np.empty(2 << 20, np.uint8)])  # over the limit: not kept
    assert pool.held == 0
