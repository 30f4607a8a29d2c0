"""Run megatron-core on a host without CUDA (gloo instead of NCCL), unchanged otherwise.

megatron-core assumes a GPU everywhere: ``torch.cuda.current_device()`` as a device argument (rotary
embedding, buffers), ``device="cuda"`` literals (causal mask, pipeline schedules, grad clipping, the
optimizer), the CUDA RNG tracker, CUDA streams and events (MoE dispatcher, DDP), ``.cuda()`` copies,
``pin_memory=True`` staging tensors and ``torch.cuda.FloatTensor`` type strings (grad clipping, the
distributed optimizer). On a host without CUDA every one of these raises, so redirecting them cannot change
the behaviour of anything that worked before. :func:`enable` redirects them to the CPU:

1. ``torch.cuda`` functions megatron calls (current_device, streams, events, synchronize, RNG state,
   memory queries) become CPU equivalents or no-ops (a CPU has one in-order stream).
2. A global torch function mode maps ``device="cuda"`` in factory calls and ``.cuda()`` / ``.to("cuda")``
   to the CPU, drops ``pin_memory`` (it needs an accelerator), and reports a CPU tensor's ``.type()`` as
   the matching ``torch.cuda.*Tensor`` string, which is what megatron's optimizer checks for.
3. gloo's ``all_to_all_single`` wants split sizes as Python lists; megatron passes tensors on some paths.
4. Pipeline point-to-point goes unbatched (``batch_p2p_comm=False``, set by the model builder): gloo
   matches untagged messages between two ranks in posting order, and megatron's batched path posts both
   directions at once, which pairs an activation with a gradient when pp=2 (interleaved schedule).
5. Context parallel: Transformer Engine's ring attention is CUDA only, so :mod:`tidal.trainer.attention`
   provides a core attention that all-gathers K/V over the CP group (selected by the model builder).
6. Megatron-FSDP (``fsdp2``) formats ``f"cuda:{torch.cuda.current_device()}"`` into a device string while
   it is constructed; :func:`cuda_device_ordinals` makes ``current_device`` return ordinal 0 for that
   moment only (the device it is given, the CPU, is what it then uses).
7. Megatron-FSDP prefetches parameters with asynchronous coalesced all-gathers, ordered for CUDA by
   streams and events (no-ops here), and frees buckets by resizing their storage; gloo runs an
   asynchronous collective on a thread of its own. With those in flight the CPU tests' launches corrupted
   the heap now and then (a gloo thread's SIGSEGV, ``malloc(): unaligned tcache chunk``); so here its
   coalesced collectives complete before their block exits (two cores have no overlap to lose).

:func:`enable` does nothing on a host where CUDA is available, so the GPU path is never touched.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_ENABLED = False
_LOCK = threading.Lock()

_CPU = torch.device("cpu")


def needed() -> bool:
    """True on a host without a usable CUDA device."""
    return not torch.cuda.is_available()


def enabled() -> bool:
    return _ENABLED


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # a bare ordinal means a CUDA device in torch's API
    return isinstance(device, int)


_CUDA_TYPE_STRINGS = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
}

_TO_METHODS = {torch.Tensor.to, torch.Tensor.cuda}


class _CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device arguments to the CPU for every torch call made while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_STRINGS.get(name, name)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _Stream:
    """A CPU stands in for one in-order CUDA stream: waiting and recording are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: _CPU
    cuda.set_device = lambda device: None
    cuda.device_count = lambda: 0
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _Stream
    cuda.ExternalStream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda device=None: _Stream()
    cuda.default_stream = lambda device=None: _Stream()
    cuda.stream = lambda stream=None: contextlib.nullcontext(stream)
    cuda.set_stream = lambda stream: None
    cuda.is_current_stream_capturing = lambda: False
    cuda.memory_allocated = lambda device=None: 0
    cuda.memory_reserved = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    # RNG: the CUDA generator becomes the CPU default generator, so megatron's RNG tracker forks CPU state.
    # (torch.manual_seed itself calls torch.cuda.manual_seed_all, so seed the CPU generator directly)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    def get_rng_state(device="cuda", clone=False, graph_safe=False):
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def set_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_rng_state
    mrandom._set_cuda_rng_state = set_rng_state


def _patch_all_to_all() -> None:
    original = dist.all_to_all_single

    @functools.wraps(original)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return original(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)

    dist.all_to_all_single = all_to_all_single


def _patch_megatron_fsdp() -> None:
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as fsdp_buffers

    coalescing = fsdp_buffers._coalescing_manager

    @contextlib.contextmanager
    def synchronous_coalescing(group=None, device=None, async_ops=False):
        with coalescing(group, device, async_ops=False) as manager:
            yield manager

    fsdp_buffers._coalescing_manager = synchronous_coalescing


@contextlib.contextmanager
def cuda_device_ordinals():
    """While active, ``torch.cuda.current_device()`` returns 0 instead of the CPU device (no-op with CUDA).

    Only for code that builds ``torch.device(f"cuda:{torch.cuda.current_device()}")`` strings: elsewhere
    megatron passes ``current_device()`` straight to allocations (also in autograd backward functions,
    which run outside the torch function mode), where the CPU device itself must come back.
    """
    if not _ENABLED:
        yield
        return
    cpu_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        yield
    finally:
        torch.cuda.current_device = cpu_device


def enable() -> bool:
    """Redirect megatron-core's CUDA calls to the CPU; idempotent. Returns whether it is active.

    Does nothing (returns False) on a host with CUDA.
    """
    global _ENABLED
    with _LOCK:
        if _ENABLED:
            return True
        if not needed():
            return False
        _patch_torch_cuda()
        _patch_megatron()
        _patch_all_to_all()
        _patch_megatron_fsdp()
        # Entered for the life of the process: megatron allocates on "cuda" from many call sites.
        _CudaToCpuMode().__enter__()
        _ENABLED = True
        return True
