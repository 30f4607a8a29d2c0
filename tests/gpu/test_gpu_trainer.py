"""megatron-core trainer steps on CUDA in bf16 with tidal's own builders, optimizer and train step.

The child (``child_trainer.py``) builds the dense (qwen3) and MoE (qwen3_moe) models with megatron-core's
local spec (no Transformer Engine on the device), wraps them in megatron's DDP with the distributed
optimizer, and trains on a fixed synthetic batch. bf16 and fp32 runs start from the same seeded weights.
"""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.gpu

FAMILIES = ["qwen3", "qwen3_moe"]
SFT_STEPS = 8
GRPO_STEPS = 3
# bf16 rounds weights and activations to 8 mantissa bits (relative 2**-8 per value); the loss averages
# thousands of per-token terms, so its first value stays within 2% of the fp32 loss of the same weights.
BF16_LOSS_RTOL = 2e-2


@pytest.fixture(scope="module")
def runs(child, tmp_path_factory) -> dict:
    cases = []
    for family in FAMILIES:
        cases += [
            f"{family}:bf16:sft:{SFT_STEPS}",
            f"{family}:fp32:sft:1",
            f"{family}:bf16:grpo:{GRPO_STEPS}",
        ]
    log = tmp_path_factory.mktemp("trainer") / "child.log"
    return child("child_trainer.py", *cases, timeout_s=480, log=log)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_model_lives_on_cuda(runs, family):
    run = runs[f"{family}:bf16:sft:{SFT_STEPS}"]
    assert run["param_device"] == "cuda"
    assert run["param_dtype"] == "torch.bfloat16"
    assert runs[f"{family}:fp32:sft:1"]["param_dtype"] == "torch.float32"


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_sft_steps_learn_the_fixed_batch(runs, family):
    run = runs[f"{family}:bf16:sft:{SFT_STEPS}"]
    losses, norms = run["losses"], run["grad_norms"]
    assert len(losses) == SFT_STEPS
    assert all(math.isfinite(x) for x in losses + norms), (losses, norms)
    assert all(n > 0 for n in norms)
    # the batch is fixed: Adam at lr 1e-3 must fit it (fp32 on CPU: 6.28 -> 4.32 in 6 steps)
    assert losses[-1] < 0.85 * losses[0], losses
    assert run["tokens_per_step"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_first_loss_matches_fp32(runs, family):
    bf16 = runs[f"{family}:bf16:sft:{SFT_STEPS}"]["losses"][0]
    fp32 = runs[f"{family}:fp32:sft:1"]["losses"][0]
    assert bf16 == pytest.approx(fp32, rel=BF16_LOSS_RTOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_grpo_steps_are_finite(runs, family):
    run = runs[f"{family}:bf16:grpo:{GRPO_STEPS}"]
    assert len(run["losses"]) == GRPO_STEPS
    assert all(math.isfinite(x) for x in run["losses"] + run["grad_norms"]), run
    assert all(n > 0 for n in run["grad_norms"]), run["grad_norms"]
