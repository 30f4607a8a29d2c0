"""Colocated weight sync, trainer side: buckets packed on the GPU, passed to engines on that GPU by CUDA IPC.

When the trainer and its engines share a GPU (as slime and verl colocate them), no collective is needed:
each bucket is packed into one of two device staging buffers, pickled with ``ForkingPickler`` (so its
storage travels as a CUDA IPC handle, a few hundred bytes) and posted to SGLang's
``/update_weights_from_tensor`` with ``load_format="flattened_bucket"``; the engine maps the buffer,
copies it into its weights and replies, after which the buffer is free again. The next bucket is packed
into the other buffer while the engine loads the current one. The payload uses only what SGLang's
``SafeUnpickler`` admits (metadata entries are ``types.SimpleNamespace`` with the fields of SGLang's
``FlattenedTensorMetadata``), so the same sender serves SGLang engines.

Sleep / wake: around trainer steps the engines can give their memory back (``sleep``: pause with
``mode='retract'``, ``/release_memory_occupation``) and retake it before the next weights arrive
(``/resume_memory_occupation``).
"""

from __future__ import annotations

import base64
import contextlib
import io
import itertools
import time
import types
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.reduction import ForkingPickler
from typing import Any

import httpx
import torch
import torch.multiprocessing  # noqa: F401 - registers torch's reductions (CUDA IPC handles) with ForkingPickler

from tidal.weights_sync import bucket
from tidal.weights_sync.config import WeightSyncConfig
from tidal.weights_sync.engine_api import EngineEndpoint, EngineError, EngineWeightsClient
from tidal.weights_sync.sender import _default_any_failed, _default_barrier
from tidal.weights_sync.sync_report import SyncReport, drain, settle

TensorSource = Callable[[], Iterable[tuple[str, torch.Tensor]]]
# one bucket's bytes when the config leaves it open: large buckets mean few HTTP round trips and IPC opens
DEFAULT_IPC_BUCKET_BYTES = 1 << 30


def gpu_uuid(device: torch.device | int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def serialize_bucket(buf: torch.Tensor, spec: bucket.BucketSpec) -> str:
    """A flattened bucket as one ``serialized_named_tensors`` entry (base64 of a ForkingPickler pickle)."""
    metadata, offset = [], 0
    for name, dtype_name, shape in zip(spec.names, spec.dtypes, spec.shapes, strict=True):
        dtype = bucket._dtype(dtype_name)
        nbytes = bucket._numel(shape) * dtype.itemsize
        metadata.append(
            types.SimpleNamespace(
                name=name,
                shape=torch.Size(shape),
                dtype=dtype,
                start_idx=offset,
                end_idx=offset + nbytes,
                numel=nbytes,
            )
        )
        offset += nbytes
    out = io.BytesIO()
    ForkingPickler(out).dump({"flattened_tensor": buf, "metadata": metadata})
    return base64.b64encode(out.getvalue()).decode("ascii")


class ColocatedClient:
    """The routes colocated sync uses beyond the collective ones (SGLang's shapes)."""

    def __init__(self, endpoint: EngineEndpoint, timeout_s: float):
        self.endpoint = endpoint
        self.weights = EngineWeightsClient(endpoint, timeout_s)
        self._http = httpx.Client(base_url=endpoint.url.rstrip("/"), timeout=timeout_s)

    def close(self) -> None:
        self.weights.close()
        self._http.close()

    def _post(self, route: str, body: dict[str, Any]) -> None:
        try:
            resp = self._http.post(route, json=body)
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.endpoint.url}{route}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise EngineError(f"{self.endpoint.url}{route}: HTTP {resp.status_code}: {resp.text[:300]}")

    def update_from_tensor(self, payload: str, *, weight_version: str | None, flush_cache: bool) -> None:
        self._post(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": [payload],
                "load_format": "flattened_bucket",
                "flush_cache": flush_cache,
                "weight_version": weight_version,
            },
        )

    def release(self, tags: list[str] | None) -> None:
        self._post("/release_memory_occupation", {"tags": tags})

    def resume(self, tags: list[str] | None) -> None:
        self._post("/resume_memory_occupation", {"tags": tags})

    def gpu(self) -> str | None:
        """The engine's GPU UUID as its /server_info reports it (None: not reported, or on CPU)."""
        try:
            resp = self._http.get("/server_info")
            resp.raise_for_status()
            return resp.json().get("gpu_uuid")
        except (httpx.HTTPError, ValueError):
            return None


def resolve_transport(config: WeightSyncConfig, engines: list[EngineEndpoint], device: torch.device) -> str:
    """'cuda_ipc' or 'collective' for this sender: 'auto' picks cuda_ipc when every engine is on our GPU."""
    if config.transport != "auto":
        return config.transport
    if device.type != "cuda" or not engines:
        return "collective"
    mine = gpu_uuid(device)
    for e in engines:
        client = ColocatedClient(e, min(config.timeout_s, 10.0))
        try:
            if client.gpu() != mine:
                return "collective"
        finally:
            client.close()
    return "cuda_ipc"


class ColocatedSender:
    """One trainer rank's part in colocated syncs; the interface of :class:`WeightSender`.

    ``is_sender``: this rank sends its pipeline stage; ``coordinator``: it opens and closes the update
    and puts the engines to sleep and wakes them (the first stage's sender).
    """

    def __init__(
        self,
        config: WeightSyncConfig,
        engines: list[EngineEndpoint],
        *,
        device: torch.device | str,
        stage: int = 0,
        is_sender: bool = True,
        coordinator: bool | None = None,
        barrier: Callable[[], None] | None = None,
        any_failed: Callable[[bool], bool] | None = None,
    ):
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(
                f"weights_sync.transport='cuda_ipc' passes CUDA IPC handles: the trainer runs on {self.device}; "
                "use transport='collective' (or 'auto')"
            )
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.config = config
        self.stage = stage
        self.is_sender = is_sender
        self.coordinator = is_sender and stage == 0 if coordinator is None else coordinator
        self._barrier = barrier or _default_barrier
        self._any_failed = any_failed or _default_any_failed
        self._clients: dict[str, ColocatedClient] = {}
        self._staging: list[torch.Tensor | None] = [None, None]
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(engines)), thread_name_prefix="colocated")
        self.asleep: set[str] = set()  # engines whose memory is released
        self.set_engines(engines)

    @property
    def engines(self) -> list[str]:
        return list(self._clients)

    def set_engines(self, engines: list[EngineEndpoint]) -> None:
        wanted = {e.url: e for e in engines}
        for url in list(self._clients):
            if url not in wanted:
                self._clients.pop(url).close()
                self.asleep.discard(url)
        for url, e in wanted.items():
            if url not in self._clients:
                self._clients[url] = ColocatedClient(e, self.config.timeout_s)

    def _drop(self, url: str, report: SyncReport) -> None:
        client = self._clients.pop(url, None)
        self.asleep.discard(url)
        if client is not None:
            client.close()
            report.dropped.append(url)

    def close(self) -> None:
        self._staging = [None, None]
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- sleep / wake ----------------------------------------------------------------------------
    def _on_all(self, fn: Callable[[ColocatedClient], None], urls: list[str] | None = None) -> list[str]:
        urls = list(self._clients) if urls is None else urls
        futures = {u: self._pool.submit(fn, self._clients[u]) for u in urls}
        return settle(futures, self.config.timeout_s)

    def sleep(self) -> list[str]:
        """Retract the engines' requests and release their memory (coordinator only); the failed engines."""
        if not self.coordinator:
            return []
        tags = list(self.config.colocated_sleep_tags)

        def go(client: ColocatedClient) -> None:
            client.weights.pause("retract")
            client.release(tags)

        awake = [u for u in self._clients if u not in self.asleep]
        failed = self._on_all(go, awake) if awake else []
        self.asleep.update(u for u in awake if u not in failed)
        return failed

    def _resume_memory(self) -> list[str]:
        asleep = [u for u in self.asleep if u in self._clients]
        failed = self._on_all(lambda c: c.resume(None), asleep) if asleep else []
        self.asleep.clear()
        return failed

    def wake(self) -> list[str]:
        """Retake the engines' memory and let them generate again (when no sync follows)."""
        if not self.coordinator:
            return []
        asleep = [u for u in self.asleep if u in self._clients]
        failed = self._resume_memory()
        if asleep:
            failed += self._on_all(lambda c: c.weights.resume(), [u for u in asleep if u not in failed])
        return failed

    # ---- sync ------------------------------------------------------------------------------------
    def sync(self, source: TensorSource, version: int, retries: int | None = None) -> SyncReport:  # noqa: ARG002
        """Send the weights of ``version``; collective over all trainer ranks (they gather together)."""
        report = SyncReport(version=version, attempts=1, inflight=1)
        t0 = time.perf_counter()
        failed: list[str] = []
        pause = self.config.pause_mode
        was_asleep = bool(self.asleep)  # asleep engines were paused (retract) by sleep()
        if self.coordinator and self._clients:
            failed += self._resume_memory()  # the weights must be resident before they are written

            def begin(client: ColocatedClient) -> None:
                if pause:
                    client.weights.pause(pause)
                client.weights.begin()

            failed += self._on_all(begin, [u for u in self._clients if u not in failed])
            for u in failed:
                self._drop(u, report)
        self._barrier()
        tensors = source()
        if self.is_sender and self._clients:
            failed = self._stream(tensors, version, report)
            for u in failed:
                self._drop(u, report)
        else:
            drain(tensors)
        self._barrier()
        if self.coordinator and self._clients:

            def end(client: ColocatedClient) -> None:
                client.weights.end()
                if pause or was_asleep:
                    client.weights.resume()

            for u in self._on_all(end):
                self._drop(u, report)
        report.ok = not self._any_failed(bool(report.dropped))
        report.wall_s = time.perf_counter() - t0
        report.engines = self.engines
        return report

    def _stream(
        self, tensors: Iterable[tuple[str, torch.Tensor]], version: int, report: SyncReport
    ) -> list[str]:
        """Pack bucket k+1 into one staging buffer while the engines load bucket k from the other.

        ``report.pack_s``: packing (until its kernels finish); ``report.transfer_s``: this thread's time
        pickling handles and waiting for replies (what the engines' loads do not hide behind packing).
        """
        bucket_bytes = self.config.bucket_bytes or DEFAULT_IPC_BUCKET_BYTES
        first = min(self.config.first_bucket_bytes or max(1, bucket_bytes // 8), bucket_bytes)
        failed: list[str] = []
        pending: dict[str, Future] | None = None
        it = iter(bucket.stream_buckets(tensors, bucket_bytes, first))
        slots = itertools.cycle(range(2))
        try:
            for items in it:
                slot = next(slots)
                t0 = time.perf_counter()
                need = sum(t.numel() * t.element_size() for _, t in items)
                staging = self._staging[slot]
                if staging is None or staging.numel() < need:
                    self._staging[slot] = None  # free the old one before allocating a larger one
                    size = max(need, bucket_bytes) if report.buckets else need  # the first bucket is small
                    staging = self._staging[slot] = torch.empty(size, dtype=torch.uint8, device=self.device)
                buf, spec = bucket.pack(items, out=staging)
                # torch records the IPC event only when a storage is first shared: later buckets in the same
                # buffer must be complete before the engine is told about them
                torch.cuda.current_stream(self.device).synchronize()
                report.pack_s += time.perf_counter() - t0
                t0 = time.perf_counter()
                if pending is not None:  # the other buffer's bucket: its reply frees that buffer
                    failed += settle(pending, self.config.timeout_s)
                urls = [u for u in self._clients if u not in failed]
                if not urls:
                    break
                # one pickle per engine: each opens the handle once, which torch's IPC refcounting expects
                pending = {
                    u: self._pool.submit(
                        self._clients[u].update_from_tensor,
                        serialize_bucket(buf, spec),
                        weight_version=str(version),
                        flush_cache=True,
                    )
                    for u in urls
                }
                report.transfer_s += time.perf_counter() - t0
                report.buckets += 1
                report.bytes += buf.numel()
                report.bucket_sizes.append(buf.numel())
            if pending is not None:
                t0 = time.perf_counter()
                failed += settle(pending, self.config.timeout_s)
                report.transfer_s += time.perf_counter() - t0
        finally:
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(self.device)
        drain(it)  # after a failure: keep gathering so the other ranks' collectives complete
        return sorted(set(failed))
