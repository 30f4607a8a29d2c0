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

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tidal.procs import free_port
from tidal.weights_sync import bucket, transport
from tidal.weights_sync.config import WeightSyncConfig
from tidal.weights_sync.engine_api import EngineEndpoint, EngineError, EngineWeightsClient

TensorSource = Callable[[], Iterable[tuple[str, torch.Tensor]]]


@dataclass
class SyncReport:
    version: int
    ok: bool = True
    attempts: int = 0
    buckets: int = 0
    bytes: int = 0
    pack_s: float = 0.0
    transfer_s: float = 0.0
    wall_s: float = 0.0
    dropped: list[str] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes / self.wall_s / 1e9 if self.wall_s else 0.0


class _Failed(Exception):
    """An engine failed during this attempt (already dropped)."""


class WeightSender:
    """One trainer rank's part in weight syncs to a set of engines.

    ``is_sender``: this rank sends its pipeline stage (tensor-, context- and data-parallel rank 0);
    ``coordinator``: this rank opens and closes the update on the engines (the first stage's sender).
    ``barrier`` / ``any_failed`` synchronise all trainer ranks (defaults: torch.distributed's default
    group when initialised, else single-process no-ops).
    """

    def __init__(
        self,
        config: WeightSyncConfig,
        engines: list[EngineEndpoint],
        *,
        stage: int = 0,
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
        self.is_sender = is_sender
        self.coordinator = is_sender and stage == 0 if coordinator is None else coordinator
        self.backend = backend
        self.master_address = master_address
        self.device = torch.device(device)
        self.pause_mode = config.pause_mode
        self._barrier = barrier or _default_barrier
        self._any_failed = any_failed or _default_any_failed
        self._clients: dict[str, EngineWeightsClient] = {}
        self._group: transport.WeightGroup | None = None
        self._group_engines: list[str] = []
        self._generation = itertools.count()
        self._staging: list[torch.Tensor | None] = [None, None]
        # announcements to engines stuck in a receive may hold a worker until they time out
        self._pool = ThreadPoolExecutor(
            max_workers=max(16, 4 * len(engines)), thread_name_prefix="weights-http"
        )
        self.set_engines(engines)

    # ---- membership --------------------------------------------------------------------------
    def set_engines(self, engines: list[EngineEndpoint]) -> None:
        """The engines to sync from now on (a joining node gets a full sync at the next ``sync``)."""
        wanted = {e.url: e for e in engines}
        for url in list(self._clients):
            if url not in wanted:
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
        self._destroy_group()
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- group -------------------------------------------------------------------------------
    def _destroy_group(self) -> None:
        if self._group is None:
            return
        name = self._group.name
        futures = [
            self._pool.submit(self._clients[u].destroy_group, name)
            for u in self._group_engines
            if u in self._clients
        ]
        for f in futures:
            with contextlib.suppress(Exception):
                f.result(timeout=self.config.timeout_s)
        self._group.destroy()
        self._group, self._group_engines = None, []

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
            failed = _settle(futures, self.config.timeout_s)
            for u in failed or urls:
                self._drop(u, report)
            raise _Failed(f"weight-update group {name} could not be formed: {exc}") from exc
        failed = _settle(futures, self.config.timeout_s)
        self._group, self._group_engines = group, urls
        if failed:
            for u in failed:
                self._drop(u, report)
            raise _Failed(f"engines {failed} did not join {name}")

    # ---- sync --------------------------------------------------------------------------------
    def sync(self, source: TensorSource, version: int, retries: int | None = None) -> SyncReport:
        """Send the weights of ``version``; collective over all trainer ranks. ``source()`` makes the iterator."""
        report = SyncReport(version=version)
        t0 = time.perf_counter()
        retries = self.config.retries if retries is None else retries
        for attempt in range(1 + retries):
            report.attempts = attempt + 1
            failed = False
            try:
                self._attempt(source(), version, report)
            except _Failed:
                failed = True
            if not self._any_failed(failed):
                report.ok = True
                break
            report.ok = False
            if self.is_sender:
                self._destroy_group()  # rebuilt without the dropped engines on the next attempt
        report.wall_s = time.perf_counter() - t0
        report.engines = self.engines
        return report

    def _attempt(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int, report: SyncReport) -> None:
        failure: _Failed | None = None
        if self.is_sender and self._clients and (self._group is None or self._group_engines != self.engines):
            try:
                self._connect(report)
            except _Failed as exc:
                failure = exc
        if self.coordinator and failure is None:
            failure = self._on_all(report, "begin", self.pause_mode)
        self._barrier()
        if self.is_sender and failure is None and self._group is not None:
            failure = self._stream(tensors, version, report)
        else:
            _drain(tensors)
        self._barrier()
        if self.coordinator:
            failure = failure or self._on_all(report, "end", self.pause_mode)
        if failure is not None:
            raise failure

    def _on_all(self, report: SyncReport, what: str, pause_mode: str | None) -> _Failed | None:
        def call(client: EngineWeightsClient) -> None:
            if what == "begin":
                if pause_mode:
                    client.pause(pause_mode)
                client.begin()
            else:
                client.end()
                if pause_mode:
                    client.resume()

        futures = {u: self._pool.submit(call, c) for u, c in self._clients.items()}
        failed = _settle(futures, self.config.timeout_s)
        for u in failed:
            self._drop(u, report)
        return _Failed(f"{what}_weight_update failed on {failed}") if failed else None

    def _stream(
        self, tensors: Iterable[tuple[str, torch.Tensor]], version: int, report: SyncReport
    ) -> _Failed | None:
        """Pack buckets here, send them from a second thread; two staging buffers alternate."""
        free: queue.Queue[torch.Tensor | None] = queue.Queue()
        for staging in self._staging:
            free.put(staging)  # kept across syncs; allocated on first use, grown for an oversized tensor
        ready: queue.Queue = queue.Queue()
        errors: list[_Failed] = []
        sender = threading.Thread(
            target=self._send_loop, args=(ready, free, version, report, errors), daemon=True
        )
        sender.start()
        it = iter(bucket.stream_buckets(tensors, self.config.bucket_bytes))
        try:
            for items in it:
                if errors:
                    break
                staging = free.get()
                t0 = time.perf_counter()
                need = sum(t.numel() * t.element_size() for _, t in items)
                if staging is None or staging.numel() < need:
                    staging = torch.empty(need, dtype=torch.uint8, device=self.device)
                buf, spec = bucket.pack(items, out=staging)
                crc = bucket.checksum(buf) if self.config.verify_checksums else None
                report.pack_s += time.perf_counter() - t0
                ready.put((staging, buf, spec, crc))
        finally:
            ready.put(None)
            sender.join()
            self._staging = [free.get() for _ in range(2)]
        _drain(it)  # after a failure: keep gathering so the other ranks' collectives complete
        return errors[0] if errors else None

    def _send_loop(self, ready, free, version: int, report: SyncReport, errors: list[_Failed]) -> None:
        group = self._group
        assert group is not None
        while (item := ready.get()) is not None:
            staging, buf, spec, crc = item
            if not errors:
                t0 = time.perf_counter()
                try:
                    self._send_bucket(group, buf, spec, crc, version, report)
                except _Failed as exc:
                    errors.append(exc)
                report.transfer_s += time.perf_counter() - t0
                report.buckets += 1
                report.bytes += buf.numel()
            free.put(staging)

    def _send_bucket(
        self, group, buf, spec: bucket.BucketSpec, crc: int | None, version: int, report
    ) -> None:
        futures: dict[str, Future] = {
            u: self._pool.submit(
                self._clients[u].update_bucket,
                names=spec.names,
                dtypes=spec.dtypes,
                shapes=spec.shapes,
                group_name=group.name,
                weight_version=str(version),
                flush_cache=True,
                checksum=crc,
            )
            for u in self._group_engines
        }
        try:
            group.broadcast(buf, src=0)
        except Exception as exc:
            # a peer is gone; the live engines still answer /health while their receive is stuck
            dead = self._unhealthy(self._group_engines) or list(self._group_engines)
            for u in dead:
                self._drop(u, report)
            raise _Failed(f"broadcast of a {buf.numel()}-byte bucket failed ({exc}); dropped {dead}") from exc
        failed = _settle(futures, self.config.timeout_s)
        if failed:
            for u in failed:
                self._drop(u, report)
            raise _Failed(f"engines {failed} failed to load a bucket")

    def _unhealthy(self, urls: list[str]) -> list[str]:
        futures = {u: self._pool.submit(self._clients[u].health) for u in urls if u in self._clients}
        return _settle(futures, self.config.timeout_s)


def raw_broadcast(sender: WeightSender, sizes: list[int]) -> float:
    """Seconds to broadcast plain buffers of ``sizes`` bytes over the sender's current group: the
    transport's ceiling for the benchmark. Engines must serve ``/tidal/raw_receive`` (receiver_server)."""
    group = sender._group
    if group is None:
        raise RuntimeError("no weight-update group: run a sync first")
    buf = sender._staging[0]  # the sync's own staging buffer: both sides reuse memory, as a sync does
    if buf is None or buf.numel() < max(sizes):
        buf = sender._staging[0] = torch.ones(max(sizes), dtype=torch.uint8, device=sender.device)
    t0 = time.perf_counter()
    futures = {
        u: sender._pool.submit(
            sender._clients[u]._post, "/tidal/raw_receive", {"sizes": sizes, "group_name": group.name}
        )
        for u in sender._group_engines
    }
    for n in sizes:
        group.broadcast(buf[:n], src=0)
    failed = _settle(futures, sender.config.timeout_s)
    if failed:
        raise RuntimeError(f"raw receive failed on {failed}")
    return time.perf_counter() - t0


def _failed(future: Future, timeout_s: float) -> bool:
    try:
        future.result(timeout=timeout_s)
    except (EngineError, FutureTimeout):
        return True
    return False


def _settle(futures: dict[str, Future], timeout_s: float) -> list[str]:
    """The engines whose call failed or did not finish within ``timeout_s`` (one deadline for all)."""
    deadline = time.monotonic() + timeout_s
    return [u for u, f in futures.items() if _failed(f, max(0.0, deadline - time.monotonic()))]


def _drain(tensors: Iterable) -> None:
    for _ in tensors:
        pass


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
