"""What the broker's journal says happened to every prompt group of a run.

Reads the log record by record (the broker's own reader and group decoder) and follows each group: taken
from the prompt source, accepted, dropped (stale, filtered, or failed too often), cut into a batch, consumed by the trainer.
``tidal run`` puts the summary in its report, ``tidal journal`` prints it (tidal/journal_command.py), and
the recovery tests assert on it. A compaction replaces the history before it with a snapshot, which the
audit starts from; the groups the snapshot keeps in earlier files (REF records) are read back and checked
as the broker does when it starts. The log is mapped, not read into memory, and never written: a running
broker's journal can be audited.
"""

from __future__ import annotations

import mmap
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgpack

from tidal.broker.codec import inspect_group
from tidal.broker.journal_lock import journal_holder
from tidal.broker.journal_records import (
    JournalCorrupt,
    Kind,
    group_frame,
    parse_format,
    parse_ref,
    read_records,
    read_referred,
)
from tidal.errors import ConfigError

REFS_READ_AT_ONCE = 64  # group frames held at once while the REF records are checked (MBs each at 32K tokens)


@dataclass
class JournalAudit:
    taken: int = 0  # groups handed out from the prompt source (leases included)
    accepted: int = 0
    dropped_stale: int = 0
    filtered: int = 0
    failed: int = 0  # dropped after broker.max_group_failures failed sampling attempts
    batched: int = 0  # groups cut into batches
    batches: list[int] = field(default_factory=list)  # batch ids in journal order
    consumed_through: int = -1  # the last batch the trainer reported durably trained
    outstanding: int = 0  # taken, not yet accepted or dropped (in flight when the log ends)
    failing: int = 0  # of those, groups with failed sampling attempts (ATTEMPTS records, format 5)
    buffered: int = 0  # accepted, not yet in a batch
    compacted: bool = False
    # The whole run's figures (taken, accepted, dropped_stale, filtered, failed, batches, batched): after a
    # compaction the snapshot's counters, which count from the run's start, plus the records that follow;
    # otherwise the figures above (accepted counting records).
    run: dict[str, int] = field(default_factory=dict)
    accepted_twice: list[str] = field(default_factory=list)
    batched_twice: list[str] = field(default_factory=list)
    batched_unaccepted: list[str] = field(default_factory=list)
    # The file itself
    path: str = ""
    format: str | None = None  # the FORMAT record's number (None: no FORMAT record)
    file_id: str | None = None
    bytes: int = 0  # the file's size
    good_bytes: int = 0  # up to the end of the last intact record; the broker cuts the rest at start
    tail_is_padding: bool = True  # the bytes after good_bytes are all zero (O_DIRECT's last block)
    records: dict[str, int] = field(default_factory=dict)  # by kind
    cursor: tuple[int, int] | None = None  # (epoch, position) in the prompt source, as a restart resumes
    policy_version: int | None = None
    writer: str | None = None  # the broker holding the journal's lock while it was read (journal_lock.py)
    source: dict | None = None  # the prompt data it was written over (rows, shuffle, seed, digest)
    refs: int = 0  # groups kept by compaction in earlier files
    ref_files: list[str] = field(default_factory=list)
    ref_error: str | None = None  # why those could not be read back (a broker would refuse to start)

    @property
    def unconsumed_batches(self) -> int:
        """Batches cut after the last one reported consumed: a restarted broker serves them again."""
        return sum(1 for b in self.batches if b > self.consumed_through)

    @property
    def problems(self) -> list[str]:
        out = []
        if not self.records and not self.tail_is_padding:
            out.append("no intact record at the start: not a tidal journal, or its first record is corrupt")
        elif self.format is None and self.records:
            out.append(
                "the log does not start with a FORMAT record (written before protocol v2, or not a journal)"
            )
        if self.ref_error:
            out.append(self.ref_error)
        if self.accepted_twice:
            out.append(f"groups accepted twice: {self.accepted_twice[:5]}")
        if self.batched_twice:
            out.append(f"groups in two batches: {self.batched_twice[:5]}")
        if self.batched_unaccepted:
            out.append(f"batched groups never accepted: {self.batched_unaccepted[:5]}")
        first = self.batches[0] if self.batches else 0
        if self.batches != list(range(first, first + len(self.batches))):
            out.append(f"batch ids not consecutive: {self.batches[:10]}")
        return out

    def as_dict(self) -> dict:
        d = asdict(self)
        d["unconsumed_batches"] = self.unconsumed_batches
        d["problems"] = self.problems
        return d


def _unpack(payload: memoryview) -> dict:
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


def journal_file(path: str | Path) -> Path:
    """The log at ``path``: a ``journal.log``, the journal directory holding one, or a run directory whose
    ``journal/`` holds one (where ``tidal run`` puts it)."""
    path = Path(path)
    log = path / "journal.log" if path.is_dir() else path
    if path.is_dir() and not log.is_file() and (path / "journal" / "journal.log").is_file():
        log = path / "journal" / "journal.log"
    if not log.is_file():
        where = f"{path} holds no journal.log" if path.is_dir() else f"there is no {path}"
        raise ConfigError(
            f"no broker journal: {where} (a journal is broker.journal.dir, by default <run_dir>/journal)"
        )
    return log


def audit_journal(path: str | Path) -> JournalAudit:
    """Follow every group through the journal at ``path`` (a ``journal.log`` or its directory)."""
    log = journal_file(path)
    with open(log, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:  # mmap refuses an empty file; a broker that just created its log has written nothing
            return JournalAudit(path=str(log))
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as data:
            view = memoryview(data)
            try:
                return _audit(log, view)
            finally:
                view.release()


def _audit(log: Path, data: memoryview) -> JournalAudit:
    records, good = read_records(data)
    audit = JournalAudit(path=str(log), bytes=len(data), good_bytes=good, writer=journal_holder(log.parent))
    audit.tail_is_padding = not any(data[good:])
    audit.records = dict(Counter(kind.name for kind, _ in records))
    outstanding: set[str] = set()
    accepted: set[str] = set()
    buffered: set[str] = set()
    batched: set[str] = set()
    refs: list[tuple[str, int, int]] = []
    failures: dict[str, int] = {}
    before = dict.fromkeys(RUN_FIGURES, 0)  # the run's figures up to the compaction snapshot, if any
    accepted_records = 0
    for kind, payload in records:
        if kind is Kind.FORMAT:
            audit.format, audit.file_id = parse_format(payload)
        elif kind is Kind.TAKE:
            d = _unpack(payload)
            audit.taken += len(d["ids"])
            outstanding.update(d["ids"])
            audit.cursor = (d["epoch"], d["pos"])
            audit.source = d.get("source", audit.source)
        elif kind in (Kind.GROUP, Kind.PACKED):
            gid = inspect_group(group_frame(kind, payload)).group_id
            if gid in accepted:
                audit.accepted_twice.append(gid)
            accepted.add(gid)
            accepted_records += 1
            buffered.add(gid)
            outstanding.discard(gid)
            failures.pop(gid, None)
        elif kind is Kind.DROP:
            d = _unpack(payload)
            outstanding.discard(d["id"])
            failures.pop(d["id"], None)
            if d["reason"] == "stale":
                audit.dropped_stale += 1
                buffered.discard(d["id"])
            elif d["reason"] == "failed":
                audit.failed += 1
            else:
                audit.filtered += 1
        elif kind is Kind.BATCH:
            d = _unpack(payload)
            audit.batches.append(d["batch_id"])
            for gid in d["ids"]:
                if gid in batched:
                    audit.batched_twice.append(gid)
                elif gid not in accepted:
                    audit.batched_unaccepted.append(gid)
                batched.add(gid)
                buffered.discard(gid)
        elif kind is Kind.CONSUMED:
            audit.consumed_through = max(audit.consumed_through, _unpack(payload)["batch_id"])
        elif kind is Kind.VERSION:
            audit.policy_version = _unpack(payload)["version"]
        elif kind is Kind.SNAPSHOT:
            snap = _unpack(payload)
            audit.compacted = True
            outstanding = set(snap["outstanding"])
            failures = dict(snap.get("failures", {}))
            buffered = set(snap["buffer"])
            for _batch_id, ids, _version in snap["batches"]:
                batched.update(ids)
            accepted.update(buffered, batched)
            audit.consumed_through = max(audit.consumed_through, snap["consumed"])
            audit.cursor = tuple(snap["cursor"])
            audit.policy_version = snap["version"]
            audit.source = snap.get("source")
            before = _run_totals(snap)
        elif kind is Kind.REF:
            refs.append(parse_ref(payload))
        elif kind is Kind.ATTEMPTS:
            failures.update(_unpack(payload))
    audit.refs = len(refs)
    audit.ref_files = sorted({file_id for file_id, _, _ in refs})
    try:
        for at in range(0, len(refs), REFS_READ_AT_ONCE):  # read and checked, then let go
            read_referred(log.parent, refs[at : at + REFS_READ_AT_ONCE])
    except JournalCorrupt as exc:
        audit.ref_error = str(exc)
    audit.accepted = len(accepted)
    audit.batched = len(batched)
    audit.outstanding = len(outstanding)
    audit.failing = sum(1 for gid in failures if gid in outstanding)
    audit.buffered = len(buffered)
    audit.run = {
        "taken": before["taken"] + audit.taken,
        "accepted": before["accepted"] + accepted_records,
        "dropped_stale": before["dropped_stale"] + audit.dropped_stale,
        "filtered": before["filtered"] + audit.filtered,
        "failed": before["failed"] + audit.failed,
        # ids run consecutively from 0 (problems says where not)
        "batches": audit.batches[-1] + 1 if audit.batches else before["batches"],
    }
    # an accepted group is batched, dropped as stale or still buffered
    audit.run["batched"] = audit.run["accepted"] - audit.run["dropped_stale"] - audit.buffered
    return audit


RUN_FIGURES = ("taken", "accepted", "dropped_stale", "filtered", "failed", "batches")


def _run_totals(snap: dict) -> dict[str, int]:
    """The run's figures up to a compaction, from its snapshot: the broker's counters (restored from every
    earlier snapshot and record, so they count from the run's start; keys an earlier tidal did not write
    read as 0) and the groups still out on leases, which were taken but neither accepted nor dropped."""
    c = snap["counters"]
    accepted, filtered, failed = (
        c.get(k, 0) for k in ("accepted_groups", "filtered_groups", "failed_groups")
    )
    return {
        "taken": accepted + filtered + failed + len(snap["outstanding"]),
        "accepted": accepted,
        "dropped_stale": c.get("dropped_stale_groups", 0),
        "filtered": filtered,
        "failed": failed,
        "batches": snap["next_batch_id"],
    }
