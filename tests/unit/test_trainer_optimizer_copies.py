"""The distributed optimizer's batched shard copies (trainer.kernels.multi_tensor=foreach) change nothing.

A child process (megatron's parallel state is process-wide) trains two copies of a small MoE (8 experts a
layer, so many parameter tensors) for three GRPO steps from the same initialisation and batches: one with
megatron-core's per-parameter copy loops, one with tidal's batched copies. Every parameter and every
master shard must be bitwise equal after each step.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tidal.procs import free_port

_CHILD = textwrap.dedent(
    """
    import json, torch
    import torch.distributed as dist
    from tidal.model_config import ModelConfig
    from tidal.trainer import fused_optim, models, parallel, synthetic
    from tidal.trainer.config import KernelConfig, LossConfig, OptimizerConfig
    from tidal.trainer.mesh import MeshConfig
    from tidal.trainer.optimizer import build_train_state
    from tidal.trainer.step import train_step

    model = ModelConfig(family="qwen3_moe", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    mesh = MeshConfig()
    parallel.init_parallel(mesh, model, seed=0)
    batch = synthetic.plan(synthetic.synthetic_groups(vocab_size=64, groups=4, group_size=4),
                           dp_size=1, max_tokens=4096, pad_multiple=1)
    loss_fn = synthetic.make_loss("grpo", LossConfig(), batch.normalizer)

    def state():
        # bf16 parameters with fp32 master shards (fp32 parameters are their own masters: nothing to copy)
        tconfig = models.transformer_config(model, mesh, bf16=True)  # one config each: DDP hooks into it
        chunks = models.build_model(model, tconfig, seed=3, kernels=KernelConfig())
        return build_train_state(chunks, tconfig, OptimizerConfig(lr=1e-2, clip_grad=1.0), total_steps=10)

    batched, reference = state(), state()
    original = fused_optim.batch_shard_copies
    switched = original(batched.optimizer)
    fused_optim.batch_shard_copies = lambda optimizer: 0  # the reference keeps megatron's loops
    differences, tensors = [], 0
    for step in range(3):
        fused_optim.batch_shard_copies = original
        train_step(batched, batch.micro_batches(0), loss_fn)
        fused_optim.batch_shard_copies = lambda optimizer: 0
        train_step(reference, batch.micro_batches(0), loss_fn)
        a = dict(batched.chunks[0].named_parameters())
        b = dict(reference.chunks[0].named_parameters())
        tensors = len(a)
        differences += [f"{step}:{n}" for n in a if not torch.equal(a[n], b[n])]
        masters = lambda s: [p for g in s.optimizer.optimizer.param_groups for p in g["params"]]
        differences += [f"{step}:master{i}" for i, (x, y) in enumerate(zip(masters(batched), masters(reference)))
                        if not torch.equal(x, y)]
    if dist.get_rank() == 0:
      print(json.dumps({"switched": switched, "differences": differences, "tensors": tensors, "dp": dist.get_world_size(),
                        "reference_has_no_plan": getattr(reference.optimizer, "_tidal_batched_copies", None) is None}))
    parallel.shutdown()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_batched_shard_copies_train_bitwise_like_megatrons_loops(nproc, tmp_path):
    """nproc 2: data parallel, each rank's master shards cover half of each bucket."""
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--master-port",
        str(free_port()),
        str(script),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["switched"] == 1 and result["reference_has_no_plan"], result
    assert result["tensors"] > 30, result  # experts' per-expert tensors included
    assert result["dp"] == nproc, result
    assert result["differences"] == [], result
