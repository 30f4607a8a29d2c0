"""Elementwise chains of the transformer layer as single kernels: torch.compile where it pays (CUDA).

Without Transformer Engine, megatron-core's local spec runs SwiGLU (chunk, silu, multiply) and the rotary
embedding (multiply, rotate-half = negate + concatenate, multiply, add) as separate elementwise kernels,
each reading and writing the whole activation; their backward passes likewise; torch's RMSNorm computes its
weight gradient in a separate slow column reduction. Profiled on the H200 (dense 1.1B, 2 x 4096 tokens,
bf16) those cost ~28 ms of a 222 ms step. Here each chain is one Python
function; on CUDA, for tensors large enough that one fused kernel saves more than compiling costs, it runs
through ``torch.compile`` (inductor emits one Triton kernel for the forward and one for the backward).
Everywhere else the same function runs eagerly: the same operations as megatron-core's.

The norms are tidal's RMSNorm classes (``tidal.trainer.models``), which call :func:`rms_norm`.

``trainer.kernels.pointwise``: ``auto`` (compiled on CUDA for tensors of at least
:data:`COMPILE_MIN_NUMEL` elements), ``compiled`` (always; on CPU inductor's C++ backend), ``eager``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

COMPILE_MIN_NUMEL = 1 << 22  # ~4M elements: below this a launch or two saved is not worth a compile

_mode = "auto"
_compiled: dict[Callable, Callable] = {}


def set_mode(mode: str) -> None:
    """``auto`` | ``compiled`` | ``eager`` (``trainer.kernels.pointwise``), process-wide."""
    global _mode
    if mode not in ("auto", "compiled", "eager"):
        raise ValueError(f"trainer.kernels.pointwise={mode!r}: must be auto, compiled or eager")
    _mode = mode


def get_mode() -> str:
    return _mode


def wants_compiled(t: torch.Tensor, mode: str | None = None) -> bool:
    """Whether a chain over ``t`` runs compiled under ``mode`` (default: the process-wide one)."""
    mode = mode or _mode
    if mode == "compiled":
        return True
    return mode == "auto" and t.is_cuda and t.numel() >= COMPILE_MIN_NUMEL


RECOMPILE_LIMIT = 64  # graphs per function: shapes by rank (queries, keys), grad on/off, dtypes


def compiled(fn: Callable) -> Callable:
    """``fn`` under ``torch.compile``, cached.

    Shapes are static at first and a dimension becomes dynamic once it changes (torch's automatic dynamic
    shapes): the token count of packed batches changes every step, while hidden, head and vocabulary sizes
    stay constants, so the kernels keep vectorised, constant-stride indexing. Compiling every dimension as
    dynamic (``dynamic=True``) measured 2-3x slower kernels on the H200 (SwiGLU's backward: 0.66 ms for
    8192 x 12288, 0.9 TB/s).
    """
    c = _compiled.get(fn)
    if c is None:
        import torch._dynamo

        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
        c = _compiled[fn] = torch.compile(fn, fullgraph=True)
    return c


def _run(fn: Callable, *args):
    """``fn(*args)``, compiled when the chain's first tensor asks for it (:func:`wants_compiled`)."""
    return (compiled(fn) if wants_compiled(args[0]) else fn)(*args)


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    # megatron-core's _rotate_half, written out so that dynamo traces it without importing megatron
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _rotate(t: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return (t * cos_) + (_rotate_half(t, interleaved) * sin_)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 throughout and one rounding at the end, as torch's fused rms_norm kernel computes it
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, eager: Callable) -> torch.Tensor:
    """RMSNorm of the last dimension; ``eager(x)`` (torch's own kernel) unless compiled. torch's backward
    for the weight (a separate column reduction over all rows) is the slow part this replaces."""
    if wants_compiled(x):
        return compiled(_rms_norm)(x, weight, eps)
    return eager(x)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :F]) * x[..., F:]`` (megatron's gated linear unit with silu)."""
    return _run(_swiglu, x)


def rotate(t: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary embedding of the whole head dimension: ``t * cos + rotate_half(t) * sin``."""
    return _run(_rotate, t, cos_, sin_, interleaved)


def bias_swiglu_impl(x, bias, fp8_input_store=False, cpu_offload_input=False):
    """Drop-in for megatron's ``bias_swiglu_impl`` (its MLP calls it with ``bias_activation_fusion``)."""
    if fp8_input_store or cpu_offload_input:
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl as megatrons

        return megatrons(x, bias, fp8_input_store, cpu_offload_input)
    if bias is not None:
        x = x + bias
    return swiglu(x)


def _weighted_swiglu(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (_swiglu(x) * weights).to(x.dtype)


def weighted_bias_swiglu_impl(x, bias, weights, fp8_input_store=False):
    """Drop-in for megatron's ``weighted_bias_swiglu_impl`` (an MoE expert MLP given its routing probabilities:
    ``(swiglu(x) * probs).to(x.dtype)``, as megatron's unfused path computes it)."""
    if bias is not None or fp8_input_store:
        from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl as megatrons

        return megatrons(x, bias, weights, fp8_input_store)
    return _run(_weighted_swiglu, x, weights)


def install(mode: str) -> None:
    """Set ``mode`` and route megatron's MLP activation through :func:`bias_swiglu_impl` and
    :func:`weighted_bias_swiglu_impl` (idempotent).

    The model's TransformerConfig must have ``bias_activation_fusion=True`` for megatron's MLP to call it
    (``tidal.trainer.models`` sets it); megatron's own fused version would be TorchScript here.
    """
    from megatron.core.transformer import mlp

    set_mode(mode)
    mlp.bias_swiglu_impl = bias_swiglu_impl
    mlp.weighted_bias_swiglu_impl = weighted_bias_swiglu_impl
