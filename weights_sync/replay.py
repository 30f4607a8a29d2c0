"""Replayed updates (tidal's ``replay_updates`` extension): a sync that repeats the last one's buckets
without announcing them.

After a sync whose every bucket was announced (``/update_weights_from_distributed`` with ``bucket_seq``),
the engine keeps the announcements (``Recorder``) under a digest of their names, dtypes, shapes and
segments (``plan_digest``), which the sender computes from its own record (``sync_plan.py``). The next sync
of the same buckets is then:

1. ``POST /tidal/replay_weight_update {group_name, plan, weight_version, pause_mode}``: the engine checks
   the digest, pauses, starts a thread that will receive, and answers (the sender packs the first bucket
   meanwhile). An engine without that plan refuses, and the sender announces this sync instead.
2. A header broadcast (``[first bucket_seq, buckets]``, int64): receives may now be posted.
3. The buckets' broadcasts, exactly as an announced sync sends them; the engine receives and loads each
   as its announcement would have had it (``ReplaySession.run``), two at a time (double-buffered).
4. A status reduce to the sender (max of each engine's failure flag), joined by each engine once it has
   loaded every bucket and set the version: the sync ends there, without a reply per bucket or a closing
   call. (A reduce, not an all-reduce: the engines need not learn of each other's failure, as the sender
   rebuilds the group after one, and it saves a step, ~0.1 ms on loopback gloo.)

So a sync costs one HTTP round trip and two tiny collectives besides its bytes, as a raw broadcast
triggered over HTTP does. See docs/weights_sync.md ("Replayed updates").
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tidal.weights_sync import transport

ROUTE = "/tidal/replay_weight_update"

# buckets of a replay whose receives may be posted at once: once the engine's weights are laid out in the
# broadcasts' order every bucket lands in its own memory, so its receive is posted as soon as its turn
# comes, not when the bucket two before has been loaded (buckets received into the receiver's two shared
# buffers still go two at a time)
RECEIVING = 8


def workers() -> ThreadPoolExecutor:
    """An engine's threads for its replayed updates (one replay at a time): the session and its buckets' receives.
    Kept for the engine's lifetime: starting them per sync cost about 0.1 ms each."""
    return ThreadPoolExecutor(max_workers=1 + RECEIVING, thread_name_prefix="weights-replay")


@dataclass(frozen=True)
class Entry:
    """One bucket's announcement, as far as a replay repeats it."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    segments: list[int] | None


def plan_digest(entries: list[Entry]) -> str:
    """The same string on the sender (from its record) and on the engine (from the announcements)."""
    canonical = [[e.names, e.dtypes, [list(s) for s in e.shapes], e.segments] for e in entries]
    return hashlib.sha256(json.dumps(canonical, separators=(",", ":")).encode()).hexdigest()[:32]


class Recorder:
    """The announcements of the update in progress, per group; the last complete one becomes the group's
    replayable plan. An update with a failed or unordered bucket leaves no plan."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, dict[int, Entry]] = {}
        self._broken: set[str] = set()
        self._plans: dict[str, tuple[str, list[Entry]]] = {}

    def begin(self) -> None:
        with self._lock:
            self._open.clear()
            self._broken.clear()

    def add(self, group_name: str, seq: int | None, entry: Entry | None) -> None:
        """A bucket announced in the open update; ``entry`` None (or no ``seq``): it cannot be replayed."""
        with self._lock:
            if seq is None or entry is None:
                self._broken.add(group_name)
            else:
                self._open.setdefault(group_name, {})[seq] = entry

    def fail(self, group_name: str) -> None:
        with self._lock:
            self._broken.add(group_name)
            self._plans.pop(group_name, None)

    def end(self) -> None:
        """The update closed: each group's buckets (consecutive ``bucket_seq``) become its plan."""
        with self._lock:
            for group_name, by_seq in self._open.items():
                seqs = sorted(by_seq)
                if group_name in self._broken or seqs != list(range(seqs[0], seqs[0] + len(seqs))):
                    self._plans.pop(group_name, None)
                    continue
                entries = [by_seq[s] for s in seqs]
                self._plans[group_name] = (plan_digest(entries), entries)
            self._open.clear()
            self._broken.clear()

    def plan(self, group_name: str, digest: str) -> list[Entry] | None:
        with self._lock:
            kept = self._plans.get(group_name)
        return kept[1] if kept is not None and kept[0] == digest else None

    def last(self, group_name: str) -> list[Entry] | None:
        """The group's recorded plan, if any."""
        with self._lock:
            kept = self._plans.get(group_name)
        return None if kept is None else kept[1]

    def forget(self, group_name: str) -> None:
        """The group is gone (destroyed): its plan can never be replayed."""
        with self._lock:
            self._plans.pop(group_name, None)

    def __len__(self) -> int:
        """Plans kept (one per live group that completed an announced update)."""
        with self._lock:
            return len(self._plans)


def header(group: transport.WeightGroup, first_seq: int = 0, buckets: int = 0) -> tuple[int, int]:
    """Step 2: the sender broadcasts ``[first_seq, buckets]``; an engine receives it (its arguments unused)."""
    t = torch.tensor([first_seq, buckets], dtype=torch.int64, device=_device(group))
    group.broadcast(t, src=0)
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()
    first, n = t.tolist()
    return int(first), int(n)


def status(group: transport.WeightGroup, failed: bool) -> bool:
    """Step 4: on the sender (rank 0), whether any rank failed, once every rank joined (a reduce of each
    rank's flag); on an engine, its own ``failed``."""
    t = torch.tensor([1 if failed else 0], dtype=torch.int32, device=_device(group))
    opts = torch.distributed.ReduceOptions()
    opts.reduceOp = torch.distributed.ReduceOp.MAX
    opts.rootRank = 0
    opts.rootTensor = 0
    group.pg.reduce([t], opts).wait()
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()
    return bool(t.item()) if group.rank == 0 else failed


def _device(group: transport.WeightGroup) -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl" else torch.device("cpu")
    )


class ReplaySession:
    """An engine's side of one replayed update (steps 2-4), run on one of ``pool``'s threads (``workers()``).

    ``receive_and_load(entry, seq)`` receives and loads one bucket exactly as its announcement's handler
    would (it takes ``seq``'s turn in the shared receiver); ``finish()`` runs once every bucket loaded (the
    engine sets the version), before the status reduce.
    """

    def __init__(
        self,
        group: transport.WeightGroup,
        entries: list[Entry],
        receive_and_load: Callable[[Entry, int], None],
        finish: Callable[[], None],
        set_next_seq: Callable[[int], None],
        pool: ThreadPoolExecutor,
    ):
        self.group = group
        self.pool = pool
        self.entries = entries
        self.receive_and_load = receive_and_load
        self.finish = finish
        self.set_next_seq = set_next_seq
        self.error: BaseException | None = None

    def run(self) -> bool:
        """Steps 2-4; True when every engine loaded every bucket. Never raises (``error`` keeps ours)."""
        failed = False
        try:
            first, n = header(self.group)
            if n != len(self.entries):
                raise ValueError(f"the sender replays {n} buckets; the recorded plan has {len(self.entries)}")
            self.set_next_seq(first)
            if len(self.entries) == 1:  # nothing to overlap
                self.receive_and_load(self.entries[0], first)
            else:
                # each on a thread of its own (up to RECEIVING), as pipelined announcements: the buckets'
                # receives are posted in order while earlier ones are still being loaded
                futures = [
                    self.pool.submit(self.receive_and_load, entry, first + i)
                    for i, entry in enumerate(self.entries)
                ]
                for future in futures:
                    exc = future.exception()
                    if exc is not None and self.error is None:
                        self.error = exc
            failed = self.error is not None
            if not failed:
                self.finish()
        except BaseException as exc:  # noqa: BLE001 - reported through the status reduce
            self.error = self.error or exc
            failed = True
        try:
            return not status(self.group, failed)
        except Exception as exc:  # noqa: BLE001 - the group broke (the sender rebuilds it)
            self.error = self.error or exc
            return False
