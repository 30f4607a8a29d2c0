"""Sleep and wake: the engine gives its device memory back while a colocated trainer steps, and retakes it.

SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation`` with tags ``kv_cache``,
``weights`` and ``cuda_graph`` (none: all three). Memory is freed by shrinking the tensors' storages to
zero bytes (``untyped_storage().resize_(0)``, as FSDP frees unsharded parameters): every tensor object,
and every view of it (fused projections, the lean decoder's references), stays valid, so nothing has to be
rebuilt on wake but the storage itself. Weights are first copied to pinned host memory (allocated once)
and copied back on wake, so a woken engine generates exactly as before; the KV cache is not kept (an idle
engine holds no request). A CUDA graph replays fixed addresses: graphs are dropped with ``cuda_graph``,
and recaptured on wake when they were dropped or when a woken storage came back at another address.

The engine must hold no running request: pause it with ``mode='retract'`` (or ``'abort'``) first. While
any memory is released the scheduler stays paused, and ``/continue_generation`` is refused until wake.
"""

from __future__ import annotations

import torch

from tidal.rollout.embedded.decode_step import DecodeGraphs

TAGS = ("kv_cache", "weights", "cuda_graph")
RELEASED_PAUSE = "released"  # the scheduler's pause state while memory is released


class MemoryStateError(ValueError):
    """A release or resume the engine refuses (HTTP 400 with this message)."""


def check_tags(tags: list[str] | None) -> list[str]:
    if not tags:
        return list(TAGS)
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise MemoryStateError(f"unknown memory tag(s) {bad}: choose from {list(TAGS)} (none: all)")
    return list(dict.fromkeys(tags))


def _unique_storages(tensors) -> list[torch.Tensor]:
    """One tensor per distinct storage (views of one fused matrix share it)."""
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            seen.setdefault(storage.data_ptr(), t)
    return list(seen.values())


class EngineMemory:
    """Release / resume of one engine's weights, KV cache and CUDA graphs; runs on the scheduler thread."""

    def __init__(self, lm: torch.nn.Module, scheduler):
        self.lm = lm
        self.scheduler = scheduler
        self.released: set[str] = set()
        self._pause_before: str | None = None
        # (tensor, bytes) of each storage freed, and the host copy of each weight storage
        self._freed: dict[str, list[tuple[torch.Tensor, int]]] = {}
        self._backup: dict[int, torch.Tensor] = {}
        self._addresses: dict[int, int] = {}
        self._need_capture = False

    @property
    def any_released(self) -> bool:
        return bool(self.released)

    def _graphs(self) -> DecodeGraphs | None:
        step = getattr(self.scheduler, "_lean_step", None)
        return step if isinstance(step, DecodeGraphs) and step.capture else None

    def _kv_tensors(self) -> list[torch.Tensor]:
        pool = self.scheduler.pool
        return _unique_storages([*pool.keys, *pool.values])

    def _weight_tensors(self) -> list[torch.Tensor]:
        return _unique_storages(p for _, p in self.lm.named_parameters(remove_duplicate=False))

    @torch.inference_mode()
    def release(self, tags: list[str] | None) -> dict[str, int]:
        """Free the tagged memory; returns the bytes freed per tag (storages only, before empty_cache)."""
        tags = check_tags(tags)
        sched = self.scheduler
        if sched.running:
            raise MemoryStateError(
                f"release_memory_occupation needs an idle engine; {len(sched.running)} request(s) are "
                "running: /pause_generation with mode='retract' or 'abort' first"
            )
        if not self.released:
            self._pause_before = sched.paused
        sched.paused = sched.paused or RELEASED_PAUSE
        freed: dict[str, int] = {}
        device = sched.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for tag in tags:
            if tag in self.released:
                continue
            if tag == "cuda_graph":
                graphs = self._graphs()
                if graphs is not None:
                    graphs.graphs.clear()  # their private memory pool goes with the last graph
                    self._need_capture = True
                freed[tag] = 0
            else:
                tensors = self._kv_tensors() if tag == "kv_cache" else self._weight_tensors()
                if tag == "weights":
                    self._back_up(tensors)
                entries = []
                for t in tensors:
                    storage = t.untyped_storage()
                    self._addresses[id(t)] = storage.data_ptr()
                    entries.append((t, storage.nbytes()))
                    storage.resize_(0)
                self._freed[tag] = entries
                freed[tag] = sum(n for _, n in entries)
            self.released.add(tag)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        return freed

    def _back_up(self, tensors: list[torch.Tensor]) -> None:
        pin = tensors[0].device.type == "cuda" if tensors else False
        for t in tensors:
            storage = t.untyped_storage()
            host = self._backup.get(id(t))
            if host is None or host.numel() != storage.nbytes():
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                self._backup[id(t)] = host
            host.copy_(_bytes_of(storage, t.device), non_blocking=pin)
        if pin:
            torch.cuda.synchronize(tensors[0].device)

    @torch.inference_mode()
    def resume(self, tags: list[str] | None) -> None:
        """Retake the tagged memory (weights with their contents); recapture graphs if they went stale."""
        tags = check_tags(tags)
        for tag in tags:
            if tag not in self.released:
                continue
            self.released.discard(tag)
            if tag == "cuda_graph":
                self._need_capture = True
                continue
            for t, nbytes in self._freed.pop(tag, []):
                storage = t.untyped_storage()
                storage.resize_(nbytes)
                if storage.data_ptr() != self._addresses.get(id(t)):
                    self._need_capture = True  # graphs captured over the old address must not replay
                if tag == "weights":
                    _bytes_of(storage, t.device).copy_(self._backup[id(t)], non_blocking=True)
                else:
                    _bytes_of(storage, t.device).zero_()
        graphs = self._graphs()
        if graphs is None:
            self._need_capture = False
        elif self._need_capture:
            graphs.graphs.clear()
            if not self.released:  # a capture now would bake in zero-byte storages otherwise
                graphs.capture_all()
                self._need_capture = False
        if self.scheduler.device.type == "cuda":
            torch.cuda.synchronize(self.scheduler.device)
        if not self.released:
            self.scheduler.paused = self._pause_before
            self._pause_before = None


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
