"""The tiny Qwen3.5 (Gated DeltaNet + gated attention + MoE) trains, exports and matches transformers on CUDA.

Needs CUDA and flash-linear-attention (megatron-core's GatedDeltaNet runs fla's Triton kernels; there is
no CPU path). The child (``child_families_qwen3_5.py``) measures; this file judges:

- fp32: megatron-core's logits equal transformers' within ``FP32_RTOL`` of the largest logit, for a batch
  and for two sequences packed in one THD row (the trainer's layout);
- bf16: megatron-core in bf16 is as close to the fp32 reference as transformers in bf16 is, within a
  factor ``BF16_FACTOR`` (both round weights and activations to 8 mantissa bits; the two implementations
  round in different places), and never further than ``BF16_RTOL`` of the largest logit, on the tokens
  that precede their sequence's first token whose experts differ from the reference's in some layer (a
  near-tie of router scores rounded the other way; the change carries to every later token); such flips
  happen on no more tokens than ``FLIP_FACTOR`` x transformers' own in bf16 plus ``FLIP_SLACK``;
- one GRPO step with the distributed optimizer is finite and moves every parameter, Gated DeltaNet's too
  (``trainer.kernels.gated_delta_rule=auto``: fla's kernel, or megatron's torch rule where fla refuses its
  backward, as on the H200's Triton 3.6);
- the weights after the step, exported through the weight mapping (what weights_sync sends), map back to
  the trained parameters bitwise, and loaded by the embedded engine's loader into transformers' Qwen3.5
  give megatron-core's logits (fp32 bounds for a megatron-core model of the export, bf16 bounds for the
  trained model).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

# fla's Triton kernels multiply fp32 inputs in TF32 (10-bit mantissa, relative 2**-11 per product)
FP32_RTOL = 5e-3
BF16_FACTOR = 2.0
BF16_RTOL = 5e-2
# a token whose router scores nearly tie may pick another expert once activations are rounded to bf16 (a
# discrete jump of its logits, in transformers' bf16 as in megatron-core's); such tokens are counted, and
# megatron-core may flip at most twice as many as transformers does plus 4 of the 48 tokens
FLIP_FACTOR = 2.0
FLIP_SLACK = 4 / 48
# a flipped token changes every later token of its sequence (attention, the DeltaNet's recurrence): the
# logits are compared on the tokens before a sequence's first flip, which must be at least a quarter
MIN_COMPARABLE = 0.25


def _fla_skip_reason() -> str | None:
    try:
        import fla  # noqa: F401
    except ImportError:
        return (
            "needs flash-linear-attention (pip install fla-core, the gpu extra): megatron-core's GatedDeltaNet "
            "runs its Triton kernels"
        )
    return None


@pytest.fixture(scope="module")
def run(child, tmp_path_factory) -> dict:
    reason = _fla_skip_reason()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("qwen3_5")
    return child("child_families_qwen3_5.py", str(work), timeout_s=480, log=work / "child.log")


def test_checkpoint_loads_completely(run):
    assert run["device"].startswith("cuda")
    assert run["fla"]
    assert run["not_loaded"] == []


def test_gated_delta_rule_is_flas_unless_fla_refuses_its_backward(run):
    # trainer.kernels.gated_delta_rule=auto: fla's kernel, or the torch-native rule where fla raises in the
    # backward (Hopper with Triton 3.4 to 3.7.0: fla issue #640)
    want = "fla" if run["fla_backward_refusal"] is None else "torch"
    assert run["gated_delta_rule"] == want, run


@pytest.mark.parametrize("layout", ["batch", "packed"])
def test_fp32_logits_match_transformers(run, layout):
    assert run[f"fp32_{layout}"]["all"] < FP32_RTOL, run


def check_bf16(result: dict, reference: dict, what: str) -> None:
    """megatron-core in bf16 (``result``) against the fp32 reference, beside transformers in bf16
    (``reference``): it changes experts no more often, and on the comparable tokens it is as close."""
    assert result["flipped"] <= FLIP_FACTOR * reference["flipped"] + FLIP_SLACK, (what, result, reference)
    assert result["comparable_fraction"] >= MIN_COMPARABLE, (what, result, reference)
    assert result["comparable"] < BF16_RTOL, (what, result, reference)
    reference_error = reference["comparable"] if reference["comparable_fraction"] > 0 else reference["all"]
    assert result["comparable"] <= BF16_FACTOR * reference_error + FP32_RTOL, (what, result, reference)


@pytest.mark.parametrize("layout", ["batch", "packed"])
def test_bf16_logits_match_transformers(run, layout):
    check_bf16(run[f"bf16_{layout}"], run[f"transformers_bf16_{layout}"], layout)


def test_one_train_step_moves_every_trained_parameter(run):
    assert run["step_finite"] and run["step_update_successful"], run
    assert run["step_grad_norm"] > 0
    # Adam's first step moves every parameter that has a gradient; only a routed expert that no token of
    # the batch chose may have none
    assert all(".mlp.experts." in n for n in run["params_unchanged"]), run["params_unchanged"]
    gdn = [n for n in run["params"] if ".layers.0.self_attention." in n]
    assert {n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] for n in gdn} >= {
        "self_attention.A_log",
        "self_attention.dt_bias",
        "in_proj.weight",
        "conv1d.weight",
        "out_norm.weight",
        "out_proj.weight",
    }, gdn


def test_exported_weights_are_the_trained_ones_and_give_megatron_logits_in_transformers(run):
    assert run["exported_names_match"]
    # the export mapped back equals every trained parameter bitwise
    assert run["reimport_compared"] == run["reimport_trained_params"] > 0, run
    assert run["reimport_mismatch"] == [], run["reimport_mismatch"]
    # fp32: a megatron-core model of the export against transformers loaded by the engine's loader
    assert run["synced_fp32"]["all"] < FP32_RTOL, run["synced_fp32"]
    # bf16: the trained model itself against that fp32 reference, beside transformers in bf16
    check_bf16(run["synced_bf16"], run["synced_transformers_bf16"], "synced")
