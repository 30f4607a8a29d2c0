"""MoE experts computed as grouped matrix products, with megatron-core's SequentialMLP parameters.

megatron-core without Transformer Engine runs its experts as ``SequentialMLP``: a Python loop over the
local experts, each one three kernel launches per projection and a host sync for the split sizes. Here the
same experts run as two grouped GEMMs (``torch._grouped_mm``: fc1 for every expert in one call, fc2 in
another) over the tokens the dispatcher already sorted by expert.

The module IS a ``SequentialMLP`` (subclass): it owns the same ``local_experts.N.linear_fc1/linear_fc2``
modules and parameters, so parameter names, shapes, tensor-parallel attributes, checkpoints, the weight
mapping (weights_sync/mapping*.py) and expert / expert-tensor parallelism are untouched; only ``forward``
differs. Each step stacks the experts' weights into ``[E, out, in]`` (one copy of the expert weights, small
beside the activations) and the autograd of ``torch.stack`` hands every expert its own gradient.

Kernels (``trainer.kernels.experts``): ``grouped_mm`` (CUDA, compute capability 9.0+, bf16, dimensions
multiple of 8), ``loop`` (the same arithmetic expert by expert, any device: the CPU path and the reference),
``auto`` (grouped_mm where it can run, loop elsewhere).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

EXPERT_KERNELS = ("auto", "grouped_mm", "loop", "sequential")


def grouped_mm_unsupported(x: torch.Tensor, *weights: torch.Tensor) -> str | None:
    """Why ``torch._grouped_mm`` cannot run these operands on this device, or None when it can."""
    if not x.is_cuda:
        return f"tensors are on {x.device.type}; the grouped GEMM kernel needs CUDA"
    if x.dtype != torch.bfloat16:
        return f"dtype {x.dtype}; the grouped GEMM kernel takes bfloat16"
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return "the grouped GEMM kernel needs compute capability 9.0 or newer"
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    dims = {x.shape[-1], *(d for w in weights for d in w.shape[1:])}  # the expert count needs no alignment
    if any(d % 8 for d in dims):
        return f"matrix dimensions {sorted(dims)} are not all multiples of 8 (16-byte rows in bf16)"
    return None


def grouped_linear(
    x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, counts: list[int] | None, use_kernel: bool
) -> torch.Tensor:
    """``x[rows of group g] @ weights[g].T`` for every group, rows sorted by group.

    ``weights`` is ``[G, out, in]``; ``offsets`` the int32 cumulative row counts (group ends) on ``x``'s
    device; ``counts`` the same counts as Python ints (needed by the loop only).
    """
    if use_kernel:  # row-major activations with 16-byte rows; the weights' transpose is column-major
        return torch._grouped_mm(x.contiguous(), weights.transpose(1, 2), offs=offsets)
    outs = [part @ w.t() for part, w in zip(x.split(counts), weights.unbind(0), strict=True)]
    return torch.cat(outs) if outs else x.new_zeros(0, weights.shape[1])


class GroupedExperts(SequentialMLP):
    """megatron-core's SequentialMLP computed with grouped GEMMs (same parameters, same results)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None, kernel="auto"):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, name=name)
        if kernel not in EXPERT_KERNELS or kernel == "sequential":
            raise ValueError(
                f"GroupedExperts kernel={kernel!r}; choose auto, grouped_mm or loop "
                "(trainer.kernels.experts=sequential builds megatron-core's SequentialMLP instead)"
            )
        cfg = self.config
        unsupported = [
            reason
            for reason, bad in (
                ("expert biases (add_bias_linear)", cfg.add_bias_linear),
                ("fp8/fp4 experts", bool(cfg.fp8 or getattr(cfg, "fp4", None))),
                ("moe_apply_probs_on_input", cfg.moe_apply_probs_on_input),
                ("use_te_activation_func", getattr(cfg, "use_te_activation_func", False)),
                (
                    "a clamped or offset GLU",
                    bool(
                        getattr(cfg, "activation_func_clamp_value", None)
                        or getattr(cfg, "glu_linear_offset", 0)
                    ),
                ),
            )
            if bad
        ]
        if unsupported:
            raise ValueError(
                f"GroupedExperts does not support {', '.join(unsupported)}; "
                "set trainer.kernels.experts=sequential"
            )
        self.kernel = kernel

    def _use_kernel(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
        if self.kernel == "loop" or x.shape[0] == 0:
            return False
        reason = grouped_mm_unsupported(x, w1, w2)
        if reason is None:
            return True
        if self.kernel == "grouped_mm":
            raise ValueError(
                f"trainer.kernels.experts=grouped_mm cannot run here: {reason}; use auto or loop"
            )
        return False

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        if self.config.gated_linear_unit:
            gate, up = torch.chunk(h, 2, dim=-1)
            if self.config.activation_func is F.silu:
                return F.silu(gate) * up
            return self.config.activation_func(gate) * up
        return self.config.activation_func(h)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states
        w1 = torch.stack([expert.linear_fc1.weight for expert in self.local_experts])  # [E, 2F, H]
        w2 = torch.stack([expert.linear_fc2.weight for expert in self.local_experts])  # [E, H, F]
        use_kernel = self._use_kernel(x, w1, w2)
        counts = None
        if use_kernel:
            # no host sync: the kernel reads the group ends from the device
            offsets = torch.cumsum(tokens_per_expert.to(x.device), 0, dtype=torch.int32)
        else:
            counts = [int(c) for c in tokens_per_expert.tolist()]
            offsets = None
        h = grouped_linear(x, w1, offsets, counts, use_kernel)
        h = self._activation(h)
        # as megatron's MLP: the routing probability scales the activation (fp32 probs), then back to dtype
        h = (h * permuted_probs.unsqueeze(-1)).to(x.dtype)
        return grouped_linear(h, w2, offsets, counts, use_kernel), None
