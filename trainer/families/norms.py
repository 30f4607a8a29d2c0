"""RMSNorms of the Qwen3.5 family in megatron-core's local spec, computed as transformers computes them.

Qwen3.5 stores most norm weights zero-centred (the gain is ``1 + weight``, initialised at zero); its Gated
DeltaNet output norm is a plain RMSNorm (gain ``weight``, initialised at one). Keeping each weight in the
checkpoint's own convention makes the weight mapping a plain copy (bitwise both ways) instead of a
``+-1`` shift that would round.
"""

from __future__ import annotations

import torch


class ZeroCenteredRMSNorm(torch.nn.Module):
    """``x / rms(x) * (1 + weight)`` in fp32, cast back to the input's dtype (transformers' Qwen3.5 norm)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        # under sequence parallelism each TP rank normalises a slice of the sequence: megatron sums the grad
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class ZeroCenteredQKNorm(ZeroCenteredRMSNorm):
    """The per-head query/key norm (after the sequence all-gather, so no sequence-parallel marking)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__(config, hidden_size, eps)
        self.weight.sequence_parallel = False


class PlainRMSNorm(torch.nn.Module):
    """``weight * (x / rms(x))``: the Gated DeltaNet output norm (transformers' ``RMSNormGated`` without
    its gate, which megatron's GatedDeltaNet applies itself)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return self.weight * normed
