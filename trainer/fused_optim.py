"""Sync-free replacements for megatron-core's no-Apex optimizer helpers, and torch's fused AdamW.

Without Apex or Transformer Engine megatron-core falls back to Python helpers for the optimizer's
multi-tensor operations (``megatron.core.utils.local_multi_tensor_*``). The gradient-norm helper turns every
parameter's norm into a Python float (``torch.tensor(list_of_cuda_scalars)``): one host-device sync per
parameter tensor, ~180 per step for a 20-layer model, which leaves the GPU idle most of the step (profiled
on the H200: 0.5 s of syncs per 2 steps). The scale and copy helpers launch two kernels per tensor.

:func:`install` swaps in equivalents built on torch's ``_foreach_*`` kernels (same arithmetic: per-tensor
fp32 2-norms, then the 2-norm of those; elementwise scale; copy), computed on the device without syncs.
It touches only the names that hold megatron's local fallbacks, so with Apex or TE installed nothing changes.

:func:`use_fused_adam` switches the torch AdamW/Adam inside megatron's (distributed) optimizer to torch's
fused CUDA implementation (one kernel for all parameters instead of a dozen foreach launches), before the
first step creates any optimizer state.
"""

from __future__ import annotations

import torch

_ORIGINALS: dict[tuple[object, str], object] = {}  # (module, name) -> megatron's local fallback


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for ``amp_C.multi_tensor_l2norm`` (no per-tensor norms): ``(total norm [1] fp32, None)``."""
    tensors = [t for t in tensor_lists[0] if t.numel()]
    if not tensors:
        return torch.zeros(
            1, dtype=torch.float32, device=tensor_lists[0][0].device if tensor_lists[0] else None
        ), None
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for ``amp_C.multi_tensor_scale``: ``dst = src * scale`` for each pair."""
    src, dst = list(tensor_lists[0]), list(tensor_lists[1])
    if not src:
        return
    if all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _apply(op, noop_flag_buffer, tensor_lists, *args):
    return op(2048 * 32, noop_flag_buffer, tensor_lists, *args)


def install(enabled: bool = True) -> bool:
    """Use the foreach helpers (``enabled``) or megatron's own fallbacks again; idempotent.

    Returns whether megatron runs on its local fallbacks here (False with Apex / TE: nothing to replace)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer

    if not _ORIGINALS:
        fallbacks = {
            "l2_norm_impl": (utils.local_multi_tensor_l2_norm, foreach_l2_norm),
            "multi_tensor_scale_impl": (utils.local_multi_tensor_scale, foreach_scale),
            "multi_tensor_applier": (utils.local_multi_tensor_applier, _apply),
        }
        for module in (clip_grads, moptimizer):
            for name, (local, _) in fallbacks.items():
                if getattr(module, name, None) is local:
                    _ORIGINALS[(module, name)] = local
        _REPLACEMENTS.update({name: ours for name, (_, ours) in fallbacks.items()})
    for (module, name), original in _ORIGINALS.items():
        setattr(module, name, _REPLACEMENTS[name] if enabled else original)
    return bool(_ORIGINALS)


_REPLACEMENTS: dict[str, object] = {}


def _torch_optimizers(optimizer):
    """The torch optimizers inside a megatron optimizer (chained, distributed, mixed precision)."""
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        torch_opt = getattr(inner, "optimizer", None)
        if isinstance(torch_opt, torch.optim.Optimizer):
            yield torch_opt


def use_fused_adam(optimizer) -> int:
    """Make the torch Adam/AdamW optimizers in ``optimizer`` use torch's fused kernel; returns how many.

    Only before the first step (no state yet) and only when every parameter is a floating CUDA tensor;
    otherwise the optimizer is left as it is.
    """
    switched = 0
    for torch_opt in _torch_optimizers(optimizer):
        if not isinstance(torch_opt, torch.optim.Adam | torch.optim.AdamW) or torch_opt.state:
            continue
        params = [p for group in torch_opt.param_groups for p in group["params"]]
        if not params or not all(p.is_cuda and p.is_floating_point() for p in params):
            continue
        for group in torch_opt.param_groups:
            group["fused"] = True
            group["foreach"] = False
        switched += 1
    return switched
