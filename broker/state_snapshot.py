"""The snapshot a journal compaction writes of the broker's state (broker/state.py), and its reading back.

A SNAPSHOT record holds the bookkeeping; each group it still needs follows as a REF (where its record lies
in an earlier file) or a RESTORE (its frame copied). Keys an earlier tidal did not write read as absent."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgpack

from tidal.broker.journal_records import Kind, ref_payload
from tidal.broker.membership import RunModel
from tidal.broker.state_records import Counters, CutBatch

if TYPE_CHECKING:
    from tidal.broker.state import BrokerState


def snapshot_records(state: BrokerState) -> Iterator[tuple[Kind, Any]]:
    snap = {
        "cursor": [state.source.epoch, state.source.pos],
        "source": state.source.identity,
        "outstanding": list(state.outstanding),
        "failures": {g: n for g, n in state.failures.items() if g in state.outstanding},
        "accepted_live": state.accepted_live,
        "version": state.version,
        "consumed": state.consumed,
        "next_batch_id": state.next_batch_id,
        "batches": [[b.batch_id, b.group_ids, b.policy_version] for b in state.batches.values()],
        "buffer": list(state.buffer),
        "counters": state.counters.__dict__,
        "histogram": dict(state.histogram),
        "trainer_known": state.run_model.known,
        "trainer_model": state.run_model.model,
    }
    yield Kind.SNAPSHOT, msgpack.packb(snap)
    for s in (*state.buffer.values(), *state.batch_store.values()):
        if s.loc is not None:
            yield Kind.REF, ref_payload(*s.loc)
        else:
            yield Kind.RESTORE, getattr(s.frame, "buffer", s.frame)


def load_snapshot(state: BrokerState, d: dict[str, Any]) -> None:
    state.journaled_source = d.get("source")  # None in a snapshot of an earlier tidal
    state.source.seek(*d["cursor"])
    state.outstanding = dict.fromkeys(d["outstanding"])
    state.failures = Counter(d.get("failures", {}))  # failed sampling attempts (format 5)
    state.accepted_live = d["accepted_live"]
    state.version = d["version"]
    state.consumed = d["consumed"]
    state.next_batch_id = d["next_batch_id"]
    state.batches = {b: CutBatch(b, ids, v) for b, ids, v in d["batches"]}
    state.batch_store = {g: None for b in state.batches.values() for g in b.group_ids}
    state.buffer = dict.fromkeys(d["buffer"])
    state.counters = Counters(**d["counters"])
    state.histogram = Counter({int(k): v for k, v in d["histogram"].items()})
    state.run_model = RunModel()
    state.run_model.load(d)
