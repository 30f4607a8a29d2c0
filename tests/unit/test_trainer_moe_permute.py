"""The gather-based MoE permutation against megatron-core's scatter-add one (CPU, fp32 and bf16)."""

import pytest
import torch
from megatron.core.transformer.moe import moe_utils, token_dispatcher

from tidal.trainer import moe_permute


class _Config:
    def __init__(self, experts: int, capacity=None):
        self.num_moe_experts = experts
        self.moe_expert_capacity_factor = capacity
        self.moe_pad_expert_input_to_capacity = False


@pytest.fixture(autouse=True)
def _restore():
    saved = {key: moe_permute._state[key] for key in ("mode", "dropping")}
    saved["experts"] = set(moe_permute._state["experts"])
    yield
    moe_permute._state.update(saved)  # the dispatchers keep the wrappers, which then defer to megatron


def _routing(tokens: int, experts: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    top = scores.topk(k, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.softmax(scores, -1) * routing_map
    return routing_map, probs


def _round_trip(permute, unpermute, x, routing_map, probs, k):
    x = x.detach().clone().requires_grad_()
    probs = probs.detach().clone().requires_grad_()
    permuted, permuted_probs, indices, _, _ = permute(
        x, routing_map, probs=probs, num_out_tokens=x.shape[0] * k
    )
    rows = permuted * permuted_probs.unsqueeze(-1).to(permuted.dtype)
    out = unpermute(rows, indices, restore_shape=x.shape, routing_map=routing_map)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    (out.float() * weights.float()).sum().backward()
    return permuted.detach(), out.detach(), x.grad, probs.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_permutation_matches_megatrons(dtype):
    tokens, experts, k, hidden = 96, 8, 3, 16
    moe_permute.install("gather", _Config(experts))
    routing_map, probs = _routing(tokens, experts, k)
    x = torch.randn(tokens, hidden).to(dtype)
    ours = _round_trip(moe_permute.permute, moe_permute.unpermute, x, routing_map, probs, k)
    theirs = _round_trip(moe_utils.permute, moe_utils.unpermute, x, routing_map, probs, k)
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0)  # the same rows in the same order
    # sums of k rows: ours accumulates in fp32 and rounds once, megatron adds in the rows' dtype
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    for got, want in zip(ours[1:], theirs[1:], strict=True):
        torch.testing.assert_close(got.float(), want.float(), **tol)


def test_the_dispatchers_use_it_once_installed():
    moe_permute.install("gather", _Config(8))
    assert token_dispatcher.permute is moe_permute.permute
    assert token_dispatcher.unpermute is moe_permute.unpermute


def test_maps_that_do_not_route_every_token_k_times_take_megatrons_path(monkeypatch):
    calls = []
    originals = moe_permute._state["originals"] or (moe_utils.permute, moe_utils.unpermute)
    moe_permute.install("gather", _Config(8))
    monkeypatch.setitem(
        moe_permute._state,
        "originals",
        (
            lambda *a: calls.append("permute") or originals[0](*a),
            lambda *a: calls.append("unpermute") or originals[1](*a),
        ),
    )
    routing_map, probs = _routing(64, 8, 2)
    local = routing_map[:, :4].contiguous()  # a rank's local experts: tokens routed 0..2 times here
    x = torch.randn(64, 8)
    routed = int(local.sum())
    _, _, indices, _, _ = moe_permute.permute(x, local, num_out_tokens=routed)
    moe_permute.unpermute(torch.randn(routed, 8), indices, restore_shape=x.shape, routing_map=local)
    assert calls == ["permute", "unpermute"]
    calls.clear()
    moe_permute.install("gather", _Config(8, capacity=1.25))  # a model that drops tokens: never again
    moe_permute.permute(x, routing_map, num_out_tokens=128)
    assert calls == ["permute"]


def test_unknown_mode_names_the_setting():
    with pytest.raises(ValueError, match="trainer.kernels.moe_permute='fast'"):
        moe_permute.install("fast", _Config(8))
