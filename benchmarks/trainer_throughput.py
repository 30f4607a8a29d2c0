"""Training-step throughput of tidal's megatron-core trainer beside a plain PyTorch + transformers loop.

Both train the same architecture (built from one ModelConfig) on the same token count per step, in the same
process: fixed-length random sequences, next-token NLL on every token, Adam, one optimizer step per
``--micro-batches`` micro-batches of ``--batch`` sequences. tidal packs each micro-batch (THD) and runs
megatron's schedule and distributed optimizer at world size 1; the baseline runs ``AutoModelForCausalLM``
on a padded-free ``[batch, seq]`` tensor per micro-batch with ``torch.optim.AdamW``.
Prints a table (median over the timed steps) and writes JSON with ``--out``. On CUDA (bf16) it also reports
model FLOPs utilisation: 6 * active parameters * tokens + causal attention, over the GPU's peak.

    python benchmarks/trainer_throughput.py --out runs/bench/trainer_cpu.json
    python benchmarks/trainer_throughput.py --device cuda --size dense-1b --out trainer_h200_dense.json
    python benchmarks/trainer_throughput.py --device cuda --size moe-small --out trainer_h200_moe.json
    python benchmarks/trainer_throughput.py --device cuda --size dense-1b --batch 2 --seq-len 4096 \
        --profile runs/bench/profile      # + the top-30 kernels of each implementation (text and JSON)
    python benchmarks/trainer_throughput.py --device cuda --size dense-1b --batch 4 --micro-batches 2 \
        --seq-len 4096                    # gradient accumulation: one optimizer step per 2 micro-batches

Every choice of ``trainer.kernels`` (docs/trainer.md, "Kernels") is a flag of the same name (``--attention``,
``--grad-scale``, ``--moe-permute``, ...) to compare each fast path with its reference; ``--impls tidal`` skips the baseline.
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
from typing import Literal, get_args, get_origin

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
    "moe-small": dict(  # issue 8's small MoE: 8 layers, 32 experts top-4 (~1.9B total / ~0.6B active)
        family="qwen3_moe",
        vocab_size=151936,
        hidden_size=1024,
        num_hidden_layers=8,
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
IMPL_KEYS = {"tidal (megatron-core)": "tidal", "transformers + AdamW": "transformers"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    p.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="micro-batches per optimizer step (gradient accumulation, as a real training step runs): "
        "a step trains batch x micro-batches sequences",
    )
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--impls",
        default="tidal,transformers",
        help="comma-separated: which implementations to run (tidal, transformers)",
    )
    for name, choices, default in kernel_choices():  # every trainer.kernels choice, as --name-with-dashes
        p.add_argument(
            f"--{name.replace('_', '-')}", choices=choices, default=default, help=f"trainer.kernels.{name}"
        )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="after timing, profile --profile-steps steps of each implementation (torch.profiler) and write "
        "the top-30 kernels by device time to DIR/<implementation>.txt and .json",
    )
    p.add_argument("--profile-steps", type=int, default=2)
    args = p.parse_args(argv)
    if args.micro_batches < 1:
        p.error(f"--micro-batches {args.micro_batches}: must be at least 1")
    args.impls = [x.strip() for x in args.impls.split(",") if x.strip()]
    unknown = set(args.impls) - set(IMPL_KEYS.values())
    if unknown or not args.impls:
        p.error(f"--impls {','.join(args.impls)}: choose from {', '.join(IMPL_KEYS.values())}")
    return args


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


def setup_tidal(m: ModelConfig, args, tokens: torch.Tensor):
    """(one training step, teardown) of tidal's trainer: each micro-batch packs ``args.batch`` sequences."""
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
    chunks = models.build_model(m, tconfig, seed=0, kernels=kernel_config(args))
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
    assert len(micro_batches) == args.micro_batches, (len(micro_batches), args.micro_batches)
    loss_fn = make_loss("sft", LossConfig(), plan.normalizer)
    return (lambda: train_step(state, micro_batches, loss_fn)), parallel.shutdown


def setup_transformers(m: ModelConfig, args, tokens: torch.Tensor):
    """(one training step, teardown) of a plain transformers model with torch's fused AdamW."""
    from transformers import AutoModelForCausalLM

    hf_config = m.to_hf_config()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).to(args.device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=args.device == "cuda")
    micro_batches = tokens.to(args.device).split(args.batch)

    def run_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for ids in micro_batches:  # equal sizes: the mean of the micro-batch means is the batch's mean
            loss = model(input_ids=ids, labels=ids).loss / len(micro_batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return run_step, lambda: None


def kernel_choices() -> list[tuple[str, tuple[str, ...], str]]:
    """(field, choices, default) of each ``trainer.kernels`` field that is a choice (not a number)."""
    from tidal.trainer.config import KernelConfig

    fields = KernelConfig.model_fields.items()
    return [(n, get_args(f.annotation), f.default) for n, f in fields if get_origin(f.annotation) is Literal]


def kernel_config(args):
    from tidal.trainer.config import KernelConfig

    return KernelConfig(**{name: getattr(args, name) for name, _, _ in kernel_choices()})


# kernel name patterns -> a coarse category, for the profile summary (first match wins)
_CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("grouped gemm", ("grouped", "group_gemm", "groupgemm")),
    ("gemm", ("gemm", "sm90_xmma", "cutlass", "cublas", "matmul", "nvjet", "aten::mm", "addmm", "bmm")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("communication", ("nccl",)),
    ("copy / cast", ("copy", "memcpy", "memset", "cast", "fill")),
    ("reduction", ("reduce", "softmax", "norm", "sum", "max")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise", "triton")),
)


def _category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in _CATEGORIES if any(k in low for k in keys)), "other")


def profile_steps(label: str, run_step, args) -> dict:
    """Profile ``args.profile_steps`` steps; write the top-30 kernels (device time) to ``args.profile``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(args.device)
    t0 = time.perf_counter()
    with profile(activities=activities, record_shapes=cuda) as prof:
        for _ in range(args.profile_steps):
            run_step()
        sync(args.device)
    wall = (time.perf_counter() - t0) / args.profile_steps
    events = prof.key_averages()
    if cuda:
        # GPU-side user annotations (Optimizer.step#...) span kernels already counted: leave them out
        kernels = [
            e
            for e in events
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
        own = [(e, e.self_device_time_total) for e in kernels]
    else:  # CPU: operators by self CPU time (nested operators would count twice in totals)
        own = [(e, e.self_cpu_time_total) for e in events]
    own = [(e, t) for e, t in own if t > 0]
    total_us = sum(t for _, t in own)
    per_step = args.profile_steps
    rows = [
        {
            "name": e.key,
            "category": _category(e.key),
            "calls_per_step": e.count / per_step,
            "ms_per_step": t / 1e3 / per_step,
            "share": t / total_us if total_us else 0.0,
        }
        for e, t in sorted(own, key=lambda x: x[1], reverse=True)
    ]
    categories: dict[str, float] = {}
    for row in rows:
        categories[row["category"]] = categories.get(row["category"], 0.0) + row["ms_per_step"]
    slug = "".join(c if c.isalnum() else "_" for c in label).strip("_")
    args.profile.mkdir(parents=True, exist_ok=True)
    summary = {
        "implementation": label,
        "timed": "device (CUDA kernels, self time)" if cuda else "CPU operators (self time)",
        "steps": per_step,
        "wall_ms_per_step": wall * 1e3,
        "kernel_ms_per_step": total_us / 1e3 / per_step,
        "categories_ms_per_step": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
        "top30": rows[:30],
    }
    (args.profile / f"{slug}.json").write_text(json.dumps(summary, indent=1))
    lines = [
        f"{label}: {summary['timed']}, {per_step} steps; wall {wall * 1e3:.1f} ms/step, "
        f"kernels {summary['kernel_ms_per_step']:.1f} ms/step",
        "",
        "by category (ms/step): "
        + ", ".join(f"{k} {v:.1f}" for k, v in summary["categories_ms_per_step"].items()),
        "",
        f"{'ms/step':>9} {'share':>6} {'calls':>7}  {'category':<14} kernel",
    ]
    for row in rows[:30]:
        lines.append(
            f"{row['ms_per_step']:>9.2f} {100 * row['share']:>5.1f}% {row['calls_per_step']:>7.0f}  "
            f"{row['category']:<14} {row['name'][:160]}"
        )
    (args.profile / f"{slug}.txt").write_text("\n".join(lines) + "\n")
    if cuda:
        _write_operator_table(prof, args.profile / f"{slug}_ops.txt", per_step)
        summary["idle"] = idle_profile(slug, run_step, args)
    print("\n".join(lines[:3]))
    return summary


def idle_profile(slug: str, run_step, args) -> dict:
    """The device's idle gaps and the host stacks they are charged to (benchmarks/gpu_idle.py), from two
    traces: without stack recording (the idle time as timed) and with it (python frames, more host cost)."""
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_idle

    reports, text = {}, []
    for with_stack in (False, True):
        sync(args.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=with_stack) as prof:
            for _ in range(args.profile_steps):
                run_step()
            sync(args.device)
        trace = args.profile / f"{slug}_trace.json"
        prof.export_chrome_trace(str(trace))
        report = gpu_idle.analyse(gpu_idle.load_events(trace), steps=args.profile_steps)
        trace.unlink()
        key = "with_stack" if with_stack else "plain"
        reports[key] = report
        text += [f"== {key} trace", gpu_idle.format_report(report, top=30), ""]
    (args.profile / f"{slug}_idle.txt").write_text("\n".join(text))
    print(text[1].splitlines()[0])
    return reports


def _write_operator_table(prof, path: Path, per_step: int) -> None:
    """The top-40 operators (with input shapes) by the device time of the kernels they launched.

    Kernel names say what ran; this says which operator (and which tensor shapes) asked for it.
    """
    from torch.autograd import DeviceType

    ops = [
        e
        for e in prof.key_averages(group_by_input_shape=True)
        if e.device_type == DeviceType.CPU
        and e.self_device_time_total > 0
        and not getattr(e, "is_user_annotation", False)
    ]
    ops.sort(key=lambda e: e.self_device_time_total, reverse=True)
    lines = [f"{'ms/step':>9} {'calls':>7}  operator [input shapes]"]
    for e in ops[:40]:
        shapes = str(e.input_shapes)[:150]
        lines.append(
            f"{e.self_device_time_total / 1e3 / per_step:>9.2f} {e.count / per_step:>7.0f}  {e.key} {shapes}"
        )
    path.write_text("\n".join(lines) + "\n")


def matmul_tflops(device: str) -> float | None:
    """Measured bf16 GEMM rate (8192^3, median of 10) on CUDA: the practical ceiling beside the datasheet."""
    if device != "cuda":
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del a, b
    return 2 * 8192**3 / statistics.median(times) / 1e12


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    m = ModelConfig(**SIZES[args.size])
    m = m.model_copy(update={"max_position_embeddings": max(m.max_position_embeddings, args.seq_len)})
    sequences = args.batch * args.micro_batches
    tokens = synthetic_tokens(m, sequences, args.seq_len)
    n_tokens = sequences * args.seq_len
    results = {}
    setups = {"tidal (megatron-core)": setup_tidal, "transformers + AdamW": setup_transformers}
    # tidal first: megatron's parallel state must be torn down before the baseline allocates
    for name in [n for n in setups if IMPL_KEYS[n] in args.impls]:
        run_step, teardown = setups[name](m, tokens=tokens, args=args)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            times = time_steps(run_step, args.device, args.warmup, args.steps)
        except torch.OutOfMemoryError as exc:  # e.g. the baseline's full fp32 logits at large batches
            results[name] = {"error": f"out of memory: {str(exc).splitlines()[0]}"}
            print(f"{name}: {results[name]['error']}", flush=True)
            del run_step
            teardown()
            torch.cuda.empty_cache()
            continue
        med = statistics.median(times)
        results[name] = {"median_s": med, "tokens_per_s": n_tokens / med, "times_s": times}
        if args.device == "cuda":
            results[name]["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if args.profile is not None:
            results[name]["profile"] = profile_steps(name, run_step, args)
        del run_step
        teardown()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    measured = matmul_tflops(args.device)
    base_row = results.get("transformers + AdamW")
    base = base_row.get("tokens_per_s") if base_row else None
    peak = None
    if args.device == "cuda":
        gpu = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in gpu), None)
    flops = step_flops(m, sequences, args.seq_len)
    print(
        f"{args.size} ({m.family}), {args.micro_batches} micro-batch(es) of {args.batch} x {args.seq_len} "
        f"tokens per step, device {args.device}"
    )
    print(f"kernels: {kernel_config(args).model_dump()}")
    if measured:
        print(f"measured bf16 GEMM rate: {measured:.0f} TFLOP/s (datasheet peak {peak})")
    print(
        f"{'implementation':<24} {'median s/step':>14} {'tokens/s':>12} {'vs baseline':>12} {'MFU':>7} "
        f"{'of GEMM rate':>12} {'peak GiB':>9} {'step spread':>12}"
    )
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<24} {r['error'][:100]}")
            continue
        r["ratio_vs_baseline"] = r["tokens_per_s"] / base if base else None
        r["mfu"] = flops / r["median_s"] / (peak * 1e12) if peak else None
        r["fraction_of_measured_gemm"] = flops / r["median_s"] / (measured * 1e12) if measured else None
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        ratio = f"{r['ratio_vs_baseline']:.2f}x" if r["ratio_vs_baseline"] is not None else "-"
        of_gemm = f"{100 * r['fraction_of_measured_gemm']:.1f}%" if measured else "-"
        mem = f"{r['peak_gib']:.1f}" if "peak_gib" in r else "-"
        # the timed steps' range around the median: differences below it are noise
        r["spread"] = (max(r["times_s"]) - min(r["times_s"])) / r["median_s"]
        spread = f"+-{50 * r['spread']:.1f}%"
        print(
            f"{name:<24} {r['median_s']:>14.4f} {r['tokens_per_s']:>12.0f} {ratio:>12} {mfu:>7} "
            f"{of_gemm:>12} {mem:>9} {spread:>12}"
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
                    "measured_gemm_tflops": measured,
                    "kernels": kernel_config(args).model_dump(),
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
