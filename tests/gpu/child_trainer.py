"""Train small megatron-core models with tidal's trainer (builders, dist_opt, train_step); print JSON.

    python child_trainer.py CASE [CASE ...]     CASE = family:precision:loss:steps, e.g. qwen3:bf16:sft:8

One process, world size 1 (NCCL on CUDA; on a host without CUDA the trainer's CPU support takes over, which
is how this script's logic is checked off the accelerator). Every case trains from the same seed on the
same fixed synthetic batch, so cases differing only in precision start from the same weights.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from tidal.model_config import ModelConfig
from tidal.trainer import models, parallel
from tidal.trainer.config import LossConfig, OptimizerConfig
from tidal.trainer.mesh import MeshConfig
from tidal.trainer.optimizer import build_train_state
from tidal.trainer.step import train_step
from tidal.trainer.synthetic import make_loss, plan, synthetic_groups

SHAPE = dict(
    vocab_size=512,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
)
FAMILIES = {
    "qwen3": dict(family="qwen3"),
    "qwen3_moe": dict(family="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128),
}


def run_case(family: str, precision: str, loss: str, steps: int) -> dict:
    model = ModelConfig(**SHAPE, **FAMILIES[family])
    mesh = MeshConfig()
    parallel.init_parallel(mesh, model, seed=0)
    tconfig = models.transformer_config(model, mesh, bf16=precision == "bf16")
    chunks = models.build_model(model, tconfig, seed=1)
    param = next(chunks[0].parameters())
    state = build_train_state(chunks, tconfig, OptimizerConfig(lr=1e-3, clip_grad=1.0), total_steps=steps)
    groups = synthetic_groups(
        vocab_size=model.vocab_size,
        groups=8,
        group_size=4,
        prompt_len=(16, 48),
        response_len=(16, 96),
        seed=0,
    )
    minibatch = plan(groups, dp_size=1, max_tokens=2048, pad_multiple=8)
    micro_batches = minibatch.micro_batches(0)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    losses, norms, seconds, tokens = [], [], [], 0
    for version in range(steps):
        loss_fn = make_loss(loss, LossConfig(kind=loss), minibatch.normalizer, version)
        result = train_step(state, micro_batches, loss_fn)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        losses.append(result.loss)
        norms.append(result.grad_norm)
        seconds.append(result.seconds)
        tokens = result.tokens
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    return dict(
        losses=losses,
        grad_norms=norms,
        step_seconds=seconds,
        tokens_per_step=tokens,
        micro_batches=len(micro_batches),
        param_dtype=str(param.dtype),
        param_device=param.device.type,
        peak_mib=peak,
    )


def main() -> None:
    results = {}
    for case in sys.argv[1:]:
        family, precision, loss, steps = case.split(":")
        started = time.perf_counter()
        results[case] = run_case(family, precision, loss, int(steps))
        results[case]["wall_s"] = time.perf_counter() - started
        print(f"{case}: losses {[round(x, 4) for x in results[case]['losses']]}", file=sys.stderr)
    parallel.shutdown()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
