"""Output tokens/s of the embedded engine against transformers' ``generate``, same model and prompts.

For each batch size, both generate ``--new-tokens`` greedy tokens (EOS ignored) for the same random
``--prompt-len``-token prompts on the same randomly initialised model; the engine receives all requests at
once (its scheduler batches them; no HTTP in the loop). Prints a table, writes JSON with ``--out``.
Besides wall-clock tokens/s it reports tokens per CPU-second of the process (``time.process_time``), which
a loaded shared machine disturbs far less than wall time (with ``--threads 1`` both count the same work).
With ``--mixed`` each request asks for its own length (static batching runs to the longest; only the
requested tokens count, for both).

    .venv/bin/python benchmarks/engine_throughput.py --out runs/bench/engine_throughput.json
    .venv/bin/python benchmarks/engine_throughput.py --device cuda --dtype bfloat16 --hidden 1024 --layers 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import torch
import transformers

from tidal.configio import load_yaml
from tidal.model_config import ModelConfig
from tidal.rollout.embedded.model import build_model
from tidal.rollout.embedded.sampling import SamplingParams
from tidal.rollout.embedded.scheduler import DECODE_MODES, DEFAULT_DECODE_BURST, Request, Scheduler


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--model",
        default=None,
        help="a YAML run config whose `model` to use (e.g. configs/tiny.yaml, the default job's model); "
        "--family/--hidden/--layers/--vocab are then ignored",
    )
    p.add_argument("--family", default="qwen3", choices=["qwen3", "qwen3_moe"])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument(
        "--mixed",
        action="store_true",
        help="each request asks for a random length in [new_tokens/8, new_tokens] (useful tokens counted)",
    )
    p.add_argument("--repeats", type=int, default=1, help="timed runs per point (the median is reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--no-fuse", action="store_true", help="engine without fused Q/K/V and gate/up matmuls")
    p.add_argument(
        "--decode",
        default=None,
        choices=list(DECODE_MODES),
        help="the engine's decode path (default: CUDA graphs on CUDA, the lean forward on CPU)",
    )
    p.add_argument(
        "--cpu-attention",
        default="auto",
        choices=["auto", "native", "torch"],
        help="the lean decode's attention on CPU: the native AVX2 kernel where it builds (auto), or torch's matmuls",
    )
    p.add_argument(
        "--cpu-step",
        default="auto",
        choices=["auto", "native", "torch"],
        help="the lean decode and prefill on CPU: one native call per step (auto: with --threads 1), or PyTorch ops",
    )
    p.add_argument(
        "--decode-burst",
        type=int,
        default=DEFAULT_DECODE_BURST,
        help="lean decode steps per scheduler iteration (1: the host reads every step's tokens)",
    )
    p.add_argument(
        "--hf-cache",
        default="dynamic",
        choices=["dynamic", "static"],
        help="transformers' KV cache in generate (dynamic: its default, the faster one on CPU in our runs)",
    )
    p.add_argument(
        "--peak-gbs",
        type=float,
        default=4800.0,
        help="memory bandwidth (GB/s) for the bandwidth bound reported on CUDA (default: H200's 4.8 TB/s)",
    )
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    return p.parse_args()


def model_config(a: argparse.Namespace) -> ModelConfig:
    if a.model:
        model = load_yaml(a.model)["model"]
        # the rotary tables do not depend on it; the benchmark's sequences may be longer than the job's
        model["max_position_embeddings"] = max(
            model.get("max_position_embeddings", 0), a.prompt_len + a.new_tokens
        )
        return ModelConfig(**model)
    heads = max(2, a.hidden // 64)
    extra = {}
    if a.family == "qwen3_moe":
        extra = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=a.hidden)
    return ModelConfig(
        family=a.family,
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        intermediate_size=a.hidden * 3,
        max_position_embeddings=max(2048, a.prompt_len + a.new_tokens),
        **extra,
    )


def bandwidth_bound_tok_s(lm, batch: int, prompt_len: int, new_tokens: int, peak_gbs: float) -> float:
    """Decode tokens/s if each step only read the weights once and the rows' KV (mean context) at peak_gbs."""
    embed, head = lm.get_input_embeddings().weight, lm.get_output_embeddings().weight
    weights = sum(p.nbytes for p in lm.parameters()) - (0 if embed is head else embed.nbytes)
    c = lm.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_per_token = 2 * c.num_key_value_heads * head_dim * head.element_size() * c.num_hidden_layers
    step_bytes = weights + batch * (prompt_len + new_tokens / 2) * kv_per_token
    return batch / (step_bytes / (peak_gbs * 1e9))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_transformers(
    ref, prompts: torch.Tensor, new_tokens: int, device: str, cache: str = "dynamic"
) -> tuple[float, float, list[list[int]]]:
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = ref.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **({"cache_implementation": "static"} if cache == "static" else {}),
        )
    sync(device)
    return time.perf_counter() - t0, time.process_time() - c0, out[:, prompts.shape[1] :].tolist()


def run_engine(
    sched: Scheduler, prompts: list[list[int]], lengths: list[int], device: str
) -> tuple[float, float, list[list[int]]]:
    done: dict[int, Request] = {}
    finished = threading.Event()

    def on_done(req: Request) -> None:
        done[int(req.rid)] = req
        if len(done) == len(prompts):
            finished.set()

    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        sched.submit(Request(input_ids=p, params=params, rid=str(i), on_done=on_done))
    if not finished.wait(3600):
        raise TimeoutError("engine did not finish the batch")
    sync(device)
    return (
        time.perf_counter() - t0,
        time.process_time() - c0,
        [done[i].output_ids for i in range(len(prompts))],
    )


def main() -> None:
    a = parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = model_config(a)
    batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    lm = build_model(cfg, seed=a.seed, device=a.device, dtype=a.dtype, fuse=not a.no_fuse)
    ref = transformers.AutoModelForCausalLM.from_config(
        lm.config.__class__(**lm.config.to_dict()), dtype=lm.dtype
    )
    ref.config._attn_implementation = "sdpa"
    ref.load_state_dict(lm.state_dict())
    ref = ref.to(a.device).eval()
    sched = Scheduler(
        lm,
        max_batch_size=max(batch_sizes),
        max_seq_len=a.prompt_len + a.new_tokens + 1,
        max_prefill_tokens=max(batch_sizes) * a.prompt_len,
        device=a.device,
        eos_token_ids=[],
        seed=a.seed,
        decode=a.decode,
        decode_burst=a.decode_burst,
        cpu_attention=a.cpu_attention,
        cpu_step=a.cpu_step,
    )
    t_start = time.perf_counter()
    sched.start()
    gen = torch.Generator().manual_seed(a.seed)
    rows = []
    try:
        # warm-up both paths once (allocations, kernels)
        warm = torch.randint(0, cfg.vocab_size, (2, a.prompt_len), generator=gen).to(a.device)
        run_transformers(ref, warm, 4, a.device, a.hf_cache)
        run_engine(sched, warm.tolist(), [4, 4], a.device)
        # includes the CUDA graph captures, which run on the scheduler thread before its first step
        engine_start_s = time.perf_counter() - t_start
        print(
            f"engine decode path: {sched.decode_mode} ({sched.decode_reason}); CPU step: {sched.step}; "
            f"attention: {sched.attention}; "
            f"burst {a.decode_burst}; transformers cache: {a.hf_cache}; ready in {engine_start_s:.1f} s"
        )
        for b in batch_sizes:
            prompts = torch.randint(0, cfg.vocab_size, (b, a.prompt_len), generator=gen).to(a.device)
            if a.mixed:
                lengths = torch.randint(a.new_tokens // 8, a.new_tokens + 1, (b,), generator=gen).tolist()
            else:
                lengths = [a.new_tokens] * b
            hf_times, eng_times, hf_cpu, eng_cpu, same = [], [], [], [], 0.0
            for _ in range(a.repeats):
                # static batching: transformers runs the batch to its longest request
                t_hf, c_hf, out_hf = run_transformers(ref, prompts, max(lengths), a.device, a.hf_cache)
                t_eng, c_eng, out_eng = run_engine(sched, prompts.tolist(), lengths, a.device)
                hf_times.append(t_hf)
                eng_times.append(t_eng)
                hf_cpu.append(c_hf)
                eng_cpu.append(c_eng)
                same = sum(x[:n] == y for x, y, n in zip(out_hf, out_eng, lengths, strict=True)) / b
            tokens = sum(lengths)
            hf_tps = tokens / statistics.median(hf_times)
            eng_tps = tokens / statistics.median(eng_times)
            hf_cps = tokens / statistics.median(hf_cpu)
            eng_cps = tokens / statistics.median(eng_cpu)
            rows.append(
                {
                    "batch": b,
                    "transformers_tok_s": round(hf_tps, 1),
                    "engine_tok_s": round(eng_tps, 1),
                    "speedup": round(eng_tps / hf_tps, 2),
                    "transformers_tok_per_cpu_s": round(hf_cps, 1),
                    "engine_tok_per_cpu_s": round(eng_cps, 1),
                    "speedup_cpu_time": round(eng_cps / hf_cps, 2),
                    "greedy_identical_fraction": same,
                    "transformers_s": [round(t, 3) for t in hf_times],
                    "engine_s": [round(t, 3) for t in eng_times],
                    "load_average": [round(x, 2) for x in os.getloadavg()],
                }
            )
            if a.device == "cuda":
                bound = bandwidth_bound_tok_s(lm, b, a.prompt_len, a.new_tokens, a.peak_gbs)
                rows[-1]["bandwidth_bound_tok_s"] = round(bound, 1)
                rows[-1]["engine_fraction_of_bound"] = round(eng_tps / bound, 3)
            r = rows[-1]
            print(
                f"batch {b:>3}: transformers {r['transformers_tok_s']:>9.1f} tok/s | engine {r['engine_tok_s']:>9.1f} "
                f"tok/s | x{r['speedup']:.2f} (CPU time x{r['speedup_cpu_time']:.2f}) | identical outputs {same:.0%} "
                f"| load {r['load_average'][0]}"
                + (
                    f" | {r['engine_fraction_of_bound']:.1%} of the bandwidth bound ({r['bandwidth_bound_tok_s']:.0f} tok/s)"
                    if "bandwidth_bound_tok_s" in r
                    else ""
                ),
                flush=True,
            )
    finally:
        sched.stop()
    meta = {
        "device": a.device,
        "dtype": a.dtype,
        "model": cfg.model_dump(exclude={"path"}),
        "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens,
        "mixed_lengths": a.mixed,
        "repeats": a.repeats,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "fused_projections": not a.no_fuse,
        "decode": sched.decode_mode,
        "decode_reason": sched.decode_reason,
        "decode_attention": sched.attention,
        "cpu_step": sched.step,
        "decode_burst": a.decode_burst,
        "transformers_cache": a.hf_cache,
        "engine_ready_s": round(engine_start_s, 2),
        "cuda_graphs": len(getattr(sched._lean_step, "graphs", {})),
        "cpus": os.cpu_count(),
    }
    print(
        "\n| batch | transformers tok/s | engine tok/s | speedup | speedup (CPU time) | identical greedy "
        "outputs | load avg |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['transformers_tok_s']} | {r['engine_tok_s']} | {r['speedup']}x | "
            f"{r['speedup_cpu_time']}x | {r['greedy_identical_fraction']:.0%} | {r['load_average'][0]} |"
        )
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
