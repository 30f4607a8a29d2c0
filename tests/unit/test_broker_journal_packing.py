"""The journal's PACKED group records: versions run-length encoded on disk, the frame back byte for byte."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from tidal.broker.codec import encode_group, inspect_group
from tidal.broker.journal import Journal
from tidal.broker.journal_packing import Pieces, pack_group, unpack_group
from tidal.broker.journal_records import (
    Kind,
    _crc32_combine,
    packed_crcs,
    read_records,
    record_crc,
    record_parts,
    ref_payload,
)
from tidal.broker.local_journal import JournalReader
from tidal.broker.protocol import ProtocolError
from tidal.broker.types import Group, Sample


def _group(versions: list[np.ndarray], loss_mask: bool = False, gid: str = "g") -> Group:
    samples = [
        Sample(
            prompt_ids=np.arange(5, dtype=np.int32),
            response_ids=np.arange(len(v), dtype=np.int32) + i,
            logprobs=np.linspace(-1, 0, len(v), dtype=np.float32),
            versions=v,
            reward=float(i),
            finish_reason="stop",
            loss_mask=np.ones(len(v), np.uint8) if loss_mask else None,
            meta={"i": i},
        )
        for i, v in enumerate(versions)
    ]
    return Group(group_id=gid, samples=samples)


def _pack(frame: np.ndarray) -> Pieces | None:
    info = inspect_group(frame)
    at, count, dtype = info.versions_at
    return pack_group(memoryview(frame), at, count, dtype, info.min_version, info.max_version)


def _joined(pieces: Pieces) -> bytes:
    return b"".join(bytes(p) for p in pieces.parts)


@pytest.mark.parametrize(
    "versions, loss_mask",
    [
        ([np.full(1000, 7, np.int32)] * 4, False),  # one run: the common case
        ([np.full(300, 3, np.int32), np.full(500, 4, np.int32)], False),  # one version per sample
        ([np.repeat(np.array([2, 3, 5], np.int32), [100, 1, 400])], True),  # updates mid-sample; a mask after
        ([np.full(64, -1, np.int64), np.full(64, 2**40, np.int64)], False),  # wide and negative values
        ([np.full(50, 9, np.int32), np.zeros(0, np.int32)], False),  # a sample without response tokens
    ],
)
def test_packed_groups_come_back_byte_for_byte_and_smaller(versions, loss_mask):
    frame = encode_group(_group(versions, loss_mask))
    pieces = _pack(frame)
    assert pieces is not None
    versions_bytes = sum(v.nbytes for v in versions)
    assert len(pieces) <= len(frame) - versions_bytes + 100  # the versions are gone but for their runs
    assert len(_joined(pieces)) == len(pieces)
    assert bytes(unpack_group(memoryview(_joined(pieces)))) == frame.tobytes()
    # the record's checksum over its pieces is that of the joined payload
    assert record_crc(Kind.PACKED, pieces) == record_crc(Kind.PACKED, _joined(pieces))
    header, *parts = record_parts(Kind.PACKED, pieces)
    assert b"".join(bytes(p) for p in parts) == _joined(pieces)
    # the record's and the frame's CRC from one pass over the frame equal those summed the long way
    if _crc32_combine() is not None:
        assert packed_crcs(memoryview(frame), pieces) == (
            record_crc(Kind.PACKED, pieces),
            record_crc(Kind.GROUP, frame),
        )


@settings(max_examples=200, deadline=None)
@given(
    runs=hs.lists(hs.tuples(hs.integers(-(2**31), 2**31 - 1), hs.integers(1, 40)), min_size=1, max_size=12),
    split=hs.integers(0, 400),
)
def test_any_runs_of_versions_come_back_exactly_or_stay_unpacked(runs, split):
    flat = np.repeat(np.array([v for v, _ in runs], np.int32), [n for _, n in runs])
    cut = min(split, len(flat))
    frame = encode_group(_group([flat[:cut], flat[cut:]]))
    pieces = _pack(frame)
    if pieces is None:  # too many runs to pay
        assert len(runs) * 8 > flat.nbytes // 2 - 8
    else:
        assert bytes(unpack_group(memoryview(_joined(pieces)))) == frame.tobytes()
        if _crc32_combine() is not None:
            crcs = packed_crcs(memoryview(frame), pieces)
            assert crcs == (record_crc(Kind.PACKED, pieces), record_crc(Kind.GROUP, frame))


def test_versions_changing_every_token_are_journaled_as_they_came():
    changing = encode_group(_group([np.arange(1000, dtype=np.int32)]))
    assert _pack(changing) is None


def test_float_versions_are_refused_by_the_broker_and_never_packed():
    floats = encode_group(_group([np.full(100, np.nan, np.float32)]))
    with pytest.raises(
        ProtocolError, match="'versions': dtype <f4 not allowed; policy versions are integers"
    ):
        inspect_group(floats)
    at = len(floats) - 400  # wherever they lie: a float array is not packed
    assert pack_group(memoryview(floats), at, 100, np.dtype("<f4"), 0, 0) is None


def test_a_malformed_packed_payload_is_refused():
    frame = encode_group(_group([np.full(100, 1, np.int32)]))
    good = bytearray(_joined(_pack(frame)))
    for bad in (good[:10], good[:-4] + b"\xff\xff\xff\x7f", good[:-20] + good[-16:]):
        with pytest.raises(ValueError):
            unpack_group(memoryview(bytes(bad)))


def _packed_journal(tmp_path, frames: list[np.ndarray]) -> tuple[Journal, list[tuple[str, int, int]]]:
    j = Journal(tmp_path, fsync="never")
    j.open()
    locs = []
    for frame in frames:
        pieces = _pack(frame)
        j.append(Kind.PACKED, pieces)
        locs.append((j.file_id, j.last_offset, len(pieces)))
    j.flush()
    return j, locs


def test_the_journal_replays_packed_records_as_the_frames_and_refers_to_them_through_compaction(tmp_path):
    frames = [encode_group(_group([np.full(2000, i, np.int32)] * 3, gid=f"g{i}")) for i in range(3)]
    j, locs = _packed_journal(tmp_path, frames)
    # on disk: PACKED records, each a third smaller than its frame
    on_disk = read_records(memoryview(j.path.read_bytes()))[0][1:]
    assert [k for k, _ in on_disk] == [Kind.PACKED] * 3
    assert all(len(p) < 0.7 * len(f) for (_, p), f in zip(on_disk, frames, strict=True))
    # a local reader given the broker's [offset, length] gets the frames themselves
    reader = JournalReader()
    got = reader.read(str(j.path), j.file_id, [[at, n] for _, at, n in locs])
    assert [bytes(g) for g in got] == [f.tobytes() for f in frames]
    reader.close()
    j.compact([(Kind.SNAPSHOT, b"snap"), (Kind.REF, ref_payload(*locs[1]))])
    j.close()

    again = Journal(tmp_path)
    records = again.open()
    assert [(k, bytes(p)) for k, p in records] == [
        (Kind.SNAPSHOT, b"snap"),
        (Kind.RESTORE, frames[1].tobytes()),
    ]
    assert again.replayed_locs == [None, locs[1]]
    again.close()


def test_reopened_packed_groups_are_groups_again(tmp_path):
    frames = [encode_group(_group([np.full(100, 4, np.int32)], gid="a"))]
    j, _ = _packed_journal(tmp_path, frames)
    j.close()
    again = Journal(tmp_path)
    assert [(k, bytes(p)) for k, p in again.open()] == [(Kind.GROUP, frames[0].tobytes())]
    again.close()


def test_an_older_format_file_takes_no_packed_record_until_a_compaction_starts_a_new_one(tmp_path):
    (tmp_path / "journal.log").write_bytes(
        b"".join(bytes(p) for p in record_parts(Kind.FORMAT, b"3 0123456789abcdef"))
    )
    j = Journal(tmp_path, fsync="never")
    j.open()
    frame = encode_group(_group([np.full(100, 4, np.int32)]))
    assert not j.takes(Kind.PACKED)
    with pytest.raises(ValueError, match="format-3 file: it takes no PACKED records"):
        j.append(Kind.PACKED, _pack(frame))
    with pytest.raises(ValueError, match="takes no ATTEMPTS records"):
        j.append(Kind.ATTEMPTS, b"\x80")
    j.compact([(Kind.SNAPSHOT, b"snap")])
    assert j.takes(Kind.PACKED) and j.takes(Kind.ATTEMPTS)
    j.append(Kind.PACKED, _pack(frame))
    j.close()
    assert [(k, bytes(p)) for k, p in Journal(tmp_path).open()] == [
        (Kind.SNAPSHOT, b"snap"),
        (Kind.GROUP, frame.tobytes()),
    ]
