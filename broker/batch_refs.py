"""Where a cut batch's group frames lie, for a trainer on the broker's host that reads them itself instead
of receiving them over the socket: in the broker's memory (``memory_refs``) or in the current journal file
(``journal_refs``). docs/protocol.md, "Batches read from the journal" and "Batches copied from the broker's
memory", is the reader's side."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tidal.broker.journal_records import Kind, record_crc
from tidal.broker.local_memory import frame_address

if TYPE_CHECKING:
    from tidal.broker.state import BrokerState
    from tidal.broker.state_records import CutBatch


def memory_refs(state: BrokerState, batch: CutBatch) -> dict[str, Any]:
    """Where the batch's group frames lie in this process: ``refs`` [[address, length, crc]] (see
    local_memory), and for frames in a node's shared ring also [..., ring, offset]: the ring's index in
    ``rings`` ({fd, bytes, nonce}) and the frame's offset in its file, which a reader may map itself.
    The frames stay held until the batch is reported consumed."""
    refs: list[list[int]] = []
    rings: list[dict[str, Any]] = []
    index: dict[int, int] = {}
    for g in batch.group_ids:
        s = state.batch_store[g]
        payload = getattr(s.frame, "buffer", s.frame)
        if s.crc is None:  # journaled PACKED, replayed after a restart or restored by compaction
            s.crc = record_crc(Kind.GROUP, payload)
        ref = [frame_address(payload), len(payload), s.crc]
        where = s.frame.ring_location() if hasattr(s.frame, "ring_location") else None
        if where is not None:
            ring, offset = where
            if ring["fd"] not in index:
                index[ring["fd"]] = len(rings)
                rings.append(ring)
            ref += [index[ring["fd"]], offset]
        refs.append(ref)
    return {"refs": refs, "rings": rings}


def journal_refs(state: BrokerState, batch: CutBatch) -> tuple[str, list[list[int]]] | None:
    """Where the batch's group frames lie in the current journal file: (file id, [[offset, length]]),
    or None when some lie elsewhere (replayed after a restart, or in a file compaction replaced)."""
    j = state.journal
    if j is None or j.file_id is None:
        return None
    refs = []
    for g in batch.group_ids:
        s = state.batch_store[g]
        if s.loc is None or s.loc[0] != j.file_id:
            return None
        refs.append([s.loc[1], s.loc[2]])
    return j.file_id, refs
