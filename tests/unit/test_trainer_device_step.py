"""trainer/device_step.py on CPU: the gradient normalisation and clip handed to fused Adam as its
grad_scale, against megatron-core's step, in fp32.

torch's fused AdamW also runs on CPU (and takes ``grad_scale`` there), so the whole device step (the kept
1 / tokens factor, the norm of the unscaled gradients, the clip coefficient, the chained distributed
optimizer's step) runs here; tidal switches Adam to the fused kernel only for CUDA parameters, so the test
sets it by hand. A child process: megatron's parallel state is process-wide.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from tidal.model_config import ModelConfig
    from tidal.trainer import models, parallel
    from tidal.trainer.config import KernelConfig, LossConfig, OptimizerConfig
    from tidal.trainer.fused_optim import _torch_optimizers
    from tidal.trainer.mesh import MeshConfig
    from tidal.trainer.optimizer import build_train_state
    from tidal.trainer.step import train_step
    from tidal.trainer.synthetic import make_loss, plan, synthetic_groups

    extra = json.loads(sys.argv[1])
    model = ModelConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=128, **extra)
    parallel.init_parallel(MeshConfig(), model, seed=0)
    groups = synthetic_groups(vocab_size=64, groups=4, group_size=4, prompt_len=(8, 16),
                              response_len=(8, 24), seed=0)
    minibatch = plan(groups, dp_size=1, max_tokens=256, pad_multiple=8)
    loss_fn = make_loss("sft", LossConfig(kind="sft"), minibatch.normalizer, 0)

    def run(grad_scale, clip):
        tconfig = models.transformer_config(model, MeshConfig())
        chunks = models.build_model(model, tconfig, seed=1, kernels=KernelConfig(grad_scale=grad_scale))
        state = build_train_state(chunks, tconfig, OptimizerConfig(lr=1e-2, clip_grad=clip), total_steps=3)
        for opt in _torch_optimizers(state.optimizer):
            for group in opt.param_groups:
                group["fused"], group["foreach"] = True, False
        before = torch.cat([p.detach().flatten() for p in chunks[0].parameters()])
        steps = [train_step(state, minibatch.micro_batches(0), loss_fn) for _ in range(3)]
        params = torch.cat([p.detach().flatten() for p in chunks[0].parameters()])
        used = state._tidal_device_step is not None
        return [s.loss for s in steps], [s.grad_norm for s in steps], params, used, params - before

    out = {}
    for clip in (0.05, 1e6):  # the clip active at every step; never active
        ref = run("megatron", clip)
        got = run("fused", clip)
        out[str(clip)] = dict(
            used=[ref[3], got[3]],
            ref_norms=ref[1],
            norm_rel=[abs(a - b) / b for a, b in zip(got[1], ref[1])],
            loss_rel=[abs(a - b) / abs(b) for a, b in zip(got[0], ref[0])],
            param_diff=float((got[2] - ref[2]).abs().max()),
            update_max=float(ref[4].abs().max()),
            param_change=float((ref[2] - run("megatron", clip)[2]).abs().max()),
        )
    print(json.dumps(out))
    parallel.shutdown()
    """
)


@pytest.mark.parametrize(
    "extra",
    [
        {"family": "qwen3"},
        {"family": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ],
)
def test_fused_grad_scale_steps_like_megatron_in_fp32(extra):
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(extra)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for clip, r in result.items():
        assert r["used"] == [False, True], r  # megatron's step, then the device step
        assert r["param_change"] == 0.0, r  # runs are deterministic, so any difference is the step's
        if clip == "0.05":
            assert min(r["ref_norms"]) > 0.05, r  # the clip coefficient was below 1 at every step
        # fp32 everywhere: the factor applied once inside Adam instead of twice in memory is rounding only;
        # Adam's normalised step magnifies it where a gradient is near zero, so parameters are compared
        # against the size of the update (3 steps of lr 1e-2)
        assert max(r["norm_rel"]) < 1e-5 and max(r["loss_rel"]) < 1e-6, r
        assert r["param_diff"] < 1e-3 * r["update_max"], r
