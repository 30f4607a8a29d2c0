"""Live weight sync, trainer side: stream a stage's Hugging Face tensors to every engine.

Every trainer rank calls ``WeightSender.sync`` with the same kind of tensor iterator (``gather.iter_hf``:
gathering is collective inside TP/EP groups); on the stage's sender rank the tensors are packed into
dtype-homogeneous flattened buckets and broadcast over a weight-update group made of this sender
(rank 0) and every engine rank. Per bucket the HTTP announcement (``/update_weights_from_distributed``,
whose handler blocks in the receive) and the broadcast run concurrently, and the next bucket is
gathered and packed while the current one is in flight (two staging buffers).

The whole sync sits inside ``/begin_weight_update`` ... ``/end_weight_update`` opened by the first
stage's sender between two trainer-wide barriers. An engine that fails (HTTP error, broadcast error
or timeout) is dropped: the rest of the attempt only drains the gather, every rank learns of the
failure through an all-reduce, and the sync runs once more over a group rebuilt without it.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from tidal.procs import free_port
from tidal.weights_sync import bucket, grouped_qkv, segments, transport, update_calls
from tidal.weights_sync.config import WeightSyncConfig
from tidal.weights_sync.engine_api import Announcement, EngineEndpoint, EngineWeightsClient
from tidal.weights_sync.replay_sender import ReplayedSyncs
from tidal.weights_sync.sync_plan import PlanDiverged, SyncPlan
from tidal.weights_sync.sync_report import ReplayRefused, SyncFailed, SyncReport, drain, settle

TensorSource = Callable[[], Iterable[tuple[str, torch.Tensor]]]


class WeightSender(ReplayedSyncs):
    """One trainer rank's part in weight syncs to a set of engines.

    ``is_sender``: this rank sends its pipeline stage (tensor-, context- and data-parallel rank 0);
    ``coordinator``: this rank opens and closes the update on the engines (the first stage's sender).
    ``stages``: pipeline stages, each with a sender; with one, the update is opened while the first bucket
    is gathered and packed (with several, every sender waits behind a barrier until it is open).
    ``barrier`` / ``any_failed`` synchronise all trainer ranks (defaults: torch.distributed's default
    group when initialised, else single-process no-ops).
    """

    def __init__(
        self,
        config: WeightSyncConfig,
        engines: list[EngineEndpoint],
        *,
        stage: int = 0,
        stages: int = 1,
        is_sender: bool = True,
        coordinator: bool | None = None,
        backend: str = "gloo",
        master_address: str = "127.0.0.1",
        device: str | torch.device = "cpu",
        barrier: Callable[[], None] | None = None,
        any_failed: Callable[[bool], bool] | None = None,
    ):
        self.config = config
        self.stage = stage
        self.stages = stages
        self.is_sender = is_sender
        self.coordinator = is_sender and stage == 0 if coordinator is None else coordinator
        self.backend = backend
        self.master_address = master_address
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pause_mode = config.pause_mode
        self._barrier = barrier or _default_barrier
        self._any_failed = any_failed or _default_any_failed
        self._clients: dict[str, EngineWeightsClient] = {}
        self._group: transport.WeightGroup | None = None
        self._group_engines: list[str] = []
        self._ordered = False  # every engine of the group receives in bucket_seq order
        self._segmented = False  # ... and takes a bucket as several broadcasts (bucket_segments)
        self._declared: dict[str, frozenset[str]] = {}  # each engine's extensions (init_weights_update_group)
        self._seq = itertools.count()
        self._generation = itertools.count()
        self._staging: list[torch.Tensor | None] = [None, None]
        self._raw_distinct: torch.Tensor | None = None  # raw_broadcast's source with distinct=True
        self._plan = SyncPlan()  # the buckets of the last sync, replayed by the next one
        # (group name, bucketing, plan digest) of the last sync announced in full to engines that replay
        # updates: the next sync of the same buckets is replayed (replay.py) instead of announced
        self._replayable: tuple[str, tuple, str] | None = None
        # announcements to engines stuck in a receive may hold a worker until they time out
        self._pool = ThreadPoolExecutor(
            max_workers=max(16, 4 * len(engines)), thread_name_prefix="weights-http"
        )
        self.set_engines(engines)

    # ---- membership --------------------------------------------------------------------------
    def set_engines(self, engines: list[EngineEndpoint]) -> None:
        """The engines to sync from now on (a joining node gets a full sync at the next ``sync``)."""
        wanted = {e.url: e for e in engines}
        removed = [url for url in self._clients if url not in wanted]
        if any(url in self._group_engines for url in removed):
            # while their clients remain: the engines that leave drop the group too (and the plan recorded
            # for it), instead of keeping them for good; the next sync builds a new group anyway
            self._destroy_group()
        for url in removed:
            self._clients.pop(url).close()
        for url, e in wanted.items():
            if url not in self._clients:
                self._clients[url] = EngineWeightsClient(e, self.config.timeout_s)

    @property
    def engines(self) -> list[str]:
        return list(self._clients)

    def _drop(self, url: str, report: SyncReport) -> None:
        client = self._clients.pop(url, None)
        if client is not None:
            client.close()
            report.dropped.append(url)

    def close(self) -> None:
        self._staging = [None, None]
        self._raw_distinct = None
        self._plan = SyncPlan()  # its recipes keep views of the staging buffers
        self._destroy_group()
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- group -------------------------------------------------------------------------------
    def _destroy_group(self) -> None:
        self._replayable = None
        if self._group is None:
            return
        name = self._group.name
        futures = [
            self._pool.submit(self._clients[u].destroy_group, name)
            for u in self._group_engines
            if u in self._clients
        ]
        # ours while theirs run: NCCL's communicator teardown on an engine waits for this side's
        self._group.destroy()
        for f in futures:
            with contextlib.suppress(Exception):
                f.result(timeout=self.config.timeout_s)
        self._group, self._group_engines = None, []
        self._ordered = self._segmented = False
        self._declared = {}

    def _connect(self, report: SyncReport) -> None:
        """(Re)build the weight-update group over the engines that answer."""
        self._destroy_group()
        for url in self._unhealthy(list(self._clients)):
            self._drop(url, report)
        urls = list(self._clients)
        if not urls:
            return
        world = 1 + sum(self._clients[u].endpoint.ranks for u in urls)
        name = f"tidal-weights-pp{self.stage}-{next(self._generation)}"
        port = (
            self.config.master_port + self.stage
            if self.config.master_port
            else free_port(self.master_address)
        )
        offsets = list(itertools.accumulate([1] + [self._clients[u].endpoint.ranks for u in urls]))[:-1]
        futures = {
            u: self._pool.submit(
                self._clients[u].init_group,
                master_address=self.master_address,
                master_port=port,
                rank_offset=off,
                world_size=world,
                group_name=name,
                backend=self.backend,
            )
            for u, off in zip(urls, offsets, strict=True)
        }
        try:
            group = transport.create_group(
                master_address=self.master_address,
                master_port=port,
                rank=0,
                world_size=world,
                group_name=name,
                backend=self.backend,
                timeout_s=self.config.timeout_s,
            )  # returns once every engine rank has connected (gloo connects the full mesh)
        except Exception as exc:
            failed = settle(futures, self.config.timeout_s)
            for u in failed or urls:
                self._drop(u, report)
            raise SyncFailed(f"weight-update group {name} could not be formed: {exc}") from exc
        failed = settle(futures, self.config.timeout_s)
        self._group, self._group_engines = group, urls
        declared = [f.result() for f in futures.values()] if not failed else []
        self._declared = {u: f.result() for u, f in futures.items()} if not failed else {}
        self._ordered = bool(declared) and all("ordered_buckets" in d for d in declared)
        self._segmented = self._ordered and all("bucket_segments" in d for d in declared)
        self._seq = itertools.count()  # bucket_seq restarts with each group
        if failed:
            for u in failed:
                self._drop(u, report)
            raise SyncFailed(f"engines {failed} did not join {name}")

    # ---- sync --------------------------------------------------------------------------------
    def sync(self, source: TensorSource, version: int, retries: int | None = None) -> SyncReport:
        """Send the weights of ``version``; collective over all trainer ranks. ``source()`` makes the iterator."""
        report = SyncReport(version=version)
        t0 = time.perf_counter()
        retries = self.config.retries if retries is None else retries
        failures, refusal_retried = 0, False
        while failures <= retries:
            report.attempts += 1
            failed = refused = False
            try:
                self._attempt(source(), version, report)
            except ReplayRefused:
                failed = refused = True
            except SyncFailed:
                failed = True
            if not self._any_failed(failed):
                report.ok = True
                break
            report.ok = False
            if self.is_sender:
                self._destroy_group()  # rebuilt without the dropped engines on the next attempt
            # an engine without the recorded update (restarted, say) refused to replay it: the next
            # attempt announces it and is not counted against the retries (once per sync)
            if not refusal_retried and self._any_failed(refused):
                refusal_retried = True
                continue
            failures += 1
        report.wall_s = time.perf_counter() - t0
        report.engines = self.engines
        return report

    def _attempt(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int, report: SyncReport) -> None:
        failure: SyncFailed | None = None
        report.replayed = False
        if self.is_sender and self._clients and (self._group is None or self._group_engines != self.engines):
            try:
                self._connect(report)
            except SyncFailed as exc:
                failure = exc
        # a replay is asked for now and answered while the first bucket is gathered and packed
        replaying = failure is None and self._replay_ready()
        asked = self._ask_replay(version) if replaying else None
        opening: update_calls.Calls | None = None
        if self.coordinator and failure is None and not replaying:
            opening = self._start_on_all("begin")
            if self.stages > 1:  # the other stages' senders announce once past the barrier: open first
                failure, opening = self._settle_calls(opening, report), None
        self._barrier()
        if asked is not None:
            failure = self._replay_stream(tensors, version, report, asked)
        elif self.is_sender and failure is None and self._group is not None:
            failure = self._stream(tensors, version, report, opening)
        else:
            if opening is not None:
                failure = self._settle_calls(opening, report)
            drain(tensors)
        self._barrier()
        if self.coordinator and not replaying:
            failure = failure or self._settle_calls(self._start_on_all("end"), report)
        if failure is not None:
            self._replayable = None
            raise failure
        if not replaying:
            self._record_replayable(report)

    def _start_on_all(self, what: str) -> update_calls.Calls:
        """Open (``begin``) or close (``end``) the update on every engine (``update_calls``)."""
        return update_calls.start(what, self._clients, self._declared, self.pause_mode, self._pool)

    def _settle_calls(self, calls: update_calls.Calls, report: SyncReport) -> SyncFailed | None:
        """Wait for ``calls``; drops the engines where one failed (or timed out)."""
        failed = settle(calls.futures, self.config.timeout_s)
        elapsed = max(calls.ended, calls.started) - calls.started
        if calls.what == "begin":
            report.open_s += elapsed
        else:
            report.close_s += elapsed
        for u in failed:
            self._drop(u, report)
        return SyncFailed(f"{calls.what}_weight_update failed on {failed}") if failed else None

    def _stream(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        report: SyncReport,
        opening: update_calls.Calls | None = None,
        replaying: bool = False,
        gate: Callable[[], SyncFailed | None] | None = None,
    ) -> SyncFailed | None:
        """Pack buckets here, broadcast them from a second thread; two staging buffers alternate.

        ``opening``: the update's opening calls, still in flight: the first bucket is gathered and packed
        meanwhile, and announced once they are answered.

        To engines that receive in ``bucket_seq`` order a bucket is announced as soon as it is packed,
        so each engine's handler is waiting in its receive when the broadcast starts, and loads bucket
        k while it receives k+1; the reply of bucket k is awaited only after k+1 went out
        (``inflight_buckets``). Other engines (SGLang) get one announcement at a time.

        ``replaying``: the recorded buckets without announcements (the engines replay them, replay.py).
        ``gate``: called once, on this thread, before the first bucket goes to the send thread (after it
        was packed): a replay's acceptance and header; the stream stops on the failure it returns.
        """
        assert self._group is not None
        group = self._group
        window = report.inflight = self.config.inflight_buckets if self._ordered else 1
        cuda = self.device.type == "cuda"
        # (staging buffer, CUDA event after which it is free again): kept across syncs, allocated on first
        # use, grown for an oversized bucket
        free: queue.Queue[tuple[torch.Tensor | None, torch.cuda.Event | None]] = queue.Queue()
        for staging in self._staging:
            free.put((staging, None))
        # one bucket waits for the send thread, at most: bounds the tensors the gather holds ahead (a bucket
        # that packs nothing takes no staging buffer, so the two buffers alone would not)
        ready: queue.Queue = queue.Queue(maxsize=1)
        errors: list[SyncFailed] = []
        announce = not replaying
        sender = threading.Thread(
            target=self._send_loop,
            args=(group, ready, free, window, version, report, errors, announce),
            daemon=True,
        )
        sender.start()
        first_bytes, bucket_bytes, own_bytes, max_bytes, grouped = self._bucketing()
        if grouped:  # megatron's fused QKV goes whole, from the trainer's memory (grouped_qkv.py)
            tensors = grouped_qkv.fuse(tensors)

        def stream(items):
            if own_bytes is None:
                return bucket.stream_buckets(items, bucket_bytes, first_bytes)
            # tensors sent from their own memory count only against the bucket's size in all
            return bucket.stream_buckets(
                items,
                bucket_bytes,
                first_bytes,
                packed=lambda t: (
                    not (
                        isinstance(t, torch.Tensor) and t.is_contiguous() and segments.nbytes(t) >= own_bytes
                    )
                ),
                max_bytes=max_bytes,
            )

        # the first sync plans its buckets and records them; later ones replay the record
        buckets = self._plan.buckets(tensors, self._bucketing(), stream, own_bytes, strict=replaying)
        it = iter(buckets)

        def opened() -> bool:
            """Whether the update is open on the engines (waits for the opening calls or the gate, once)."""
            nonlocal opening, gate
            if opening is not None:
                failure, opening = self._settle_calls(opening, report), None
                if failure is not None:
                    errors.append(failure)
            if gate is not None:
                failure, gate = gate(), None
                if failure is not None:
                    errors.append(failure)
            return not errors

        try:
            for items, recipe, spans in it:
                if errors:
                    break
                t0 = time.perf_counter()
                announced = None
                early = opening is None or opening.done()  # else: pack while the update opens
                if announce and window > 1 and not self.config.verify_checksums and early:
                    # announced before packing: the engines post their receives meanwhile, so the
                    # broadcast finds them ready (a checksum can only be announced once packed)
                    if not opened():
                        break
                    announced = self._announce(group, recipe.announcement, None, version)
                report.pack_s += time.perf_counter() - t0
                need = recipe.need if spans is not None else recipe.spec.nbytes
                # a bucket with nothing to pack takes no staging buffer: the next one's pack need not wait
                taken = need > 0
                staging = None
                if taken:
                    staging, sent = free.get()
                    if sent is not None:  # its broadcast ran on the send stream
                        torch.cuda.current_stream(self.device).wait_event(sent)
                    if staging is None or staging.numel() < need:
                        staging = torch.empty(max(need, bucket_bytes), dtype=torch.uint8, device=self.device)
                t0 = time.perf_counter()
                if spans is None:  # replaying a bucket whose tensors moved: the recorded broadcasts, packed
                    payload = recipe.payload_packed(items, staging)
                else:
                    payload = recipe.payload(items, spans, staging)  # the bucket's broadcasts, in order
                crc = bucket.checksum(payload) if self.config.verify_checksums else None
                packed = None
                if cuda:
                    packed = torch.cuda.Event()
                    packed.record(torch.cuda.current_stream(self.device))
                report.pack_s += time.perf_counter() - t0
                if not opened():
                    if taken:
                        free.put((staging, None))
                    break
                if announce and window > 1 and announced is None:
                    announced = self._announce(group, recipe.announcement, crc, version)
                _hand_over(
                    ready, (taken, staging, payload, recipe.announcement, crc, announced, packed), sender
                )
        except PlanDiverged as exc:
            errors.append(SyncFailed(f"replayed update: {exc}"))
            drain(tensors)  # the rest of the source, for the other ranks' collectives
        finally:
            _hand_over(ready, None, sender)
            sender.join()
            opened()  # nothing to send (or a failure): the opening calls still finish
            self._staging = [free.get()[0] for _ in range(2)]
            if cuda:
                torch.cuda.synchronize(self.device)
        drain(it)  # after a failure: keep gathering so the other ranks' collectives complete
        return errors[0] if errors else None

    def _announce(
        self, group, announcement: Announcement, crc: int | None, version: int
    ) -> dict[str, Future]:
        """POST the bucket's ``/update_weights_from_distributed`` to every engine (replies come after its load)."""
        seq = next(self._seq) if self._ordered else None
        clients = {u: self._clients.get(u) for u in self._group_engines}  # one may be dropped meanwhile
        return {
            u: self._pool.submit(
                client.announce,
                announcement,
                group_name=group.name,
                weight_version=str(version),
                flush_cache=True,
                checksum=crc,
                seq=seq,
            )
            for u, client in clients.items()
            if client is not None
        }

    def _send_loop(
        self, group, ready, free, window: int, version: int, report: SyncReport, errors, announce: bool = True
    ) -> None:
        replies: collections.deque[dict[str, Future]] = collections.deque()  # broadcast, not yet answered
        stream = None
        if self.device.type == "cuda":
            # a stream of its own: packing the next bucket (current stream) does not queue behind a send
            torch.cuda.set_device(self.device)  # the current device is per thread
            stream = torch.cuda.Stream(self.device)
        while (item := ready.get()) is not None:
            taken, staging, payload, announcement, crc, announced, packed = item
            sent = None
            nbytes = sum(part.numel() for part in payload)
            if not errors:
                t0 = time.perf_counter()
                try:
                    if announced is None and announce:
                        announced = self._announce(group, announcement, crc, version)
                    if stream is not None:
                        stream.wait_event(packed)
                        for part in payload:
                            # a tensor sent from its own memory may be freed (a gathered temporary) while
                            # this stream still reads it: the caching allocator must wait for the stream
                            part.record_stream(stream)
                    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                        self._broadcast(group, payload, report)
                    if stream is not None:
                        sent = torch.cuda.Event()
                        sent.record(stream)
                    if announced is not None:
                        replies.append(announced)
                    while len(replies) >= window:
                        self._settle_bucket(replies.popleft(), report)
                except SyncFailed as exc:
                    errors.append(exc)
                report.transfer_s += time.perf_counter() - t0
                report.buckets += 1
                report.bytes += nbytes
                report.bucket_sizes.append(nbytes)
            if taken:
                free.put((staging, sent))
        t0 = time.perf_counter()
        try:
            while replies and not errors:
                self._settle_bucket(replies.popleft(), report)
        except SyncFailed as exc:
            errors.append(exc)
        report.transfer_s += time.perf_counter() - t0

    def _broadcast(self, group, payload: list[torch.Tensor], report: SyncReport) -> None:
        """A bucket's broadcasts, all started before the first is waited for: the engines start their
        receives likewise, so one broadcast's bytes follow the previous one's without a round trip
        through either side's Python in between."""
        try:
            works = [group.broadcast_async(part, src=0) for part in payload]
            for work in works:
                work.wait()
        except Exception as exc:
            # a peer is gone; the live engines still answer /health while their receive is stuck
            dead = self._unhealthy(self._group_engines) or list(self._group_engines)
            for u in dead:
                self._drop(u, report)
            nbytes = sum(part.numel() for part in payload)
            raise SyncFailed(f"broadcast of a {nbytes}-byte bucket failed ({exc}); dropped {dead}") from exc

    def _settle_bucket(self, futures: dict[str, Future], report: SyncReport) -> None:
        failed = settle(futures, self.config.timeout_s)
        if failed:
            for u in failed:
                self._drop(u, report)
            raise SyncFailed(f"engines {failed} failed to load a bucket")

    def _unhealthy(self, urls: list[str]) -> list[str]:
        futures = {u: self._pool.submit(self._clients[u].health) for u in urls if u in self._clients}
        return settle(futures, self.config.timeout_s)


def raw_broadcast(sender: WeightSender, sizes: list[int], distinct: bool = False) -> float:
    """Seconds to broadcast plain buffers of ``sizes`` bytes over the sender's current group: the
    transport's ceiling for the benchmark. Engines must serve ``/tidal/raw_receive`` (receiver_server).

    Both sides reuse one buffer of the largest size (a cache-warm ceiling), or with ``distinct`` each
    broadcast has its own part of a buffer of their sum on both sides, as a sync's bytes go from the
    trainer's parameters into the engine's weights (buffers kept for the next call).

    The transfers sit between two group barriers, which on CUDA also wait for the kernels, so the
    time covers the bytes' arrival on every engine, as a sync's does (its replies follow the loads).
    """
    group = sender._group
    if group is None:
        raise RuntimeError("no weight-update group: run a sync first")
    if distinct:
        buf = sender._raw_distinct
        if buf is None or buf.numel() < sum(sizes):
            sender._raw_distinct = None  # the old one freed first
            buf = sender._raw_distinct = torch.ones(sum(sizes), dtype=torch.uint8, device=sender.device)
    else:
        buf = sender._staging[0]  # the sync's staging buffer, reused for every broadcast
        if buf is None or buf.numel() < max(sizes):
            buf = sender._staging[0] = torch.ones(max(sizes), dtype=torch.uint8, device=sender.device)
    if sender.device.type == "cuda":
        torch.cuda.synchronize(sender.device)
    t0 = time.perf_counter()
    futures = {
        u: sender._pool.submit(
            sender._clients[u]._post,
            "/tidal/raw_receive",
            {"sizes": sizes, "group_name": group.name, "distinct": distinct},
        )
        for u in sender._group_engines
    }
    group.barrier()
    offset = 0
    for n in sizes:
        group.broadcast(buf[offset : offset + n], src=0)
        offset += n if distinct else 0
    group.barrier()
    failed = settle(futures, sender.config.timeout_s)
    if failed:
        raise RuntimeError(f"raw receive failed on {failed}")
    return time.perf_counter() - t0


def _hand_over(ready: queue.Queue, item, sender: threading.Thread) -> None:
    """Put ``item`` for the send thread, unless it is gone (a bug: it only stops at the final None)."""
    while True:
        try:
            ready.put(item, timeout=1.0)
            return
        except queue.Full:
            if not sender.is_alive():
                raise RuntimeError("the weight-sync send thread died; see its traceback above") from None


def _default_barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _default_any_failed(failed: bool) -> bool:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([1 if failed else 0], dtype=torch.int32)
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
    return failed
