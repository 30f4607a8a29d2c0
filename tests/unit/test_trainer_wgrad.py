"""megatron's gradient-accumulation fusion as tidal installs it (trainer/wgrad.py), on CPU.

The fused product itself needs CUDA (tests/gpu/test_gpu_trainer_kernels.py compares it with megatron's
path there). Here: megatron's linear layers built with the fusion still run forward and backward, and a
weight without ``main_grad`` (a model outside megatron's DDP wrapper) gets the plain gradient, equal to a
model built without the fusion. A child process: megatron's parallel state is process-wide.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
    """
    import json, torch
    from tidal.model_config import ModelConfig
    from tidal.trainer import models, parallel, wgrad
    from tidal.trainer.mesh import MeshConfig

    model = ModelConfig(family="qwen3", vocab_size=64, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128)
    parallel.init_parallel(MeshConfig(), model, seed=0)

    def grads(fusion):
        tconfig = models.transformer_config(model, MeshConfig())
        if fusion:
            wgrad.install()
            tconfig.gradient_accumulation_fusion = True
        net = models.build_model(model, tconfig, seed=3)[0]
        ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
        pos = torch.arange(16)[None]
        net(ids, pos, None).float().square().mean().backward()
        fused_layers = sum(bool(getattr(m, "gradient_accumulation_fusion", False)) for m in net.modules())
        return {n: p.grad for n, p in net.named_parameters()}, fused_layers

    plain, _ = grads(False)
    fused, fused_layers = grads(True)
    print(json.dumps(dict(
        fused_layers=fused_layers,
        all_grads=all(g is not None for g in fused.values()),
        equal=all(torch.equal(fused[n], g) for n, g in plain.items()),
    )))
    parallel.shutdown()
    """
)


def test_fused_linear_layers_without_main_grad_train_like_plain_ones():
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["fused_layers"] > 0, result  # the layers were built with the fusion on
    assert result["all_grads"] and result["equal"], result
