"""The sender's side of replayed updates (replay.py): when a sync may be replayed, asking the engines, and
sending the recorded buckets without announcements. A mixin of ``WeightSender`` (sender.py), whose state it
reads: the group and its engines' declared extensions, the sync plan's record, the bucket stream."""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future

import torch

from tidal.weights_sync import replay
from tidal.weights_sync.sync_plan import BucketRecipe
from tidal.weights_sync.sync_report import ReplayRefused, SyncFailed, SyncReport, settle


class ReplayedSyncs:
    def _replay_ready(self) -> bool:
        """Whether this sync may be replayed: one stage (this rank sends all of it), every engine of the
        group declared ``replay_updates``, and the last sync to this group was announced in full."""
        group = self._group
        return (
            self.config.replay_updates
            and self.is_sender
            and self.coordinator
            and self.stages == 1
            and group is not None
            and self._replayable is not None
            and self._replayable[:2] == (group.name, self._bucketing())
            and all("replay_updates" in self._declared.get(u, ()) for u in self._group_engines)
        )

    def _record_replayable(self, report: SyncReport) -> None:
        """After an announced sync: the digest of its buckets, if the engines can replay them next time.

        Kept with the bucketing that cut them: a sync cut otherwise (the configuration changed) is announced,
        since the engines would replay the recorded buckets while the sender broadcasts others of other
        sizes, and both sides would wait in mismatched broadcasts until the timeout."""
        self._replayable = None
        group = self._group
        if (
            group is None
            or not self.is_sender
            or not self._ordered
            or self.config.verify_checksums
            or not all("replay_updates" in self._declared.get(u, ()) for u in self._group_engines)
        ):
            return
        bucketing = self._bucketing()
        recipes = self._plan.recorded(bucketing)
        if recipes and len(recipes) == report.buckets:
            self._replayable = (group.name, bucketing, replay.plan_digest([_entry(r) for r in recipes]))

    def _bucketing(self) -> tuple:
        """What decides how tensors are bucketed (the key of the sync plan's record): the first and other
        buckets' bytes, the own-broadcast and segmented-bucket bytes (engines that take segments), and
        whether fused QKVs go whole (engines that all declared ``grouped_qkv``)."""
        first_bytes, bucket_bytes = self.config.bucket_sizes(self.backend)
        own_bytes = self.config.own_bytes(self.backend) if self._segmented else None
        max_bytes = self.config.segmented_bytes(self.backend) if own_bytes is not None else None
        grouped = own_bytes is not None and all(
            "grouped_qkv" in self._declared.get(u, ()) for u in self._group_engines
        )
        return (first_bytes, bucket_bytes, own_bytes, max_bytes, grouped)

    def _ask_replay(self, version: int) -> dict[str, Future]:
        """Ask every engine to replay the recorded plan; the answers are awaited by ``_replay_stream``'s
        gate, once the first bucket is packed."""
        assert self._group is not None and self._replayable is not None
        group, digest = self._group, self._replayable[2]
        return {
            u: self._pool.submit(
                self._clients[u].replay,
                group_name=group.name,
                plan=digest,
                weight_version=str(version),
                pause_mode=self.pause_mode,
            )
            for u in self._group_engines
        }

    def _replay_stream(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        report: SyncReport,
        asked: dict[str, Future],
    ) -> SyncFailed | None:
        """The replay: once every engine accepted, the header, then the recorded buckets' broadcasts and
        the engines' status. A refusal (``ReplayRefused``) stops it before anything is broadcast."""
        assert self._group is not None
        group = self._group
        buckets = len(self._plan.recorded(self._bucketing()) or [])
        first = next(self._seq)
        for _ in range(buckets - 1):
            next(self._seq)

        def gate() -> SyncFailed | None:
            t0 = time.perf_counter()
            refused = settle(asked, self.config.timeout_s)
            report.open_s += time.perf_counter() - t0
            if refused:
                return ReplayRefused(
                    f"{refused} have no record of this update: the next attempt announces it"
                )
            try:
                replay.header(group, first, buckets)
            except Exception as exc:  # noqa: BLE001 - the group broke: a peer is gone
                return SyncFailed(f"replayed update failed: {exc}")
            report.replayed = True
            return None

        failure: SyncFailed | None = None
        try:
            failure = self._stream(tensors, version, report, replaying=True, gate=gate)
            if failure is not None:
                # the engines may wait for a header or buckets that will not come: breaking the group fails
                # their receives, so they end the replay (the next attempt announces the sync over a new group)
                self._destroy_group()
                return failure
            t0 = time.perf_counter()
            if replay.status(group, False):
                failure = SyncFailed("an engine failed to load a replayed update")
            report.close_s += time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - the group broke: a peer is gone
            failure = failure or SyncFailed(f"replayed update failed: {exc}")
            for u in self._unhealthy(self._group_engines):
                self._drop(u, report)
        return failure


def _entry(recipe: BucketRecipe) -> replay.Entry:
    a = recipe.announcement
    return replay.Entry(a.names, a.dtypes, a.shapes, a.segments)
