"""A broker's state rebuilt from its journal at start (broker/state.py): the records in the order they were
written, each applied as the change it records. Leases do not survive a restart: the prompts they held are
still outstanding and go back to the front of the queue."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgpack

from tidal.broker.codec import inspect_group
from tidal.broker.journal_records import Kind
from tidal.broker.state_records import CutBatch, StoredGroup
from tidal.broker.state_snapshot import load_snapshot

if TYPE_CHECKING:
    from tidal.broker.state import BrokerState


def replay_records(
    state: BrokerState, records: list[tuple[Kind, memoryview]], locs: list[tuple[str, int] | None] | None
) -> None:
    """Apply ``records`` (the journal's, in order) to a fresh ``state``; ``locs``: where each record's
    payload lies (the journal's ``replayed_locs``), for the groups."""
    for i, (kind, payload) in enumerate(records):
        loc = locs[i] if locs else None
        if kind is Kind.GROUP:
            info = inspect_group(payload)
            state.outstanding.pop(info.group_id, None)
            state.failures.pop(info.group_id, None)
            state._accept(StoredGroup(info, payload, loc), now=None)
        elif kind is Kind.RESTORE:
            stored = StoredGroup(inspect_group(payload), payload, loc)
            gid = stored.info.group_id
            (state.buffer if gid in state.buffer else state.batch_store)[gid] = stored
        else:
            _apply(state, kind, msgpack.unpackb(payload, raw=False, strict_map_key=False))
    missing = [g for g, s in {**state.buffer, **state.batch_store}.items() if s is None]
    if missing:
        raise RuntimeError(
            f"journal {state.journal.path}: snapshot names groups it does not hold: {missing[:5]}"
        )
    state.requeue.extend(state.outstanding)
    if state.journal is not None:
        state.source.check_resumable(
            state.journaled_source,
            [*state.outstanding, *state.buffer, *state.batch_store],
            str(state.journal.path),
            state.cfg.data.path,
        )


def _apply(state: BrokerState, kind: Kind, d: dict[str, Any]) -> None:
    if kind is Kind.TAKE:
        state.journaled_source = d.get("source", state.journaled_source)
        state.outstanding.update(dict.fromkeys(d["ids"]))
        state.source.seek(d["epoch"], d["pos"])
    elif kind is Kind.DROP:
        state.outstanding.pop(d["id"], None)
        state.failures.pop(d["id"], None)
        if d["reason"] == "stale":
            state.buffer.pop(d["id"], None)
            state.accepted_live -= 1
            state.counters.dropped_stale_groups += 1
        elif d["reason"] == "failed":
            state.counters.failed_groups += 1
        else:
            state.counters.filtered_groups += 1
    elif kind is Kind.BATCH:
        state._cut(CutBatch(d["batch_id"], d["ids"], d["version"]))
    elif kind is Kind.CONSUMED:
        state._forget_through(d["batch_id"])
    elif kind is Kind.VERSION:
        state.version = d["version"]
        state.run_model.load(d)  # the trainer's model, where a trainer's registration wrote it
    elif kind is Kind.SNAPSHOT:
        load_snapshot(state, d)
    elif kind is Kind.ATTEMPTS:
        dict.update(state.failures, d)  # the counts as they stood (Counter.update would add them)
