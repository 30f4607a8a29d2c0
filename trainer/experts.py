"""MoE experts computed as grouped matrix products, with megatron-core's SequentialMLP parameters.

megatron-core without Transformer Engine runs its experts as ``SequentialMLP``: a Python loop over the
local experts, each one three kernel launches per projection and a host sync for the split sizes. Here the
same experts run as two grouped GEMMs (``torch._grouped_mm``: fc1 for every expert in one call, fc2 in
another) over the tokens the dispatcher already sorted by expert.

The module IS a ``SequentialMLP`` (subclass): it owns the same ``local_experts.N.linear_fc1/linear_fc2``
modules and parameters, so parameter names, shapes, tensor-parallel attributes, checkpoints, the weight
mapping (weights_sync/mapping*.py) and expert / expert-tensor parallelism are untouched; only ``forward``
differs. Each forward stacks the experts' weights into ``[E, out, in]`` and the autograd of ``torch.stack``
hands every expert its own gradient. The matrix products would keep that stacked copy for backward, one per
MoE layer and in-flight micro-batch (3.9 GiB a layer for Kimi K2.6 at EP8); saved-tensor hooks keep the
expert parameters instead and restack them when backward needs the weights (:class:`RestackInBackward`):
the same values, so the same gradients, for one more copy of the weights in backward.

Under megatron's DDP the stacked weights' gradient goes straight into the experts' fp32 ``main_grad``
(:class:`StackIntoMainGrad`): a few multi-tensor adds per projection instead of one autograd gradient per
expert, each added by its own DDP hook kernel (512 adds per micro-batch for 8 layers of 32 experts).

Kernels (``trainer.kernels.experts``): ``grouped_mm`` (CUDA, compute capability 9.0+, bf16, dimensions
multiple of 8), ``loop`` (the same arithmetic expert by expert, any device: the CPU path and the reference),
``auto`` (grouped_mm where it can run, loop elsewhere).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from tidal.trainer import pointwise

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


class RestackInBackward:
    """Saved-tensor hooks: a tensor saved for backward that is a view of one of ``stacks`` (stacked expert
    weights) is kept as the recipe to rebuild it (which stack, the view's size, strides and offset), not as
    the stacked copy; backward restacks the parameters once per stack and hands out the same views.

    Valid because parameters do not change between a micro-batch's forward and backward (the optimizer
    steps after every backward of the step). The rebuilt stack is dropped once every view saved from it
    has been unpacked (the loop path saves one view per expert).
    """

    def __init__(self, stacks: list[tuple[torch.Tensor, list[torch.Tensor]]]):
        self._storages = [stacked.untyped_storage().data_ptr() for stacked, _ in stacks]
        self._params = [params for _, params in stacks]
        self._pending = [0] * len(stacks)
        self._rebuilt: list[torch.Tensor | None] = [None] * len(stacks)

    def pack(self, tensor: torch.Tensor):
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            return tensor
        storage = tensor.untyped_storage().data_ptr()
        for index, stacked_storage in enumerate(self._storages):
            if storage == stacked_storage:
                self._pending[index] += 1
                return (index, tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset())
        return tensor

    def unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        index, size, stride, offset = saved
        stacked = self._rebuilt[index]
        if stacked is None:
            stacked = torch.stack([p.detach() for p in self._params[index]])
            self._rebuilt[index] = stacked
        self._pending[index] -= 1
        if self._pending[index] <= 0:
            self._rebuilt[index] = None
        return stacked.as_strided(size, stride, offset)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


# Experts whose stacked gradient is cast to the main gradient's dtype at once: bounds that temporary copy
# (Kimi K2.6's 48 local experts' fc1 at EP8 is 1.4 G elements a layer).
MAIN_GRAD_CAST_ELEMENTS = 64 << 20


def adds_into_main_grad(weights: list[torch.Tensor]) -> bool:
    """Whether ``weights`` carry megatron DDP's ``main_grad`` protocol (one dtype and device), so that
    :class:`StackIntoMainGrad` may add their gradients itself."""
    mains = [getattr(w, "main_grad", None) for w in weights]
    if not weights or any(m is None for m in mains):
        return False
    if not all(hasattr(w, "grad_added_to_main_grad") for w in weights):
        return False
    return len({(m.dtype, m.device) for m in mains}) == 1


class StackIntoMainGrad(torch.autograd.Function):
    """``torch.stack(weights)`` whose backward adds each expert's slice of the stacked gradient into that
    weight's ``main_grad`` with multi-tensor adds, marks ``grad_added_to_main_grad`` (as megatron's linear
    layers do under gradient-accumulation fusion) and hands autograd placeholder gradients, which the DDP
    hooks then skip (they still run: they mark the gradient buckets ready)."""

    @staticmethod
    def forward(ctx, *weights: torch.Tensor) -> torch.Tensor:
        ctx.weights = weights
        return torch.stack(weights)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weights = ctx.weights
        mains = [w.main_grad for w in weights]
        per = max(1, MAIN_GRAD_CAST_ELEMENTS // max(1, grad[0].numel()))
        for start in range(0, len(weights), per):
            # contiguous like main_grad (the weight gradient may come transposed): the foreach fast path
            part = grad[start : start + per].to(mains[0].dtype, memory_format=torch.contiguous_format)
            torch._foreach_add_(mains[start : start + per], list(part.unbind(0)))
        zero = any(getattr(w, "zero_out_wgrad", False) for w in weights)
        for w in weights:
            w.grad_added_to_main_grad = True
        # contiguous, so that each expert's slice matches its weight's layout and autograd keeps it uncopied
        new = torch.zeros if zero else torch.empty
        placeholder = new(grad.shape, dtype=grad.dtype, device=grad.device)
        return tuple(placeholder.unbind(0))


def stack_weights(weights: list[torch.Tensor]) -> torch.Tensor:
    """The experts' weights as one ``[E, out, in]`` tensor, its gradient added into ``main_grad`` where
    megatron's DDP gave the weights one."""
    if torch.is_grad_enabled() and adds_into_main_grad(weights):
        return StackIntoMainGrad.apply(*weights)
    return torch.stack(weights)


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
            return self.config.activation_func(gate) * up
        return self.config.activation_func(h)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states
        fc1 = [expert.linear_fc1.weight for expert in self.local_experts]
        fc2 = [expert.linear_fc2.weight for expert in self.local_experts]
        w1 = stack_weights(fc1)  # [E, 2F, H]
        w2 = stack_weights(fc2)  # [E, H, F]
        restack = RestackInBackward([(w1, fc1), (w2, fc2)])
        use_kernel = self._use_kernel(x, w1, w2)
        counts = None
        if use_kernel:
            # no host sync: the kernel reads the group ends from the device
            offsets = torch.cumsum(tokens_per_expert.to(x.device), 0, dtype=torch.int32)
        else:
            counts = [int(c) for c in tokens_per_expert.tolist()]
            offsets = None
        with restack.hooks():
            h = grouped_linear(x, w1, offsets, counts, use_kernel)
        # as megatron's MLP: the routing probability scales the activation (fp32 probs), then back to dtype
        probs = permuted_probs.unsqueeze(-1)
        if self.config.gated_linear_unit and self.config.activation_func is F.silu:
            h = pointwise.weighted_bias_swiglu_impl(h, None, probs)  # one compiled chain on CUDA
        else:
            h = (self._activation(h) * probs).to(x.dtype)
        with restack.hooks():
            return grouped_linear(h, w2, offsets, counts, use_kernel), None
