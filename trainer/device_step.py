"""The optimizer step with the gradient scale and clip applied by the fused Adam kernel, without a host sync.

megatron-core ends a step with three passes over the fp32 gradients before Adam reads them: the per-token
normalisation (``finalize_model_grads`` multiplies the whole gradient buffer by 1 / tokens), the norm, and
the clip (a second multiply when the norm exceeds the limit, decided on the host after ``.item()`` of the
norm). On the H200 those passes cost ~8 ms of a 1.1B model's step, the sync leaves the GPU idle while the
host catches up, and megatron's per-parameter Python around them (filtering grads for the norm, building
the clip lists) ~5 ms more on an MoE with ~570 parameter tensors.

Here the normalisation factor is kept instead of applied, the norm of the unscaled gradients is computed on
the device (one multi-tensor kernel, the same all-reduce over the model-parallel group), and the product of
normalisation and clip coefficient reaches torch's fused Adam as its ``grad_scale``: Adam divides each
gradient by it as it reads it. Same arithmetic as megatron's path up to rounding (the factor is applied
once, in the kernel, instead of twice in memory); the gradient list for the norm is taken from megatron's
own filter once and reused while the gradient buffers stay the same.

Only where it applies: a (chained) distributed optimizer with plain fp32 master shards and the batched
shard copies (trainer/fused_optim.py), torch's fused Adam/AdamW, no loss scaler, no separate grad-norm
groups, no skip threshold, no zero counting. Elsewhere :func:`unsupported` names the reason and megatron's
step runs.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from tidal.trainer import fused_optim


def _inner(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def unsupported(optimizer) -> str | None:
    """Why the device step cannot replace megatron's step for ``optimizer`` (None: it can)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import _get_param_grad_norm_group, _is_separate_grad_norm_group

    inner = _inner(optimizer)
    for opt in inner:
        if not isinstance(opt, DistributedOptimizer) or opt.is_stub_optimizer:
            return f"{type(opt).__name__} is not a distributed optimizer with parameters"
        if getattr(opt, "_tidal_batched_copies", None) is None:
            return "the distributed optimizer has no batched shard copies (trainer.kernels.multi_tensor)"
        if opt.grad_scaler is not None:
            return "a loss scaler is in use (fp16)"
        config = opt.config
        if config.log_num_zeros_in_grad or math.isfinite(config.grad_norm_skip_threshold):
            return "zero counting or a grad-norm skip threshold is configured"
        if config.clip_grad != inner[0].config.clip_grad:
            return "the chained optimizers clip at different norms"
        torch_opt = opt.optimizer
        if not isinstance(torch_opt, torch.optim.Adam | torch.optim.AdamW):
            return f"the inner optimizer is {type(torch_opt).__name__}, not torch Adam/AdamW"
        if not all(group.get("fused") for group in torch_opt.param_groups):
            return "torch's Adam is not the fused kernel (CPU, or trainer.kernels.adam=foreach)"
        for param in opt.get_parameters():
            if _is_separate_grad_norm_group(_get_param_grad_norm_group(param)):
                return "a parameter belongs to a separate grad-norm group"
        if opt.get_grad_stats_parallel_group() != inner[0].get_grad_stats_parallel_group():
            return "the chained optimizers reduce grad norms over different groups"
    return None


class DeviceStep:
    """:meth:`step` replaces ``optimizer.step()``; :meth:`arm` before the forward-backward hands it that
    pass's gradient normalisation."""

    def __init__(self, optimizer, chunks):
        self.optimizer = optimizer
        self.inner = _inner(optimizer)
        self.max_norm = float(self.inner[0].config.clip_grad)
        self.group = self.inner[0].get_grad_stats_parallel_group()
        self._factor: torch.Tensor | float | None = None  # finalize_model_grads' 1 / tokens, kept
        self._armed = False
        self._norm_grads: list[torch.Tensor] | None = None
        self._norm_key = None
        for chunk in chunks:
            self._hook_scale(chunk)

    def _hook_scale(self, chunk) -> None:
        original = chunk.scale_gradients

        def scale_gradients(scaling):
            if self._armed:
                self._factor = scaling  # the same factor for every model chunk: kept once
            else:
                original(scaling)

        chunk.scale_gradients = scale_gradients

    def arm(self) -> None:
        self._factor = None
        self._armed = True

    def _grads_for_norm(self) -> list[torch.Tensor]:
        key = tuple(opt._tidal_batched_copies._key for opt in self.inner)
        if self._norm_grads is None or key != self._norm_key:
            self._norm_grads = [g for opt in self.inner for g in opt.get_grads_for_grad_norm()]
            self._norm_key = key
        return self._norm_grads

    @torch.no_grad()
    def step(self) -> tuple[bool, torch.Tensor]:
        """Adam on the normalised, clipped gradients; returns (True, the norm of the normalised gradients as
        a device tensor: megatron's grad norm, read when the caller needs it)."""
        self._armed = False
        for opt in self.inner:
            opt.prepare_grads()  # the batched copies point each master shard's .grad at its gradient view
        grads = self._grads_for_norm()
        device = grads[0].device if grads else torch.device("cuda")
        if grads:
            squared = fused_optim.foreach_l2_norm(0, None, [grads], False)[0].square()
        else:
            squared = torch.zeros(1, dtype=torch.float32, device=device)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self.group)
        factor, self._factor = (1.0 if self._factor is None else self._factor), None
        scale = torch.as_tensor(factor, dtype=torch.float32, device=device).reshape(1)
        norm = squared.sqrt() * scale  # the norm megatron reports: of the normalised gradients
        coefficient = scale
        if self.max_norm > 0.0:
            coefficient = scale * (self.max_norm / (norm + 1.0e-6)).clamp_max(1.0)
        grad_scale = coefficient.reciprocal()  # fused Adam divides each gradient by grad_scale
        for opt in self.inner:
            opt.optimizer.grad_scale = grad_scale
        try:
            ok = self.optimizer.step_with_ready_grads()  # Adam, then the master -> model parameter copies
        finally:
            for opt in self.inner:
                opt.optimizer.grad_scale = None
        return ok, norm.reshape(())


def device_step(state, kernels) -> DeviceStep | None:
    """The state's :class:`DeviceStep` (made once) when ``trainer.kernels.grad_scale`` allows and the
    optimizer supports it; None means megatron's step (``grad_scale=fused`` raises instead, with the reason)."""
    existing = getattr(state, "_tidal_device_step", False)
    if existing is not False:
        return existing
    made = None
    if kernels.grad_scale != "megatron":
        reason = unsupported(state.optimizer)
        if reason is not None and kernels.grad_scale == "fused":
            raise ValueError(
                f"trainer.kernels.grad_scale=fused cannot run here: {reason}; use auto or megatron"
            )
        if reason is None:
            made = DeviceStep(state.optimizer, state.chunks)
    state._tidal_device_step = made
    return made
