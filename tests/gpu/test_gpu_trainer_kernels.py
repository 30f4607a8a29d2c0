"""The trainer's CUDA fast paths against their reference paths in bf16 (child: ``child_trainer_kernels.py``).

Each error is the largest absolute difference from an fp32 computation of the same bf16-rounded inputs,
over the fp32 result's largest magnitude, taken over outputs and every gradient. The fast path must be as
accurate as the reference path it replaces when that path runs in bf16: within 1.5x its error plus 1e-3
(bf16 keeps 8 mantissa bits, 2**-8 ~ 4e-3 relative per value; summation order differs between kernels).
Absolute ceilings back this up: 2e-2 for attention (softmax of bf16 scores) and the expert GEMMs.
"""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.gpu

NO_WORSE = 1.5
SLACK = 1e-3
CEILING = 2e-2


@pytest.fixture(scope="module")
def results(child, tmp_path_factory) -> dict:
    log = tmp_path_factory.mktemp("trainer_kernels") / "child.log"
    return child("child_trainer_kernels.py", timeout_s=300, log=log)


def test_flash_varlen_attention_is_as_accurate_as_sdpa(results):
    r = results["attention"]
    assert r["flash_err"] <= NO_WORSE * r["sdpa_bf16_err"] + SLACK, r
    assert r["flash_err"] <= CEILING, r


def test_fixed_length_batches_through_batched_sdpa_are_as_accurate_as_sdpa(results):
    r = results["attention"]
    assert r["batched_sdpa_err"] <= NO_WORSE * r["sdpa_bf16_err"] + SLACK, r
    assert r["batched_sdpa_err"] <= CEILING, r


def test_flash_varlen_context_parallel_chunks_match_full_causal_attention(results):
    # the real kernel's bottom-right causal alignment is what makes each CP chunk see its sequence prefix
    assert results["attention"]["flash_cp_err"] <= CEILING, results["attention"]


def test_grouped_mm_expert_gemm_is_as_accurate_as_the_loop(results):
    r = results["experts"]
    assert r["grouped_mm_err"] <= NO_WORSE * r["loop_bf16_err"] + SLACK, r
    assert r["grouped_mm_err"] <= CEILING, r


def test_grouped_experts_module_matches_sequential_mlp(results):
    r = results["moe_experts"]
    assert r["kinds"] == {"reference": "SequentialMLP", "fast": "GroupedExperts"}, r
    assert r["fast_err"] <= NO_WORSE * r["reference_bf16_err"] + SLACK, r
    assert r["empty_expert_grad_max"] == 0.0, r  # experts that got no token get no gradient


def test_dense_model_with_fast_kernels_matches_the_reference_kernels(results):
    r = results["dense_model"]
    assert r["fast_err"] <= NO_WORSE * r["reference_bf16_err"] + SLACK, r


def test_train_step_uses_torchs_fused_adam(results):
    r = results["train_step"]
    assert r["adam_groups_fused"] and all(r["adam_groups_fused"]), r
    assert all(math.isfinite(x) for x in r["losses"]) and r["losses"][1] < r["losses"][0], r


def test_a_checkpoint_resumes_on_the_gpu_and_steps_as_the_run_it_came_from(results):
    """Saved after two fused-Adam steps and loaded into a fresh model and optimizer: the next two steps'
    losses are the first run's next two, to bf16 rounding of the same arithmetic (1e-3 relative)."""
    r = results["train_step"]
    assert r["resumed_at"] == 2 and r["resumed_step_devices"] == ["cuda:0"], r
    for got, want in zip(r["resumed"], r["continued"], strict=True):
        assert abs(got - want) <= 1e-3 * abs(want), r


def test_fused_grad_scale_matches_megatrons_scale_and_clip(results):
    """Normalisation x clip applied inside fused Adam (no host sync) against megatron multiplying the
    gradient buffer and clipping on the host: the same arithmetic up to fp32 rounding. The first step's
    gradients are the same, so its norm agrees to fp32 rounding (1e-5); after it the bf16 parameter copies
    round some values the other way, and the later norms and the update agree to 1e-2."""
    r = results["device_step"]
    assert not r["reference"]["device_step"] and r["grad_scale"]["device_step"], r
    assert min(r["reference"]["grad_norms"]) > r["reference"]["clip"], r  # the clip was active
    got = r["grad_scale"]
    assert got["first_loss_equal"] and got["grad_norm_rel_steps"][0] < 1e-5, r
    assert max(got["grad_norm_rel_steps"]) < 1e-2 and got["loss_rel"] < 1e-3 and got["update_rel"] < 1e-2, r


def test_accumulating_weight_gradients_match_megatrons_bf16_product(results):
    """The weight-gradient product summed straight into the fp32 main_grad against megatron's bf16 product
    added afterwards: they differ by the bf16 rounding of the product (2**-8 relative per value), which
    the norm and Adam's normalised update see as ~1e-2."""
    r = results["device_step"]
    got = r["grad_scale_and_wgrad"]
    assert got["fusion"] and not r["reference"]["fusion"], r
    assert got["first_loss_equal"], r
    assert max(got["grad_norm_rel_steps"]) < 2e-2 and got["loss_rel"] < 1e-2 and got["update_rel"] < 1e-1, r


def test_gather_token_permutation_trains_like_megatrons_scatter_add(results):
    """Each token's k expert outputs summed by a gather with fp32 accumulation against megatron's bf16
    scatter-add: the bf16 rounding of those sums (2**-8 relative) is the only difference."""
    r = results["moe_permute"]
    assert r["mode_after"] == "gather", r
    assert r["loss_rel"] < 1e-2 and max(r["grad_norm_rel_steps"]) < 5e-2 and r["update_rel"] < 2e-1, r
