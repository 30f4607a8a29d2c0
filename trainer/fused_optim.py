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


def _distributed_optimizers(optimizer):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if isinstance(inner, DistributedOptimizer):
            yield inner


def _plain_fp32_master(opt) -> bool:
    """Whether ``opt`` keeps plain fp32 master shards of bf16/fp32 parameters over fp32 gradient buffers:
    the case the batched copies below reproduce (no FSDP, no precision-aware or quantized parameters)."""
    ddp = opt.ddp_config
    cfg = opt.config
    if opt.is_stub_optimizer or ddp.use_megatron_fsdp or cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        return False
    if getattr(ddp, "fp8_param_gather", False) or getattr(ddp, "fp4_param_gather", False):
        return False
    return all(buffer.grad_data.dtype == torch.float32 for buffer in opt.buffers)


class _BatchedShardCopies:
    """A distributed optimizer's per-step copies between its fp32 master shards and the model's buffers,
    planned once and run as one multi-tensor copy.

    megatron-core walks every parameter in Python at every step, looking up its ranges, to point the master
    shard's ``.grad`` at the gradient buffer and to copy the updated master shard into the parameter buffer:
    ~20 us a parameter on the host, which an MoE with per-expert parameters (8 layers x 32 experts: ~570
    tensors) pays every step while the GPU waits. The views are the same every step (the buffers are
    allocated once), so they are taken once; the copy is ``torch._foreach_copy_``. Same values, bitwise.
    """

    def __init__(self, opt):
        self.opt = opt
        self._key = None
        self._shards: list[torch.Tensor] = []  # fp32 master shards
        self._grads: list[torch.Tensor] = []  # each shard's view of the gradient buffer
        self._params: list[torch.Tensor] = []  # each shard's view of the parameter buffer

    def _buffers_key(self):
        return tuple((b.grad_data.data_ptr(), b.param_data.data_ptr()) for b in self.opt.buffers)

    def _plan(self) -> None:
        opt = self.opt
        self._shards, self._grads, self._params = [], [], []
        groups = (
            (opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
            (opt.model_fp32_groups, opt.shard_fp32_groups),
        )
        for model_groups, shard_groups in groups:
            for model_group, shard_group in zip(model_groups, shard_groups, strict=True):
                for model_param, shard in zip(model_group, shard_group, strict=True):
                    ranges = opt._get_model_param_range_map(model_param)
                    param_range, world_range = ranges["param"], ranges["gbuf_world_in_bucket"]
                    gbuf_index, _, bucket_id = opt.model_param_gbuf_map[model_param]
                    param_data = opt.buffers[gbuf_index].buckets[bucket_id].param_data
                    self._shards.append(shard)
                    self._grads.append(model_param.main_grad.view(-1)[param_range.start : param_range.end])
                    self._params.append(param_data.view(-1)[world_range.start : world_range.end])
        self._key = self._buffers_key()

    def _ensure_plan(self) -> None:
        if self._key != self._buffers_key():
            self._plan()

    def copy_model_grads_to_main_grads(self) -> None:
        self._ensure_plan()
        for shard, grad in zip(self._shards, self._grads, strict=True):
            shard.grad = grad

    @torch.no_grad()
    def copy_main_params_to_model_params(self) -> None:
        self._ensure_plan()
        if self._params:
            torch._foreach_copy_(self._params, self._shards)


def batch_shard_copies(optimizer) -> int:
    """Give each plain fp32-master distributed optimizer in ``optimizer`` the batched copies; returns how
    many (0 where megatron's own path is needed: FSDP, precision-aware or quantized parameters)."""
    switched = 0
    for opt in _distributed_optimizers(optimizer):
        if getattr(opt, "_tidal_batched_copies", None) is not None or not _plain_fp32_master(opt):
            continue
        copies = _BatchedShardCopies(opt)
        opt._tidal_batched_copies = copies
        opt._copy_model_grads_to_main_grads = copies.copy_model_grads_to_main_grads
        opt._copy_main_params_to_model_params = copies.copy_main_params_to_model_params
        switched += 1
    return switched
