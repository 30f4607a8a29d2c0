"""The C group codec (broker/native_codec.c) against the Python one it must equal (broker/codec.py).

Every test runs both and compares: the same frame bytes from the same group, the same acceptance (and so the
same error, which the Python checks raise) for any frame, the same summary and the same decoded samples.
"""

import struct
import zlib

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from tidal.broker import codec, native_codec
from tidal.broker.codec import ALLOWED_DTYPES, GroupInfo, decode_group, encode_group, inspect_group
from tidal.broker.protocol import ProtocolError
from tidal.broker.types import Group, Sample

native, why = native_codec.load()
pytestmark = pytest.mark.skipif(native is None, reason=f"the native codec cannot be built here: {why}")

INT_DTYPES = ["<i4", "<i8", "<i2", "|i1", "<u2", "|u1"]
FLOAT_DTYPES = ["<f4", "<f8", "<f2"]
MASK_DTYPES = ["|u1", "|b1", "<i4"]


def _array(draw, length, dtype, odd):
    rng = np.random.default_rng(draw(hs.integers(0, 2**32 - 1)))
    dt = np.dtype(dtype)
    if dt.kind == "f":
        a = rng.standard_normal(length).astype(dt)
    elif dt.kind == "b":
        a = rng.integers(0, 2, length).astype(dt)
    else:
        info = np.iinfo(dt)
        a = rng.integers(max(info.min, -1000), min(info.max, 1000), length, endpoint=True).astype(dt)
    if odd == "big-endian":
        a = a.astype(dt.newbyteorder(">"))
    elif odd == "strided":
        a = np.repeat(a, 2)[::2]
    elif odd == "list":
        a = a.tolist()
    return a


@hs.composite
def groups(draw):
    n = draw(hs.integers(1, 5))
    dtypes = {
        "prompt_ids": draw(hs.sampled_from(INT_DTYPES)),
        "response_ids": draw(hs.sampled_from(INT_DTYPES)),
        "logprobs": draw(hs.sampled_from(FLOAT_DTYPES)),
        "versions": draw(hs.sampled_from(INT_DTYPES)),
        "loss_mask": draw(hs.sampled_from(MASK_DTYPES)),
    }
    masks = draw(hs.sampled_from(["none", "all", "some"]))
    samples = []
    for _ in range(n):
        p, r = draw(hs.integers(0, 12)), draw(hs.integers(0, 12))
        # now and then one array out of the common case: the C code must hand the group to Python
        odd = draw(hs.sampled_from([None] * 12 + ["big-endian", "strided", "list", "mixed"]))
        odd_name = draw(hs.sampled_from(list(dtypes)))
        arrays = {}
        for name, dtype in dtypes.items():
            length = p if name == "prompt_ids" else r
            how = odd if name == odd_name else None
            if how == "mixed":
                dtype = "<f8" if np.dtype(dtype).kind != "f" else "<f4"
            arrays[name] = _array(draw, length, dtype, how)
        if masks == "none" or (masks == "some" and draw(hs.booleans())):
            arrays["loss_mask"] = None
        reward = draw(hs.one_of(hs.floats(allow_nan=False, allow_infinity=False), hs.integers(-5, 5)))
        samples.append(
            Sample(
                **arrays,
                reward=reward,
                finish_reason=draw(hs.sampled_from(["stop", "length", "abort"])),
                meta=draw(
                    hs.dictionaries(hs.text(max_size=4), hs.integers() | hs.text(max_size=6), max_size=3)
                ),
            )
        )
    gid = draw(hs.text(min_size=0, max_size=40) | hs.just("g" * 300))
    meta = draw(hs.dictionaries(hs.text(max_size=5), hs.integers(-(2**40), 2**40), max_size=3))
    return Group(group_id=gid, samples=samples, meta=meta)


def _encoded(group, native_path):
    try:
        return bytes(encode_group(group, native=native_path))
    except Exception as exc:  # the reference's error: the C code must raise or defer the same way
        return (type(exc), str(exc))


def _samples_equal(a: Group, b: Group) -> None:
    assert (a.group_id, a.meta, len(a.samples)) == (b.group_id, b.meta, len(b.samples))
    for s, t in zip(a.samples, b.samples, strict=True):
        for name in ("prompt_ids", "response_ids", "logprobs", "versions", "loss_mask"):
            x, y = getattr(s, name), getattr(t, name)
            assert (x is None) == (y is None), name
            if x is not None:
                assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name
        assert (s.reward, s.finish_reason, s.meta) == (t.reward, t.finish_reason, t.meta)
        assert type(s.reward) is type(t.reward) and type(s.meta) is type(t.meta)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups())
def test_the_c_encoder_writes_the_python_encoders_bytes(group):
    assert _encoded(group, True) == _encoded(group, False)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups())
def test_the_c_encoder_zeroes_the_padding_of_memory_it_is_given(group):
    # the C code writes each part and zeros only the gaps between them: memory that held other bytes
    # (a ring's span, a reused buffer) must come out as the Python encoder's frame all the same
    def dirty(nbytes: int) -> np.ndarray:
        return np.full(nbytes + 64, 0xAB, np.uint8)

    try:
        expected = bytes(encode_group(group, native=False))
    except Exception:
        return  # groups the encoders refuse: the test above compares their errors
    assert bytes(encode_group(group, dirty)) == expected


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    hs.lists(hs.integers(0, 3000), min_size=1, max_size=4),
    hs.integers(0, 63),
    hs.sampled_from(["<i4", "<i2", "|u1"]),
    hs.booleans(),
)
def test_a_streaming_encode_writes_the_same_bytes_at_any_alignment(lengths, shift, dtype, masked):
    # Streaming copies parts of STREAM_MIN_BYTES (1 KiB) or more with 16-byte non-temporal stores from the
    # first aligned byte on: every length around 64-byte blocks, every start in memory, dirty or not.
    rng = np.random.default_rng(sum(lengths) + shift)
    samples = [
        Sample(
            prompt_ids=rng.integers(0, 100, r // 3, dtype=np.int32),
            response_ids=rng.integers(0, 100, r).astype(dtype),
            logprobs=rng.standard_normal(r).astype(np.float32),
            versions=np.full(r, 7, np.int32),
            reward=1.0,
            finish_reason="stop",
            loss_mask=rng.integers(0, 2, r, dtype=np.uint8) if masked else None,
            meta={"r": r},
        )
        for r in lengths
    ]
    group = Group(group_id="0:1", samples=samples)
    expected = bytes(encode_group(group, native=False))

    def dirty(nbytes: int) -> np.ndarray:
        return np.full(nbytes + 128, 0xAB, np.uint8)[shift : shift + nbytes]

    assert bytes(encode_group(group, dirty, streaming=True)) == expected
    assert bytes(encode_group(group, streaming=True)) == expected


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups())
def test_the_c_checks_summary_and_samples_equal_the_python_ones(group):
    try:
        frame = encode_group(group, native=False)
    except Exception:
        return  # a group the encoder refuses (the encoder test compares those)
    outcomes = []
    for native_path in (True, False):
        try:
            outcomes.append(
                (inspect_group(frame, native=native_path), decode_group(frame, native=native_path))
            )
        except ProtocolError as exc:
            outcomes.append(str(exc))
    if isinstance(outcomes[0], str) or isinstance(outcomes[1], str):
        assert outcomes[0] == outcomes[1]
        return
    (info_c, group_c), (info_py, group_py) = outcomes
    assert info_c == info_py
    _samples_equal(group_c, group_py)


def test_large_counts_and_offsets_take_the_wider_msgpack_integers():
    # offsets past 2**16 and counts past 2**8 and 2**16: every unsigned integer width msgpack writes
    rng = np.random.default_rng(0)
    samples = [
        Sample(
            prompt_ids=rng.integers(0, 100, 300, dtype=np.int32),
            response_ids=rng.integers(0, 100, 40_000, dtype=np.int64),
            logprobs=rng.standard_normal(40_000).astype(np.float32),
            versions=np.full(40_000, 7, np.int32),
            reward=0.5,
            finish_reason="length",
            loss_mask=np.ones(40_000, np.uint8),
        )
        for _ in range(3)
    ]
    group = Group(group_id="é" * 70_000, samples=samples, meta={"k": 2**40})
    frame = encode_group(group)
    assert bytes(frame) == bytes(encode_group(group, native=False))
    assert inspect_group(frame) == inspect_group(frame, native=False)
    _samples_equal(decode_group(frame), decode_group(frame, native=False))


def _frame_of(header: dict, data: bytes) -> bytes:
    packed = msgpack.packb(header)
    start = 4 + len(packed)
    return struct.pack("<I", len(packed)) + packed + bytes(-start % 8) + data


def _split(frame) -> tuple[dict, bytes]:
    buf = bytes(frame)
    (hlen,) = struct.unpack_from("<I", buf)
    start = 4 + hlen
    return msgpack.unpackb(buf[4:start]), buf[start + (-start % 8) :]


def _outcome(frame, native_path):
    try:
        info = inspect_group(frame, native=native_path)
        return ("ok", info, [vars(s).keys() for s in decode_group(frame, native=native_path).samples])
    except ProtocolError as exc:
        return ("refused", str(exc))


_VALUES = hs.one_of(
    hs.integers(-(2**63), 2**64 - 1),  # what msgpack can carry
    hs.integers(-3, 200),
    hs.sampled_from(sorted(ALLOWED_DTYPES) + ["<u4", "<f8", "|S1", "i4"]),
    hs.floats(allow_nan=False),
    hs.booleans(),
    hs.none(),
    hs.binary(max_size=3),
)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups(), hs.data())
def test_the_c_checks_accept_exactly_the_frames_the_python_checks_accept(group, data):
    try:
        header, body = _split(encode_group(group, native=False))
    except Exception:
        return
    arrays = header["arrays"]
    for _ in range(data.draw(hs.integers(1, 3))):
        name = data.draw(hs.sampled_from([*arrays, "loss_mask", "extra", b"rewards"]))
        what = data.draw(hs.sampled_from(["field", "drop", "shape", "n", "body"]))
        spec = arrays.get(name)
        if what == "field" and isinstance(spec, list) and len(spec) == 3:
            spec[data.draw(hs.integers(0, 2))] = data.draw(_VALUES)
        elif what == "drop":
            arrays.pop(name, None)
        elif what == "shape":
            arrays[name] = data.draw(
                hs.sampled_from([[], ["<i4", 1], ["<i4", 0, 0, 0], "<i4", ("<i4", 0, 0)])
            )
        elif what == "n":
            header["n"] = data.draw(hs.integers(-1, 8) | hs.just(2**64 - 1))
        elif body:
            at = data.draw(hs.integers(0, len(body) - 1))
            flipped = data.draw(hs.integers(0, 255))
            body = body[:at] + bytes([flipped]) + body[at + 1 :]
    frame = _frame_of(header, body)
    assert _outcome(frame, True) == _outcome(frame, False)


@settings(max_examples=300, deadline=None)
@given(hs.binary(max_size=600))
def test_random_bytes_get_the_same_verdict(data):
    assert _outcome(data, True) == _outcome(data, False)


def test_the_codec_runs_in_python_alone_where_the_c_code_cannot_be_built(monkeypatch, tmp_path):
    monkeypatch.setenv("TIDAL_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv(native_codec.ENV, "0")
    native_codec.load.cache_clear()
    try:
        assert native_codec.load() == (None, f"{native_codec.ENV}=0")
        monkeypatch.delenv(native_codec.ENV)
        monkeypatch.setenv("CC", "false")  # a compiler that fails
        native_codec.load.cache_clear()
        module, reason = native_codec.load()
        assert module is None and "failed" in reason
    finally:
        native_codec.load.cache_clear()


@settings(max_examples=300, deadline=None)
@given(hs.binary(max_size=3000), hs.binary(max_size=3000))
def test_combined_crcs_equal_the_crc_of_the_joined_bytes(a, b):
    assert native.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_crc_combine_refuses_what_is_not_a_crc_or_a_length():
    with pytest.raises(ValueError, match="32-bit"):
        native.crc32_combine(1 << 32, 0, 1)
    with pytest.raises(ValueError, match="2\\*\\*60"):
        native.crc32_combine(0, 0, 1 << 60)


@pytest.fixture(params=[True, False], ids=["avx2-where-the-cpu-has-it", "sse2"])
def vector_path(request):
    native.use_avx2(request.param)
    yield
    native.use_avx2(True)


@pytest.mark.parametrize("count", [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 8192, 8197])
def test_the_versions_range_is_found_wherever_the_extremes_lie(count, vector_path):
    # the C scans run 4 (SSE2) or 16 (AVX2) entries a step and the rest one by one
    rng = np.random.default_rng(count)
    for low_at, high_at in {(0, count - 1), (count - 1, 0), (count // 2, count // 3), (count - 1, count - 1)}:
        versions = rng.integers(-100, 100, count).astype(np.int32)
        versions[low_at] = -(2**31)
        versions[high_at] = 2**31 - 1 if high_at != low_at else -(2**31)
        sample = Sample(
            prompt_ids=np.zeros(0, np.int32),
            response_ids=np.zeros(count, np.int32),
            logprobs=np.zeros(count, np.float32),
            versions=versions,
            reward=0.0,
            finish_reason="stop",
        )
        frame = encode_group(Group(group_id="g", samples=[sample]))
        info_c, info_py = inspect_group(frame), inspect_group(frame, native=False)
        assert info_c == info_py
        assert (info_c.min_version, info_c.max_version) == (int(versions.min()), int(versions.max()))


@settings(max_examples=200, deadline=None)
@given(hs.lists(hs.binary(max_size=300), max_size=8), hs.integers(0, 64))
def test_gather_copies_the_parts_one_after_the_other_or_nothing_where_they_do_not_fit(parts, at):
    dest = np.full(512, 0xAB, np.uint8)
    before = dest.copy()
    joined = b"".join(parts)
    end = native.gather(dest, at, [memoryview(p) if i % 2 else p for i, p in enumerate(parts)])
    if at + len(joined) <= len(dest):
        assert end == at + len(joined)
        assert bytes(dest[at:end]) == joined
        assert (dest[:at] == before[:at]).all() and (dest[end:] == before[end:]).all()
    else:
        assert end is None and (dest == before).all()


def test_gather_copies_large_parts_and_refuses_what_it_cannot_copy():
    big = [np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8), b"tail"]  # the no-GIL path
    dest = np.zeros(400_000, np.uint8)
    assert native.gather(dest, 10, big) == 10 + 300_004
    assert bytes(dest[10:300_014]) == big[0].tobytes() + b"tail"
    with pytest.raises(BufferError):
        native.gather(b"read-only", 0, [b"x"])
    with pytest.raises(ValueError, match="contiguous"):
        native.gather(dest, 0, [np.arange(8)[::2]])


def test_address_is_where_numpy_sees_the_bytes():
    a = np.arange(64, dtype=np.uint8)
    for buf in (a, memoryview(a)[7:], a[3:9], memoryview(b"frame bytes")):
        assert native.address(buf) == np.frombuffer(buf, np.uint8).ctypes.data
    with pytest.raises(ValueError, match="contiguous"):
        native.address(np.arange(8)[::2])


_MSGPACK_VALUES = hs.recursive(
    hs.none()
    | hs.booleans()
    | hs.integers(-(2**63), 2**64 - 1)
    | hs.floats(allow_nan=True, width=32)  # packed as float32 or float64 (use_single_float)
    | hs.text(max_size=60)
    | hs.sampled_from(["stop", "length", "<i4", "data_source", "é", ""])  # repeated short strings
    | hs.binary(max_size=40),
    lambda inner: (
        hs.lists(inner, max_size=6)
        | hs.dictionaries(hs.text(max_size=12) | hs.binary(max_size=4), inner, max_size=6)
    ),
    max_leaves=40,
)


def _same(a, b) -> bool:  # equal values of equal types all the way down (nan included)
    return msgpack.packb(a, use_bin_type=True) == msgpack.packb(b, use_bin_type=True) and repr(a) == repr(b)


@settings(max_examples=500, deadline=None)
@given(_MSGPACK_VALUES, hs.booleans())
def test_unpack_decodes_what_msgpack_decodes_to_the_same_values(value, single_float):
    data = msgpack.packb(value, use_bin_type=True, use_single_float=single_float)
    got = native.unpack(data)
    assert got is not NotImplemented
    assert _same(got, msgpack.unpackb(data, raw=False))


@settings(max_examples=300, deadline=None)
@given(hs.lists(hs.floats(allow_nan=True), max_size=4))
def test_unpack_decodes_doubles_bit_for_bit(values):
    data = msgpack.packb(values)
    assert _same(native.unpack(data), msgpack.unpackb(data, raw=False))


@settings(max_examples=3000, deadline=None)
@given(hs.binary(max_size=80))
def test_unpack_of_any_bytes_is_msgpacks_result_or_leaves_it_to_msgpack(data):
    try:
        want = msgpack.unpackb(data, raw=False)
    except Exception:
        assert native.unpack(data) is NotImplemented  # msgpack raises its error
        return
    got = native.unpack(data)
    assert got is NotImplemented or _same(got, want)


def test_unpack_leaves_ext_types_non_string_keys_bad_utf8_and_trailing_bytes_to_msgpack():
    for data in (
        msgpack.packb(msgpack.ExtType(1, b"x")),
        b"\x81\x01\x02",  # {1: 2}: msgpack's strict_map_key refuses it
        b"\xa2\xff\xfe",  # not UTF-8
        msgpack.packb(1) + b"\x00",
        b"\x92\x01",  # an array cut short
        b"\x91" * 40 + b"\x00",  # nested deeper than the decoder goes
    ):
        assert native.unpack(data) is NotImplemented


def _configured():
    return codec._native()  # decode needs numpy's functions, which codec.py hands the module once


def _with_sample_info(frame, info: bytes) -> bytes:
    """``frame`` with its sample info replaced by ``info`` (appended after the other arrays)."""
    header, body = _split(frame)
    body += bytes(-len(body) % 8)
    header["arrays"]["sample_info"] = ["|u1", len(info), len(body)]
    return _frame_of(header, body + info)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups())
def test_inspecting_and_decoding_in_one_call_equal_the_python_code(group):
    try:
        frame = bytes(encode_group(group, native=False))
    except Exception:
        return
    native_path = _configured()
    summary = native_path.inspect(memoryview(frame))
    try:
        expected = decode_group(frame, native=False)
    except ProtocolError:  # the Python path raises the error: the C code leaves the frame to it
        assert native_path.decode(memoryview(frame), Sample, Group) is None
        if summary is not None:  # only the per-sample info is wrong, which the broker does not read
            assert GroupInfo(*summary) == inspect_group(frame, native=False)
        return
    assert summary is not None and GroupInfo(*summary) == inspect_group(frame, native=False)
    got = native_path.decode(memoryview(frame), Sample, Group)
    assert got is not None  # every frame the encoder writes takes the one-call paths
    _samples_equal(got, expected)
    assert type(got) is Group and all(type(s) is Sample for s in got.samples)
    for s in got.samples:
        assert not s.response_ids.flags.writeable  # views of the (read-only) frame, as the Python path's


def test_sample_info_in_another_form_is_left_to_the_python_path():
    frame = bytes(encode_group(Group("g", [_plain_sample(), _plain_sample()]), native=False))
    # finish reasons as one string of n characters: msgpack [finish_reasons, metas] the Python path reads
    odd = _with_sample_info(frame, msgpack.packb(["sl", [{}, {"k": 1}]]))
    assert _configured().decode(memoryview(odd), Sample, Group) is None
    got, expected = decode_group(odd), decode_group(odd, native=False)
    _samples_equal(got, expected)
    assert [s.finish_reason for s in got.samples] == ["s", "l"]
    for info in (msgpack.packb([["stop"], [{}, {}]]), msgpack.packb({"a": 1}), b"\xc1"):
        bad = _with_sample_info(frame, info)
        assert _configured().decode(memoryview(bad), Sample, Group) is None
        with pytest.raises(ProtocolError) as c_path:
            decode_group(bad)
        with pytest.raises(ProtocolError) as py_path:
            decode_group(bad, native=False)
        assert str(c_path.value) == str(py_path.value)


def _plain_sample() -> Sample:
    return Sample(
        prompt_ids=np.arange(3, dtype=np.int32),
        response_ids=np.arange(4, dtype=np.int32),
        logprobs=np.zeros(4, np.float32),
        versions=np.ones(4, np.int32),
        reward=1.0,
        finish_reason="stop",
    )
