"""Which kernel runs the Gated DeltaNet's chunked delta rule (``trainer.kernels.gated_delta_rule``).

megatron-core's ``GatedDeltaNet`` calls ``self.gated_delta_rule(q, k, v, g=, beta=, cu_seqlens=, ...)``:
flash-linear-attention's chunked Triton kernel, or in megatron's deterministic mode its torch-native
chunked form, which takes no packed (THD) sequences. tidal sets that attribute per module:

- ``fla``: flash-linear-attention's kernel (fast; forward and backward in Triton);
- ``torch``: megatron-core's torch-native chunked rule, run sequence by sequence over the packed row (slow,
  exact in fp32; for checking fla, and where fla refuses its backward);
- ``auto``: fla, unless fla refuses to differentiate on this device: fla 0.6 raises in the backward on
  Hopper GPUs with Triton >= 3.4 and < 3.7.1 (fla issue #640: that Triton miscompiles the gated dq/dk/dw/dg
  kernel), unless TileLang is installed. torch 2.11 pins Triton 3.6, so that is the usual case on an H200;
  then every call, forward included, takes the torch path, so that the policy's logprobs at sampling-time
  recomputation and in training come from one implementation.

The causal convolution before the rule stays fla's in every case (its kernels are not affected).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Literal

import torch

log = logging.getLogger(__name__)

Choice = Literal["auto", "fla", "torch"]


def fla_backward_refusal() -> str | None:
    """Why fla's gated delta rule cannot be differentiated on this device, or None when it can."""
    if not torch.cuda.is_available():
        return None
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:  # another fla version: no such guard known
        return None
    if not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1):
        return None
    if importlib.util.find_spec("tilelang") is not None:
        return None
    import triton

    return (
        f"flash-linear-attention refuses the gated delta rule's backward on Hopper GPUs with Triton "
        f"{triton.__version__} (>= 3.4.0 and < 3.7.1 miscompiles its gated dq/dk kernel, fla issue #640) "
        "unless Triton >= 3.7.1 or TileLang is installed"
    )


def torch_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state=None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **_ignored,
) -> tuple[torch.Tensor, None]:
    """megatron-core's torch-native chunked gated delta rule on [B, T, H, D] inputs, packed rows included.

    With ``cu_seqlens`` the single row holds several sequences; each is computed on its own (the recurrent
    state starts at zero at every sequence start, as fla's varlen kernel does) and the outputs are joined.
    """
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    if initial_state is not None or output_final_state:
        raise ValueError("the torch gated delta rule takes no initial state and returns no final state")

    def rule(*tensors: torch.Tensor) -> torch.Tensor:
        out, _ = torch_chunk_gated_delta_rule(
            *tensors, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=None
        )
        return out.to(q.dtype)

    if cu_seqlens is None:
        return rule(q, k, v, g, beta), None
    if q.shape[0] != 1:
        raise ValueError(f"packed sequences (cu_seqlens) come in one row, got a batch of {q.shape[0]}")
    bounds = cu_seqlens.tolist()
    pieces = [
        rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b])
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        if b > a
    ]
    return torch.cat(pieces, dim=1), None


def resolve(choice: Choice) -> Literal["fla", "torch"]:
    if choice != "auto":
        return choice
    reason = fla_backward_refusal()
    if reason is None:
        return "fla"
    log.warning("Gated DeltaNet: %s; using megatron-core's torch-native chunked rule instead", reason)
    return "torch"


def installed(chunks) -> str:
    """The rule the chunks' GatedDeltaNet layers run: ``fla``, ``torch``, or ``none`` without such layers."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    rules = {m.gated_delta_rule for chunk in chunks for m in chunk.modules() if isinstance(m, GatedDeltaNet)}
    if not rules:
        return "none"
    return "torch" if rules == {torch_packed} else "fla"


def install(chunks, choice: Choice) -> str:
    """Point every GatedDeltaNet of ``chunks`` at the chosen rule; returns the resolved choice."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    modules = [m for chunk in chunks for m in chunk.modules() if isinstance(m, GatedDeltaNet)]
    if not modules:
        return "none"
    resolved = resolve(choice)
    if resolved == "torch":
        for module in modules:
            module.gated_delta_rule = torch_packed
    return resolved
