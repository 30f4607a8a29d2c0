"""Training-step throughput of tidal's megatron-core trainer beside a plain PyTorch + transformers loop.

Both train the same architecture (built from one ModelConfig) on the same token count per step, in the same
process: fixed-length random sequences, next-token NLL on every token, Adam. tidal packs the sequences
(THD, one micro-batch) and runs megatron's schedule and distributed optimizer at world size 1; the baseline
runs ``AutoModelForCausalLM`` on a padded-free ``[batch, seq]`` tensor with ``torch.optim.AdamW``.
Prints a table (median over the timed steps) and writes JSON with ``--out``. On CUDA (bf16) it also reports
model FLOPs utilisation: 6 * active parameters * tokens + causal attention, over the GPU's peak.

    python benchmarks/trainer_throughput.py --out runs/bench/trainer_cpu.json
    python benchmarks/trainer_throughput.py --device cuda --size dense-1b --out trainer_h200_dense.json
    python benchmarks/trainer_throughput.py --device cuda --size moe-small --out trainer_h200_moe.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from tidal.model_config import ModelConfig

SIZES = {
    "tiny": dict(  # configs/tiny.yaml's model
        family="qwen3_moe",
        vocab_size=32,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        max_position_embeddings=4096,
    ),
    "tiny-dense": dict(
        family="qwen3",
        vocab_size=32,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        max_position_embeddings=4096,
    ),
    "dense-1b": dict(  # Qwen3-1.7B's shape with 20 layers: ~1.2B parameters without embeddings
        family="qwen3",
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=20,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=6144,
        max_position_embeddings=8192,
    ),
    "moe-small": dict(  # a Qwen3-MoE of ~2.4B total / ~0.6B active parameters
        family="qwen3_moe",
        vocab_size=151936,
        hidden_size=1024,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=3072,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=768,
        max_position_embeddings=8192,
    ),
}

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def active_params(m: ModelConfig) -> tuple[int, int]:
    """(parameters a token passes through excluding embeddings, total parameters)."""
    h, L = m.hidden_size, m.num_hidden_layers
    attn = h * m.head_dim * (m.num_attention_heads * 2 + m.num_key_value_heads * 2)
    dense_mlp = 3 * h * m.intermediate_size
    if m.is_moe:
        expert = 3 * h * m.moe_intermediate_size
        mlp_active, mlp_total = expert * m.num_experts_per_tok + h * m.num_experts, expert * m.num_experts
    else:
        mlp_active = mlp_total = dense_mlp
    out = h * m.vocab_size
    return L * (attn + mlp_active) + out, L * (attn + mlp_total) + 2 * out


def step_flops(m: ModelConfig, batch: int, seq: int) -> float:
    tokens = batch * seq
    active, _ = active_params(m)
    # causal attention: QK^T and AV, half the square, 3x for forward + backward
    attention = 3 * 2 * 2 * m.num_hidden_layers * m.num_attention_heads * m.head_dim * batch * seq * seq / 2
    return 6 * active * tokens + attention


def synthetic_tokens(m: ModelConfig, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, m.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(run_step, device: str, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        run_step()
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        run_step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def bench_tidal(m: ModelConfig, args, tokens: torch.Tensor) -> list[float]:
    from tidal.broker.types import Sample
    from tidal.trainer import models, parallel
    from tidal.trainer.config import LossConfig, OptimizerConfig
    from tidal.trainer.mesh import MeshConfig
    from tidal.trainer.optimizer import build_train_state
    from tidal.trainer.packing import SequenceItem, plan_minibatch
    from tidal.trainer.step import train_step
    from tidal.trainer.synthetic import make_loss

    mesh = MeshConfig()
    parallel.init_parallel(mesh, m, seed=0)
    bf16 = args.device == "cuda"
    tconfig = models.transformer_config(m, mesh, bf16=bf16)
    chunks = models.build_model(m, tconfig, seed=0)
    state = build_train_state(chunks, tconfig, OptimizerConfig(lr=1e-5, clip_grad=1.0), total_steps=1000)
    import numpy as np

    items = []
    for row in tokens.numpy():
        # one prompt token, the rest is response: every position but the last is trained (as the baseline)
        r = len(row) - 1
        sample = Sample(
            prompt_ids=row[:1].astype(np.int32),
            response_ids=row[1:].astype(np.int32),
            logprobs=np.zeros(r, np.float32),
            versions=np.zeros(r, np.int32),
            reward=0.0,
            finish_reason="stop",
        )
        items.append(SequenceItem(sample))
    plan = plan_minibatch(items, dp_size=1, max_tokens=args.batch * args.seq_len)
    micro_batches = plan.micro_batches(0)
    loss_fn = make_loss("sft", LossConfig(), plan.normalizer)
    times = time_steps(
        lambda: train_step(state, micro_batches, loss_fn), args.device, args.warmup, args.steps
    )
    parallel.shutdown()
    return times


def bench_transformers(m: ModelConfig, args, tokens: torch.Tensor) -> list[float]:
    from transformers import AutoModelForCausalLM

    hf_config = m.to_hf_config()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).to(args.device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = tokens.to(args.device)

    def run_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return time_steps(run_step, args.device, args.warmup, args.steps)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    m = ModelConfig(**SIZES[args.size])
    m = m.model_copy(update={"max_position_embeddings": max(m.max_position_embeddings, args.seq_len)})
    tokens = synthetic_tokens(m, args.batch, args.seq_len)
    n_tokens = args.batch * args.seq_len
    results = {}
    # tidal first: megatron's parallel state must be torn down before the baseline allocates
    for name, fn in (("tidal (megatron-core)", bench_tidal), ("transformers + AdamW", bench_transformers)):
        times = fn(m, args, tokens)
        med = statistics.median(times)
        results[name] = {"median_s": med, "tokens_per_s": n_tokens / med, "times_s": times}
    base = results["transformers + AdamW"]["tokens_per_s"]
    peak = None
    if args.device == "cuda":
        gpu = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in gpu), None)
    flops = step_flops(m, args.batch, args.seq_len)
    print(f"{args.size} ({m.family}), {args.batch} x {args.seq_len} tokens per step, device {args.device}")
    print(f"{'implementation':<24} {'median s/step':>14} {'tokens/s':>12} {'vs baseline':>12} {'MFU':>7}")
    for name, r in results.items():
        r["ratio_vs_baseline"] = r["tokens_per_s"] / base
        r["mfu"] = flops / r["median_s"] / (peak * 1e12) if peak else None
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(
            f"{name:<24} {r['median_s']:>14.4f} {r['tokens_per_s']:>12.0f} {r['ratio_vs_baseline']:>11.2f}x {mfu:>7}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        active, total = active_params(m)
        args.out.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "model": m.model_dump(),
                    "active_params": active,
                    "total_params": total,
                    "step_flops": flops,
                    "peak_bf16_tflops": peak,
                    "host": platform.node(),
                    "cpus": os.cpu_count(),
                    "device_name": torch.cuda.get_device_name()
                    if args.device == "cuda"
                    else platform.processor(),
                    "results": results,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
