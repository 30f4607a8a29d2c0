"""What the broker's journal says happened to every prompt group of a run.

Reads the log record by record (the broker's own reader and group decoder) and follows each group: taken
from the prompt source, accepted, dropped (stale or filtered), cut into a batch, consumed by the trainer.
``tidal run`` puts the summary in its report; the recovery tests assert on it. A compaction replaces the
history before it with a snapshot, which the audit starts from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgpack

from tidal.broker.codec import inspect_group
from tidal.broker.journal_records import Kind, group_frame, read_records


@dataclass
class JournalAudit:
    taken: int = 0  # groups handed out from the prompt source (leases included)
    accepted: int = 0
    dropped_stale: int = 0
    filtered: int = 0
    batched: int = 0  # groups cut into batches
    batches: list[int] = field(default_factory=list)  # batch ids in journal order
    consumed_through: int = -1  # the last batch the trainer reported durably trained
    outstanding: int = 0  # taken, not yet accepted or dropped (in flight when the log ends)
    buffered: int = 0  # accepted, not yet in a batch
    compacted: bool = False
    accepted_twice: list[str] = field(default_factory=list)
    batched_twice: list[str] = field(default_factory=list)
    batched_unaccepted: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        out = []
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
        d["problems"] = self.problems
        return d


def _unpack(payload: memoryview) -> dict:
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


def audit_journal(path: str | Path) -> JournalAudit:
    """Follow every group through the journal at ``path`` (a ``journal.log`` or its directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / "journal.log"
    records, _ = read_records(memoryview(path.read_bytes()))
    audit = JournalAudit()
    outstanding: set[str] = set()
    accepted: set[str] = set()
    buffered: set[str] = set()
    batched: set[str] = set()
    for kind, payload in records:
        if kind is Kind.TAKE:
            ids = _unpack(payload)["ids"]
            audit.taken += len(ids)
            outstanding.update(ids)
        elif kind in (Kind.GROUP, Kind.PACKED):
            gid = inspect_group(group_frame(kind, payload)).group_id
            if gid in accepted:
                audit.accepted_twice.append(gid)
            accepted.add(gid)
            buffered.add(gid)
            outstanding.discard(gid)
        elif kind is Kind.DROP:
            d = _unpack(payload)
            outstanding.discard(d["id"])
            if d["reason"] == "stale":
                audit.dropped_stale += 1
                buffered.discard(d["id"])
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
        elif kind is Kind.SNAPSHOT:
            snap = _unpack(payload)
            audit.compacted = True
            outstanding = set(snap["outstanding"])
            buffered = set(snap["buffer"])
            for _batch_id, ids, _version in snap["batches"]:
                batched.update(ids)
            accepted.update(buffered, batched)
            audit.consumed_through = max(audit.consumed_through, snap["consumed"])
    audit.accepted = len(accepted)
    audit.batched = len(batched)
    audit.outstanding = len(outstanding)
    audit.buffered = len(buffered)
    return audit
