"""The broker's bookkeeping, without any I/O but the journal: prompts, leases, members, buffer, batches.

Every change that must survive a crash is journaled before the method returns, so the server may
acknowledge as soon as a call returns. Time is passed in (``now``, unix seconds) to keep this testable.

Group lifecycle: taken from the source (journal TAKE; "outstanding") -> on a lease -> submitted: accepted
into the buffer (journal GROUP) or filtered (journal DROP) -> cut into a batch (journal BATCH) or
dropped as too stale (journal DROP) -> consumed (journal CONSUMED; forgotten at the next compaction).
An expired, released or abandoned lease puts its groups back at the front of the queue.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections import Counter, deque
from typing import Any

import msgpack

from tidal.broker import staleness as st
from tidal.broker.codec import inspect_group
from tidal.broker.config import BrokerConfig
from tidal.broker.journal import Journal
from tidal.broker.journal_packing import pack_group
from tidal.broker.journal_records import Kind, packed_crcs, record_crc
from tidal.broker.membership import RunModel, live_trainer, mismatch, model_of, second_trainer, takes_over
from tidal.broker.protocol import (
    ANOTHER_TRAINER,
    BAD_GROUP,
    BAD_REQUEST,
    LEASE_REJECTED,
    MODEL_MISMATCH,
    NOT_REGISTERED,
    ProtocolError,
)
from tidal.broker.source import PromptSource
from tidal.broker.state_records import Counters, CutBatch, LeaseState, Node, StoredGroup
from tidal.broker.state_replay import replay_records
from tidal.broker.state_snapshot import snapshot_records
from tidal.broker.state_stats import ThroughputWindow, state_stats
from tidal.broker.types import Lease, PromptGroup

log = logging.getLogger(__name__)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj)


def _close_arena(node: Node) -> None:
    if node.arena is not None:
        node.arena.close()
        node.arena = None


class BrokerState:
    def __init__(self, config: BrokerConfig, source: PromptSource, journal: Journal | None):
        self.cfg = config
        self.source = source
        self.journal = journal
        self.requeue: deque[str] = deque()
        self.outstanding: dict[str, None] = {}  # taken from the source, not yet resolved (ordered set)
        # failed sampling attempts of outstanding groups (journaled as ATTEMPTS from journal format 5)
        self.failures: Counter[str] = Counter()
        self.leases: dict[str, LeaseState] = {}
        # groups on leases, not yet submitted: the sum of every lease's ``pending``, kept as they change
        # (admission reads it for every lease granted, and summing it walked every lease in flight)
        self.leased = 0
        self.nodes: dict[str, Node] = {}
        self.peers: dict[bytes, str] = {}
        self.streaming: dict[str, None] = {}  # node ids with a standing lease request (ordered set)
        self.version = 0
        self.run_model = RunModel()  # the model rollout nodes must serve (broker/membership.py)
        self._trainer_refusal_logged = float("-inf")  # when a second trainer's refusal was last logged
        self.accepted_live = 0  # admission's "accepted": accepted and not dropped, since the run started
        self.buffer: dict[str, StoredGroup | None] = {}  # accepted, not yet in a batch (FIFO)
        self.batches: dict[int, CutBatch] = {}  # cut and not yet consumed
        self.batch_store: dict[str, StoredGroup | None] = {}  # groups of those batches
        self.next_batch_id = 0
        self.consumed = -1
        self.counters = Counters()
        self.histogram: Counter[int] = Counter()
        self.recent = ThroughputWindow()  # accepted groups, samples and bytes over the last seconds
        # Staleness only grows with the version: buffered groups are checked again only when it changed,
        # others once (every get_batch used to walk the whole buffer).
        self._scanned_version: int | None = None
        self._unscanned: list[str] = []
        self._compact_checked_at = 0  # journal size when maybe_compact last summed the live bytes
        # Groups this broker journaled as PACKED records, and the bytes that saved (since it started).
        self.packed_groups = 0
        self.packed_bytes_saved = 0
        # Lease ids: a random prefix per broker process and a counter (uuid4 per lease read os.urandom
        # every time); leases do not survive a restart, and the prefix keeps ids of two runs apart.
        self._lease_prefix = uuid.uuid4().hex[:16]
        self._lease_count = itertools.count()
        # The prompt source's identity as the journal recorded it (source.py): a replay checks it, and the
        # first TAKE record of a journal without it records it.
        self.journaled_source: dict[str, Any] | None = None

    # ---------------------------------------------------------------- journal
    def _log(self, kind: Kind, payload: bytes | memoryview) -> None:
        """Journal a record; one of a kind a later format added is left out of an older file (``takes``)."""
        if self.journal is not None and self.journal.takes(kind):
            self.journal.append(kind, payload)

    def replay(
        self, records: list[tuple[Kind, memoryview]], locs: list[tuple[str, int] | None] | None = None
    ) -> None:
        """Rebuild the state from the journal (broker/state_replay.py); leases do not survive a restart,
        their prompts are re-queued. ``locs``: where each record's payload lies (the journal's
        ``replayed_locs``), for the groups."""
        replay_records(self, records, locs)

    # ------------------------------------------------------------- membership
    def register(
        self, peer: bytes, role: str, name: str, meta: dict[str, Any], now: float, replaces: str | None = None
    ) -> Node:
        if role not in ("rollout", "trainer"):
            raise ProtocolError(BAD_REQUEST, f"register: role must be 'rollout' or 'trainer', got {role!r}")
        model = model_of(meta)
        if role == "rollout" and (why := mismatch(name, model, self.run_model.model)):
            log.warning("refused: %s", why)
            self.counters.refused_nodes += 1
            raise ProtocolError(MODEL_MISMATCH, why)
        old = self.peers.get(peer)
        if role == "trainer":
            others = [n for n in self.nodes.values() if n.role == "trainer" and n.peer != peer]
            other = live_trainer(others, now, self.cfg.node_timeout_s)
            if other is not None and takes_over(name, meta, other, replaces):
                self.counters.trainer_takeovers += 1
            elif other is not None:
                why = second_trainer(name, other, now, self.cfg.node_timeout_s)
                # a waiting trainer asks every second: its refusal is logged every 30 s
                if now - self._trainer_refusal_logged >= 30.0:
                    self._trainer_refusal_logged = now
                    log.warning("refused: %s (logged every 30 s while it asks again)", why)
                self.counters.refused_trainers += 1
                raise ProtocolError(ANOTHER_TRAINER, why)
            for dead in others:  # forgotten: should it come back, it registers again and is refused
                log.info(
                    "trainer %s (%r) forgotten: trainer %r takes its place", dead.node_id, dead.name, name
                )
                self.leave(dead)
        if old is not None:
            self.leave(self.nodes[old])
        if role == "trainer" and self.run_model.trainer_registers(model):
            self._let_go_other_models()
            trainer_model = self.run_model.model
            self._log(Kind.VERSION, _pack({"version": self.version, "trainer_model": trainer_model}))
        node = Node(f"{role}-{uuid.uuid4().hex[:8]}", role, name, meta, peer, now, now, model=model)
        self.nodes[node.node_id] = node
        self.peers[peer] = node.node_id
        return node

    def _let_go_other_models(self) -> None:
        for node in list(self.nodes.values()):
            if node.role == "rollout" and (why := mismatch(node.name, node.model, self.run_model.model)):
                log.warning("node %s let go: %s", node.node_id, why)
                self.counters.refused_nodes += 1
                self.leave(node)

    def node_for(self, peer: bytes, now: float) -> Node:
        node_id = self.peers.get(peer)
        if node_id is None:
            raise ProtocolError(NOT_REGISTERED, "this connection has not registered; send 'register' first")
        node = self.nodes[node_id]
        node.last_seen, node.alive = now, True
        return node

    def seen(self, peer: bytes, now: float) -> None:
        node_id = self.peers.get(peer)
        if node_id is not None:
            node = self.nodes[node_id]
            node.last_seen, node.alive = now, True

    def heartbeat(self, node: Node, now: float) -> int:
        for lease_id in node.leases:
            self.leases[lease_id].deadline = now + self.cfg.lease_timeout_s
        return len(node.leases)

    def leave(self, node: Node) -> None:
        for lease_id in list(node.leases):
            self._return_lease(lease_id)
        node.alive = False
        _close_arena(node)
        self.peers.pop(node.peer, None)
        self.nodes.pop(node.node_id, None)
        self.streaming.pop(node.node_id, None)

    # ------------------------------------------------------------------ leases
    def _unlease(self, lease: LeaseState, gid: str) -> None:
        """Take a group off a lease (submitted, given back or dropped)."""
        del lease.pending[gid]
        self.leased -= 1
        node = self.nodes.get(lease.node_id)  # a node leaves only once its leases are given back
        if node is not None:
            node.in_flight -= 1

    def capacity(self) -> int:
        return st.admission_capacity(
            leased=self.leased,
            accepted=self.accepted_live,
            version=self.version,
            max_staleness=self.cfg.max_staleness,
            batch_groups=self.cfg.batch_groups,
        )

    def lease(self, node: Node, max_groups: int, now: float) -> Lease | None:
        if max_groups < 1:
            raise ProtocolError(BAD_REQUEST, f"lease: max_groups must be >= 1, got {max_groups}")
        if node.model is not None and not self.run_model.known:
            return None  # its model is checked against the trainer's, which has not registered yet
        k = min(max_groups, self.capacity())
        if k <= 0:
            return None
        ids = [self.requeue.popleft() for _ in range(min(k, len(self.requeue)))]
        if len(ids) < k:
            fresh = self.source.take(k - len(ids))
            if fresh:
                take = {"ids": fresh, "epoch": self.source.epoch, "pos": self.source.pos}
                if self.journaled_source is None and self.journal is not None:
                    self.journaled_source = take["source"] = self.source.identity
                self._log(Kind.TAKE, _pack(take))
                self.outstanding.update(dict.fromkeys(fresh))
                ids += fresh
        if not ids:
            return None
        groups = {g: PromptGroup(g, self.source.row_of(g), self.cfg.group_size) for g in ids}
        lease_id = f"{self._lease_prefix}{next(self._lease_count):x}"
        lease = LeaseState(lease_id, node.node_id, now + self.cfg.lease_timeout_s, groups)
        self.leases[lease.lease_id] = lease
        self.leased += len(groups)
        node.in_flight += len(groups)
        node.leases.add(lease.lease_id)
        return Lease(lease.lease_id, lease.deadline, list(groups.values()))

    def stream_leases(self, node: Node, credit: int, max_groups: int | None, rid: int) -> None:
        """Set the node's standing request: keep ``credit`` groups in flight on its leases."""
        if credit < 0:
            raise ProtocolError(BAD_REQUEST, f"stream_leases: credit must be >= 0, got {credit}")
        if max_groups is not None and max_groups < 1:
            raise ProtocolError(
                BAD_REQUEST, f"stream_leases: max_groups must be >= 1 or nil, got {max_groups}"
            )
        node.credit, node.stream_max, node.stream_id = credit, max_groups or credit, rid
        node.told_finished = False
        self.streaming[node.node_id] = None
        if credit == 0:
            self.streaming.pop(node.node_id, None)

    def push_leases(self, now: float) -> list[tuple[Node, Lease | None]]:
        """Leases for the streaming nodes up to their credit (a submit, release or expiry returned some),
        while admission allows; ``(node, None)`` once per node when the data is exhausted."""
        out: list[tuple[Node, Lease | None]] = []
        for node_id in self.streaming:
            node = self.nodes.get(node_id)
            if node is None or not node.alive:
                continue
            want = node.credit - node.in_flight
            while want > 0:
                lease = self.lease(node, min(want, node.stream_max), now)
                if lease is None:
                    if self.finished and not node.told_finished:
                        node.told_finished = True
                        out.append((node, None))
                    break
                out.append((node, lease))
                want -= len(lease.groups)
        return out

    def _return_lease(self, lease_id: str, group_ids: list[str] | None = None) -> int:
        lease = self.leases[lease_id]
        ids = list(lease.pending) if group_ids is None else [g for g in group_ids if g in lease.pending]
        for g in ids:
            self._unlease(lease, g)
        self.requeue.extendleft(reversed(ids))
        if not lease.pending:
            self._close_lease(lease)
        return len(ids)

    def _close_lease(self, lease: LeaseState) -> None:
        self.leases.pop(lease.lease_id, None)
        node = self.nodes.get(lease.node_id)
        if node is not None:
            node.leases.discard(lease.lease_id)

    def release(
        self, node: Node, lease_id: str, group_ids: list[str] | None, error: str | None = None
    ) -> int:
        """Groups given back, leased again first; with ``error`` the node failed to sample them, and a group
        that has failed ``max_group_failures`` times is dropped (journaled) instead."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.node_id != node.node_id:
            return 0  # already expired or closed: its groups are back in the queue
        if error is not None:
            ids = list(lease.pending) if group_ids is None else [g for g in group_ids if g in lease.pending]
            for gid in ids:
                self.failures[gid] += 1
            given_up = [g for g in ids if self.failures[g] >= self.cfg.max_group_failures]
            for gid in given_up:
                self._drop_failed(lease, gid, node, error)
            group_ids = [g for g in ids if g not in given_up]
            if group_ids:  # a restart goes on counting
                self._log(Kind.ATTEMPTS, _pack({g: self.failures[g] for g in group_ids}))
            if not lease.pending:
                self._close_lease(lease)
        n = self._return_lease(lease_id, group_ids) if lease_id in self.leases else 0
        self.counters.released_groups += n
        return n

    def _drop_failed(self, lease: LeaseState, gid: str, node: Node, error: str) -> None:
        self._log(Kind.DROP, _pack({"id": gid, "reason": "failed", "error": error[:500]}))
        self._unlease(lease, gid)
        self.outstanding.pop(gid, None)
        self.failures.pop(gid, None)
        self.counters.failed_groups += 1
        log.warning(
            "group %s dropped after %d failed attempts (broker.max_group_failures), the last on %s: %s",
            gid,
            self.cfg.max_group_failures,
            node.name,
            error,
        )

    def expire(self, now: float) -> None:
        """Return the groups of expired leases and of nodes that stopped talking to the queue."""
        for lease in list(self.leases.values()):
            if lease.deadline < now:
                self.counters.expired_leases += 1
                self._return_lease(lease.lease_id)
        for node in self.nodes.values():
            if node.alive and now - node.last_seen > self.cfg.node_timeout_s:
                node.alive = False
                _close_arena(node)  # a dead node's ring is not kept mapped; held spans stay readable
                self.counters.nodes_timed_out += 1
                for lease_id in list(node.leases):
                    self.counters.expired_leases += 1
                    self._return_lease(lease_id)

    # ------------------------------------------------------------------ submit
    def submit(self, node: Node, lease_id: str, frames: list[Any], now: float) -> dict[str, list[str]]:
        lease = self.leases.get(lease_id)
        if lease is not None and lease.deadline < now:
            self.counters.expired_leases += 1
            self._return_lease(lease_id)
            lease = None
        if lease is None or lease.node_id != node.node_id:
            self.counters.rejected_submissions += 1
            raise ProtocolError(
                LEASE_REJECTED,
                f"lease {lease_id!r} is unknown or expired (its prompts went back to the queue); "
                "drop these groups and lease again",
            )
        stored: list[StoredGroup] = []
        for frame in frames:
            info = inspect_group(frame)
            pg = lease.pending.get(info.group_id)
            if pg is None:
                self.counters.rejected_submissions += 1
                raise ProtocolError(
                    LEASE_REJECTED, f"group {info.group_id!r} is not outstanding on lease {lease_id!r}"
                )
            if info.num_samples != pg.n:
                raise ProtocolError(
                    BAD_GROUP,
                    f"group {info.group_id!r} has {info.num_samples} samples; submit whole groups of n={pg.n}",
                )
            if any(s.info.group_id == info.group_id for s in stored):
                raise ProtocolError(BAD_GROUP, f"group {info.group_id!r} appears twice in one submission")
            stored.append(StoredGroup(info, frame))
        accepted, filtered = [], []
        for s in stored:
            gid = s.info.group_id
            if self.cfg.dynamic_sampling and len(set(s.info.rewards)) == 1:
                self._log(Kind.DROP, _pack({"id": gid, "reason": "filtered"}))
                self.counters.filtered_groups += 1
                filtered.append(gid)
            else:
                if self.journal is not None:
                    self._journal_group(s)
                self._accept(s, now)
                accepted.append(gid)
            self.outstanding.pop(gid, None)
            self.failures.pop(gid, None)
            self._unlease(lease, gid)
        if not lease.pending:
            self._close_lease(lease)
        return {"accepted": accepted, "filtered": filtered}

    def _journal_group(self, s: StoredGroup) -> None:
        """Journal an accepted group: PACKED (its versions run-length encoded) where that pays and the
        file takes it, else its frame as it came in a GROUP record."""
        j = self.journal
        payload = getattr(s.frame, "buffer", s.frame)
        packed = None
        if j.takes(Kind.PACKED) and s.info.versions_at is not None:
            at, count, dtype = s.info.versions_at
            frame = memoryview(payload).cast("B")
            packed = pack_group(frame, at, count, dtype, s.info.min_version, s.info.max_version)
        if packed is not None:
            # a local memory reader checks the frame's own CRC: both from one pass where they can be
            # (else the record's when written, the frame's when a batch first holds it)
            crcs = packed_crcs(frame, packed)
            if crcs is not None:
                record, s.crc = crcs
                j.append(Kind.PACKED, packed, record)
            else:
                j.append(Kind.PACKED, packed)
            length = len(packed)
            self.packed_groups += 1
            self.packed_bytes_saved += len(payload) - length
        else:
            # computed once: the journal record carries it and a local memory reader checks it
            s.crc = record_crc(Kind.GROUP, payload)
            j.append(Kind.GROUP, payload, s.crc)
            length = len(payload)
        if j.file_id is not None:
            s.loc = (j.file_id, j.last_offset, length)

    def _accept(self, s: StoredGroup, now: float | None) -> None:
        self.buffer[s.info.group_id] = s
        self._unscanned.append(s.info.group_id)
        self.accepted_live += 1
        c = self.counters
        c.accepted_groups += 1
        c.accepted_samples += s.info.num_samples
        nbytes = len(s.frame)
        c.accepted_bytes += nbytes
        if now is not None:
            self.recent.add(now, s.info.num_samples, nbytes)

    # ----------------------------------------------------------------- version
    def publish_version(self, version: int) -> None:
        if version < 0:
            raise ProtocolError(BAD_REQUEST, f"publish_version: version must be >= 0, got {version}")
        if version != self.version:
            self._log(Kind.VERSION, _pack({"version": version}))
            self.version = version

    # ----------------------------------------------------------------- batches
    @property
    def finished(self) -> bool:
        """No more groups will ever arrive: the data is exhausted and nothing is in flight."""
        return self.source.exhausted and not self.outstanding

    def get_batch(self, after: int, num_groups: int | None) -> CutBatch | None:
        """The batch ``after + 1`` if it was cut or can be cut now; None means wait."""
        want = after + 1
        if want in self.batches:
            return self.batches[want]
        if want <= self.consumed:
            raise ProtocolError(
                BAD_REQUEST, f"batch {want} was reported consumed; ask for batches after {self.consumed}"
            )
        if want != self.next_batch_id:
            raise ProtocolError(
                BAD_REQUEST,
                f"batch {want} cannot be cut yet: batches are cut in order and the next is "
                f"{self.next_batch_id} (pass after={self.next_batch_id - 1})",
            )
        n = num_groups or self.cfg.batch_groups
        if n < 1:
            raise ProtocolError(BAD_REQUEST, f"get_batch: num_groups must be >= 1, got {n}")
        if self.cfg.staleness_policy == "drop":
            self._drop_stale()
        if len(self.buffer) < n and not (self.finished and self.buffer):
            return None
        batch = CutBatch(self.next_batch_id, list(self.buffer)[:n], self.version)
        self._log(
            Kind.BATCH, _pack({"batch_id": batch.batch_id, "ids": batch.group_ids, "version": self.version})
        )
        self._cut(batch)
        return batch

    def _drop_stale(self) -> None:
        if self.version != self._scanned_version:
            candidates = list(self.buffer.items())
            self._scanned_version = self.version
        else:
            candidates = [(g, self.buffer[g]) for g in self._unscanned if g in self.buffer]
        self._unscanned = []
        for gid, s in candidates:
            if st.too_stale(self.version, s.info.min_version, self.cfg.max_staleness):
                self._log(Kind.DROP, _pack({"id": gid, "reason": "stale"}))
                del self.buffer[gid]
                self.accepted_live -= 1
                self.counters.dropped_stale_groups += 1

    def _cut(self, batch: CutBatch) -> None:
        for gid in batch.group_ids:
            stored = self.buffer.pop(gid)
            self.batch_store[gid] = stored
            self.histogram[st.staleness(batch.policy_version, stored.info.min_version)] += 1
        self.batches[batch.batch_id] = batch
        self.next_batch_id = batch.batch_id + 1
        self.counters.batches_cut += 1

    def frames_of(self, batch: CutBatch) -> list[Any]:
        return [self.batch_store[g].frame for g in batch.group_ids]

    def report_consumed(self, batch_id: int) -> None:
        if batch_id >= self.next_batch_id:
            raise ProtocolError(
                BAD_REQUEST,
                f"report_consumed: batch {batch_id} was never cut (next is {self.next_batch_id})",
            )
        if batch_id <= self.consumed:
            return
        self._log(Kind.CONSUMED, _pack({"batch_id": batch_id}))
        self._forget_through(batch_id)

    def _forget_through(self, batch_id: int) -> None:
        for b in [b for b in self.batches if b <= batch_id]:
            for gid in self.batches.pop(b).group_ids:
                self.batch_store.pop(gid, None)
        self.consumed = max(self.consumed, batch_id)

    # -------------------------------------------------------------- compaction
    def live_bytes(self) -> int:
        """The journal bytes of the groups still held (a PACKED record's, not its frame's)."""
        return sum(
            s.loc[2] if s.loc else len(s.frame)
            for s in (*self.buffer.values(), *self.batch_store.values())
            if s
        )

    def maybe_compact(self) -> bool:
        j = self.journal
        # Compact once the dead part of the log (consumed groups, superseded records) reaches the threshold,
        # and outweighs the live part enough that rewriting the live groups stays a small share of the I/O.
        if j is None or j.compacting:
            return False
        jc = self.cfg.journal
        # The dead bytes are at most the journal's size; and summing the live ones walks every held group,
        # so it is done once per 1/16 of the threshold written at most (or at once after a compaction).
        if (
            j.bytes_written < jc.compact_every_bytes
            or 0 <= j.bytes_written - self._compact_checked_at < jc.compact_every_bytes // 16
        ):
            return False
        self._compact_checked_at = j.bytes_written
        live = self.live_bytes()
        dead = j.bytes_written - live
        if dead < jc.compact_every_bytes or dead < jc.compact_dead_per_live * live:
            return False
        offsets = j.compact(snapshot_records(self))
        # The snapshot first, then per kept group a REF to where it lies (it stays there) or, for a group
        # whose place is unknown, a RESTORE that copies it into the new file.
        kept = [*self.buffer.values(), *self.batch_store.values()]
        for s, offset in zip(kept, offsets[1:], strict=True):
            if s.loc is None:
                s.loc = (j.file_id, offset, len(s.frame))
        return True

    # ------------------------------------------------------------------- stats
    def stats(self, now: float | None = None) -> dict[str, Any]:
        return state_stats(self, time.time() if now is None else now)
