"""MoE token permutation whose sums are gathers: no atomic scatter-adds in the forward or the backward.

megatron-core without Transformer Engine permutes the tokens to their experts with ``index_select`` and
puts them back with ``scatter_add_``. Each token goes to k experts, so both directions sum k rows per
token somewhere: the permute's backward (``index_select``'s gradient is an ``index_add_``) and the
unpermute's forward, each an atomic add of bf16 rows (~1.2 ms and ~0.5 ms per layer for 131k routed
rows of 1,024 on the H200: 14 ms of an 8-layer MoE's step).

When no token is dropped (no expert capacity), every token is routed to exactly k experts. Sorting the
routed rows by token then gives each token its k rows side by side, and the sum becomes a gather and a
``sum`` over k (fp32 accumulation, rounded once; deterministic). Everything else (the order of the routed
rows, the permuted probabilities) is megatron's own computation.

``trainer.kernels.moe_permute``: ``gather`` (any device), ``megatron`` (its scatter-add path, the
reference), ``auto`` (gather on CUDA). Expert capacity (token dropping or padding) always takes megatron's path.
"""

from __future__ import annotations

import torch

_MODES = ("auto", "gather", "megatron")
_state = {"mode": "megatron", "dropping": False, "originals": None, "experts": set()}


class _GatherRows(torch.autograd.Function):
    """``tokens[indices]``; backward sums the k gradient rows of each token through a gather."""

    @staticmethod
    def forward(ctx, tokens, indices, k):
        ctx.save_for_backward(indices)
        ctx.k, ctx.num_tokens = k, tokens.shape[0]
        return tokens.index_select(0, indices)

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        return _sum_rows(grad, indices, ctx.num_tokens, ctx.k), None, None


class _SumRows(torch.autograd.Function):
    """``out[t] = sum of rows[j] with indices[j] == t``; backward gathers ``grad[indices]``."""

    @staticmethod
    def forward(ctx, rows, indices, num_tokens, k):
        ctx.save_for_backward(indices)
        return _sum_rows(rows, indices, num_tokens, k)

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        return grad.index_select(0, indices), None, None, None


def _sum_rows(rows: torch.Tensor, indices: torch.Tensor, num_tokens: int, k: int) -> torch.Tensor:
    by_token = torch.argsort(indices, stable=True)  # each token's k rows, tokens in order
    return rows.index_select(0, by_token).view(num_tokens, k, -1).sum(1, dtype=torch.float32).to(rows.dtype)


def _applies(tokens: torch.Tensor, routing_map, routed: int | None, fused: bool, drop_and_pad: bool) -> bool:
    """Whether every token has exactly ``routed / tokens`` rows: a map over ALL experts of a model that
    drops no token (a dispatcher's map over its local experts only routes a token 0..k times)."""
    mode = _state["mode"]
    if mode == "megatron" or (mode == "auto" and not tokens.is_cuda):
        return False
    if fused or drop_and_pad or _state["dropping"] or not isinstance(routed, int) or routing_map is None:
        return False
    if routing_map.shape[1] not in _state["experts"]:
        return False
    return tokens.shape[0] > 0 and routed % tokens.shape[0] == 0


def permute(
    tokens,
    routing_map,
    probs=None,
    num_out_tokens=None,
    fused=False,
    drop_and_pad=False,
    tokens_per_expert=None,
    align_size=0,
):
    """megatron's ``moe_utils.permute`` (same signature and results)."""
    if not _applies(tokens, routing_map, num_out_tokens, fused, drop_and_pad):
        original = _state["originals"][0]
        return original(
            tokens, routing_map, probs, num_out_tokens, fused, drop_and_pad, tokens_per_expert, align_size
        )
    num_tokens = tokens.shape[0]
    # megatron's order: routed rows grouped by expert, tokens ascending within an expert
    flat_sorted = routing_map.bool().T.contiguous().reshape(-1).argsort(descending=True, stable=True)
    flat_sorted = flat_sorted[:num_out_tokens]
    sorted_indices = flat_sorted % num_tokens
    permuted_probs = probs.T.contiguous().reshape(-1)[flat_sorted] if probs is not None else None
    permuted = _GatherRows.apply(tokens, sorted_indices, num_out_tokens // num_tokens)
    return permuted, permuted_probs, sorted_indices, None, tokens_per_expert


def unpermute(
    permuted_tokens,
    sorted_indices,
    restore_shape,
    probs=None,
    routing_map=None,
    fused=False,
    drop_and_pad=False,
    pad_offsets=None,
):
    """megatron's ``moe_utils.unpermute`` (same signature and results)."""
    num_tokens = restore_shape[0]
    routed = sorted_indices.numel()
    if (
        probs is not None
        or pad_offsets is not None
        or num_tokens == 0
        or not _applies(permuted_tokens, routing_map, routed, fused, drop_and_pad)
        or routed % num_tokens
    ):
        original = _state["originals"][1]
        return original(
            permuted_tokens,
            sorted_indices,
            restore_shape,
            probs,
            routing_map,
            fused,
            drop_and_pad,
            pad_offsets,
        )
    return _SumRows.apply(permuted_tokens, sorted_indices, num_tokens, routed // num_tokens)


def install(mode: str, config) -> None:
    """Route megatron's token dispatchers through :func:`permute` / :func:`unpermute` in ``mode``.

    A model that may drop tokens (expert capacity) switches this process to megatron's path for good:
    the k-rows-per-token shape the gathers rely on does not hold there."""
    if mode not in _MODES:
        raise ValueError(f"trainer.kernels.moe_permute={mode!r}: choose one of {', '.join(_MODES)}")
    from megatron.core.transformer.moe import token_dispatcher

    if _state["originals"] is None:
        _state["originals"] = (token_dispatcher.permute, token_dispatcher.unpermute)
        token_dispatcher.permute = permute
        token_dispatcher.unpermute = unpermute
    if config.moe_expert_capacity_factor is not None or config.moe_pad_expert_input_to_capacity:
        _state["dropping"] = True
    _state["experts"].add(config.num_moe_experts)
    _state["mode"] = mode
