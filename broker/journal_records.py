"""The journal's record format (broker/journal.py writes it): records, FORMAT and REF payloads, the
per-file checksum mask, and reading records back from a log or from the earlier files a log refers to.

A record is ``kind u8 | length u32 LE | crc32 u32 LE | payload``, the CRC (zlib's CRC-32) covering the
kind byte and the payload, XORed from format 3 with a mask that follows from the file's id (``file_mask``).
A payload may be written in pieces (``Pieces``); its checksum is the same as that of the joined bytes.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from enum import IntEnum
from pathlib import Path

from isal.isal_zlib import crc32  # zlib's CRC-32, same values, with ISA-L's carry-less multiply (~10x)

from tidal.broker import native_codec
from tidal.broker.journal_packing import Pieces, unpack_group

RECORD_HEADER = struct.Struct("<BII")


class Kind(IntEnum):
    GROUP = 1  # an accepted group: payload is the group frame as it came
    TAKE = 2  # prompts taken from the source, and the cursor after it
    DROP = 3  # a group resolved without training: filtered (never accepted) or stale (accepted, dropped)
    BATCH = 4  # a cut batch: id, group ids, policy version
    CONSUMED = 5  # the trainer trained through this batch durably
    VERSION = 6  # the trainer's policy version
    SNAPSHOT = 7  # compacted state; followed by RESTORE records of the groups it still needs
    RESTORE = 8  # a group frame kept by compaction (bookkeeping lives in the SNAPSHOT)
    FORMAT = 9  # the first record: the journal format number
    REF = 10  # a group kept by compaction where it lies: file id, payload offset and length (format 3)
    PACKED = 11  # an accepted group, its frame's versions run-length encoded (format 4; journal_packing)
    ATTEMPTS = 12  # failed sampling attempts of groups not yet resolved, {group id: count} (format 5)


# 2: group frames with per-sample columns in the data region (protocol v2). Format 1 had no FORMAT record.
# 3: compaction refers to live groups in earlier files (REF) instead of copying them (RESTORE); a format-2
# log reads the same way.
# 4: accepted groups may be PACKED records. A format-2 or -3 file takes no PACKED record (a broker of the
# version before would stop reading there); the file the next compaction writes is format 4.
# 5: ATTEMPTS records keep the failed attempts of each group across a restart (broker.max_group_failures),
# likewise only in a file of format 5.
FORMAT_VERSION = 5
READABLE_FORMATS = ("2", "3", "4", "5")
FIRST_FORMAT = {Kind.PACKED: 4, Kind.ATTEMPTS: 5}  # the first format whose files take these kinds
GROUP_KINDS = (Kind.GROUP, Kind.RESTORE, Kind.PACKED)  # records that hold a group frame
_REF = struct.Struct("<16sQI")
# The FORMAT payload is "<format> <file id>": the file id (16 hex digits, new for every file a compaction
# writes) lets a reader on this host that was given offsets check it opened the file they refer to.
FILE_ID_CHARS = 16
FORMAT_RECORD_BYTES = RECORD_HEADER.size + len(str(FORMAT_VERSION)) + 1 + FILE_ID_CHARS


def new_file_id() -> str:
    return os.urandom(FILE_ID_CHARS // 2).hex()


def format_payload(file_id: str) -> bytes:
    return f"{FORMAT_VERSION} {file_id}".encode()


def parse_format(payload: bytes | memoryview) -> tuple[str, str | None]:
    """(format number, file id or None) of a FORMAT record's payload."""
    text = bytes(payload).decode(errors="replace")
    number, _, file_id = text.partition(" ")
    return number, file_id or None


class JournalFormatError(RuntimeError):
    """The log was written in a format this broker does not read."""


class JournalCorrupt(RuntimeError):
    """A record the log refers to is missing or does not match its checksum."""


def ref_payload(file_id: str, offset: int, length: int) -> bytes:
    """A REF record's payload: the group record whose payload lies at ``offset`` of file ``file_id``."""
    return _REF.pack(file_id.encode(), offset, length)


def parse_ref(payload: bytes | memoryview) -> tuple[str, int, int]:
    file_id, offset, length = _REF.unpack(payload)
    return file_id.decode(), offset, length


def segment_path(directory: Path, file_id: str) -> Path:
    """Where an earlier journal file that compaction still refers to is kept."""
    return directory / f"journal.{file_id}.log"


def record_crc(kind: int, payload: bytes | memoryview | Pieces) -> int:
    """The checksum a record of ``kind`` with this payload carries (callers that need it too compute it
    once and pass it to ``Journal.append``)."""
    if isinstance(payload, Pieces):
        crc = crc32(bytes((kind,)))
        for part in payload.parts:
            crc = crc32(part, crc)
        return crc
    return crc32(payload, crc32(bytes((kind,))))


def group_frame(kind: Kind, payload: memoryview) -> memoryview:
    """The group frame a GROUP, RESTORE or PACKED record holds (a PACKED one expanded into fresh
    memory); ``ValueError`` where a PACKED payload does not hold one."""
    return unpack_group(payload) if kind is Kind.PACKED else payload


def intact_group_frame(
    header: tuple[int, int, int], payload: memoryview, length: int, mask: int
) -> memoryview | None:
    """The group frame of the record read at a known place (its ``header`` fields kind, length and CRC,
    and ``payload``) where it is the group record of ``length`` bytes it should be and its checksum holds
    under the file's ``mask``; None where not."""
    kind, got, crc = header
    if kind not in GROUP_KINDS or got != length or record_crc(kind, payload) ^ mask != crc:
        return None
    try:
        return group_frame(Kind(kind), payload)
    except ValueError:
        return None


def file_mask(number: str, file_id: str | None) -> int:
    """What a file of format ``number`` XORs into the checksum field of every record after FORMAT. From
    format 3 it follows from the file id, so that the records a reused file held before (another id)
    never check out as this file's: a file's blocks are written over, not freed (see ``spare_files``)."""
    return crc32(f"tidal journal {file_id}".encode()) if number not in ("1", "2") and file_id else 0


_KIND_CRC = {kind: crc32(bytes((kind,))) for kind in (Kind.GROUP, Kind.PACKED)}


def _crc32_combine() -> Callable[[int, int, int], int] | None:
    return native_codec.function("crc32_combine")  # built on first use; most readers never need it


def packed_crcs(frame: memoryview, packed: Pieces) -> tuple[int, int] | None:
    """The CRC of the PACKED record ``packed`` (``pack_group``'s pieces of ``frame``) and that of a GROUP
    record of ``frame`` itself (what a local memory reader checks the frame against), from one pass over
    the frame where the two sums would pass over it twice: the bytes before the versions are summed once,
    for the record, and the frame's sum over them follows from that one (a CRC register is linear in its
    starting value: the two differ by their kind bytes' CRCs carried through those bytes). None where the
    native codec (which carries CRCs) cannot be built: callers sum them as before."""
    combine = _crc32_combine()
    if combine is None:
        return None
    head, tail, runs = packed.parts  # frame[:at], frame[at + nbytes:], the runs and the trailer
    versions = frame[len(head) : len(frame) - len(tail)]
    packed_kind, group_kind = _KIND_CRC[Kind.PACKED], _KIND_CRC[Kind.GROUP]
    record = crc32(head, packed_kind)
    group = combine(packed_kind ^ group_kind, record, len(head))  # = crc32(head, group_kind)
    group = crc32(versions, group)
    if tail:  # what follows the versions: mostly nothing
        group = crc32(tail, group)
        record = crc32(tail, record)
    return crc32(runs, record), group


def record_parts(
    kind: Kind, payload: bytes | memoryview | Pieces, crc: int | None = None, mask: int = 0
) -> list[bytes | memoryview]:
    header = RECORD_HEADER.pack(
        kind, len(payload), (record_crc(kind, payload) if crc is None else crc) ^ mask
    )
    return [header, *payload.parts] if isinstance(payload, Pieces) else [header, payload]


def head_mask(data: bytes | memoryview) -> int:
    """The checksum mask of the file that starts with ``data`` (its FORMAT record)."""
    if len(data) < RECORD_HEADER.size:
        return 0
    kind, length, _ = RECORD_HEADER.unpack_from(data, 0)
    if kind != Kind.FORMAT or RECORD_HEADER.size + length > len(data):
        return 0
    return file_mask(*parse_format(data[RECORD_HEADER.size : RECORD_HEADER.size + length]))


def read_records(data: memoryview) -> tuple[list[tuple[Kind, memoryview]], int]:
    """Parse ``data``; returns the good records (payloads are views into ``data``) and the good length."""
    records, good = read_records_at(data)
    return [(kind, payload) for kind, payload, _ in records], good


def read_records_at(data: memoryview) -> tuple[list[tuple[Kind, memoryview, int]], int]:
    """:func:`read_records` with each payload's offset in ``data``."""
    out: list[tuple[Kind, memoryview, int]] = []
    pos = 0
    mask = 0  # the FORMAT record has none; the records after it have its file's
    while pos + RECORD_HEADER.size <= len(data):
        kind, length, crc = RECORD_HEADER.unpack_from(data, pos)
        end = pos + RECORD_HEADER.size + length
        if end > len(data) or kind not in Kind._value2member_map_:
            break
        payload = data[pos + RECORD_HEADER.size : end]
        if record_crc(kind, payload) ^ (mask if pos else 0) != crc:
            break
        if pos == 0:
            mask = head_mask(data[:end])
        out.append((Kind(kind), payload, pos + RECORD_HEADER.size))
        pos = end
    return out, pos


def read_referred(directory: Path, refs: list[tuple[str, int, int]]) -> list[memoryview]:
    """The group frames REF records name, read from the earlier files and checked (kind, length, CRC;
    PACKED records expanded)."""
    out: list[memoryview] = []
    fds: dict[str, int] = {}
    masks: dict[str, int] = {}
    try:
        for file_id, offset, length in refs:
            path = segment_path(directory, file_id)
            if file_id not in fds:
                try:
                    fds[file_id] = os.open(path, os.O_RDONLY)
                    masks[file_id] = head_mask(os.pread(fds[file_id], 4096, 0))
                except OSError as exc:
                    raise JournalCorrupt(
                        f"journal file {path}, which the log refers to, cannot be read: {exc}"
                    ) from None
            raw = os.pread(fds[file_id], RECORD_HEADER.size + length, offset - RECORD_HEADER.size)
            header = RECORD_HEADER.unpack_from(raw) if len(raw) >= RECORD_HEADER.size else (0, -1, 0)
            payload = memoryview(raw)[RECORD_HEADER.size :]
            frame = intact_group_frame(header, payload, length, masks[file_id])
            if frame is None:
                raise JournalCorrupt(
                    f"journal file {path} holds no intact group record of {length} bytes at {offset}, which the "
                    "log refers to"
                )
            out.append(frame)
    finally:
        for fd in fds.values():
            os.close(fd)
    return out
