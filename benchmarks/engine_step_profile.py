"""Where the milliseconds of one batch decode step go: the embedded engine's lean step against transformers'.

Both sides decode one token for ``--batch`` rows whose caches hold ``--context`` positions (default: a 64-token
prompt plus half of 256 new tokens, the mean context of ``engine_throughput.py``'s run), same model, same
weights, one thread. The engine's step is the lean forward plus sampling (what a decode burst runs per
token); transformers' is its model forward over its own ``DynamicCache`` plus the argmax (its ``generate``
adds little per step; the figure of a whole ``generate`` is printed beside it). Times are CPU seconds
(``time.process_time``), medians of ``--repeats`` interleaved rounds; the per-category split comes from
``torch.profiler`` (self time per ATen op, grouped by op name), whose own overhead is left out of the
un-profiled step time. The "floor" rows are what the arithmetic costs at this core's measured matmul rate
(``--threads 1`` GEMM of the model's projection shape), with no overhead at all.

    .venv/bin/python benchmarks/engine_step_profile.py --model configs/tiny.yaml --out runs/bench/engine_step_tiny.json
    .venv/bin/python benchmarks/engine_step_profile.py --out runs/bench/engine_step_qwen3.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from engine_throughput import model_config
from torch.profiler import ProfilerActivity, profile, record_function

from tidal.rollout.embedded import native_step
from tidal.rollout.embedded.kv_cache import KVPool
from tidal.rollout.embedded.lean import LeanDecoder
from tidal.rollout.embedded.model import build_model
from tidal.rollout.embedded.sampling import SamplingParams, sample

# ATen op name -> category (self time); anything else is "norms, rotary, residuals, other elementwise"
CATEGORIES = {
    "projection / expert / LM-head GEMMs": ("aten::mm", "aten::addmm", "aten::_grouped_mm", "aten::linear"),
    "attention (QK, softmax, PV)": (
        "aten::bmm",
        "aten::_softmax",
        "aten::masked_fill_",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "tidal::native_decode_attention",
    ),
    "KV cache writes / concatenation": ("aten::cat", "aten::_index_put_impl_", "aten::index_put_"),
    "MoE routing and combine": (
        "aten::topk",
        "aten::sort",
        "aten::argsort",
        "aten::bincount",
        "aten::histc",
        "aten::cumsum",
        "aten::index_add_",
        "aten::scatter_add_",
        "aten::index",
    ),
    "sampling / logprobs": ("aten::_log_softmax", "aten::argmax", "aten::gather"),
}
OTHER = "norms, rotary, residuals, other elementwise"
# the native step (one C call) is invisible to torch.profiler: it times its own parts (native_step.TIMED_PARTS)
NATIVE_PARTS = {
    "gemm": "projection / expert / LM-head GEMMs",
    "attention": "attention (QK, softmax, PV)",
    "qk_norm_rotary_kv_write": OTHER,
    "moe_routing": "MoE routing and combine",
    "elementwise": OTHER,
    "greedy_pick": "sampling / logprobs",
}
OUTSIDE = "outside the kernel (Python, the call, tensors)"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a YAML run config whose `model` to use (configs/tiny.yaml)")
    p.add_argument("--family", default="qwen3", choices=["qwen3", "qwen3_moe"])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--context", type=int, default=None, help="cached positions (default prompt + new/2)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--cpu-step",
        default="auto",
        choices=["auto", "native", "torch"],
        help="the engine's step: one native call (auto with --threads 1) or PyTorch ops",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    return p.parse_args()


def cpu_ms(fn, calls: int) -> float:
    t0 = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t0) / calls * 1e3


def categorised_ms(fn, calls: int) -> dict[str, float]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    split: dict[str, float] = collections.defaultdict(float)
    owner = {op: cat for cat, ops in CATEGORIES.items() for op in ops}
    for event in prof.key_averages():
        split[owner.get(event.key, OTHER)] += event.self_cpu_time_total / 1e3 / calls
    return dict(split)


def matmul_rate_gmacs(rows: int, hidden: int, repeats: int) -> float:
    x, w = torch.randn(rows, hidden), torch.randn(4 * hidden, hidden)
    calls = 50
    times = [cpu_ms(lambda: F.linear(x, w), calls) for _ in range(repeats)]
    return rows * hidden * 4 * hidden / statistics.median(times) / 1e6


def native_matmul_rate_gmacs(lib, rows: int, hidden: int, repeats: int) -> float:
    """The native step's GEMM on the same shape (activations feature-major, as the step keeps them)."""
    cols = -(-rows // 16) * 16
    w, xt = torch.randn(4 * hidden, hidden), torch.zeros(hidden, cols)
    xt[:, :rows] = torch.randn(hidden, rows)
    out, xs = torch.empty(4 * hidden, cols), torch.empty(4 * hidden)
    args = (w.data_ptr(), xt.data_ptr(), out.data_ptr(), 4 * hidden, rows, cols, hidden, xs.data_ptr())
    calls = 50
    times = [cpu_ms(lambda: lib.tidal_gemm(*args), calls) for _ in range(repeats)]
    return rows * hidden * 4 * hidden / statistics.median(times) / 1e6


def step_macs(cfg, batch: int, context: int) -> tuple[float, float]:
    """Multiply-accumulates of one decode step: (GEMMs over the weights, attention over the cache)."""
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    attn_proj = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
    if cfg.num_experts:
        mlp = cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        mlp += cfg.hidden_size * cfg.num_experts
    else:
        mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    gemm = batch * (cfg.num_hidden_layers * (attn_proj + mlp) + cfg.hidden_size * cfg.vocab_size)
    attention = batch * cfg.num_hidden_layers * 2 * cfg.num_attention_heads * head_dim * (context + 1)
    return gemm, attention


def native_parts_ms(lean, engine_step, calls: int) -> dict[str, float]:
    """The native step's parts (its own per-thread CPU clock; the greedy pick is its sampling) over
    ``calls`` steps, and what is left of those same steps' CPU time (Python, the call, tensors)."""
    lean.native_step.time_parts()
    whole = cpu_ms(engine_step, calls)
    split: dict[str, float] = collections.defaultdict(float)
    for part, ns in zip(native_step.TIMED_PARTS, lean.native_step.timings.tolist(), strict=True):
        split[NATIVE_PARTS[part]] += ns / 1e6 / calls
    lean.native_step.time_parts(False)
    split[OUTSIDE] = max(0.0, whole - sum(split.values()))
    return dict(split)


class _Labelled:
    """The native attention kernel (a ctypes call, invisible to the profiler) under a profiler label."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, *args):
        with record_function("tidal::native_decode_attention"):
            return self.kernel(*args)


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    cfg = model_config(a)
    context = a.context if a.context is not None else a.prompt_len + a.new_tokens // 2
    lm = build_model(cfg, seed=a.seed, device="cpu", dtype="float32")
    ref = transformers.AutoModelForCausalLM.from_config(
        lm.config.__class__(**lm.config.to_dict()), dtype=lm.dtype
    )
    ref.config._attn_implementation = "sdpa"
    ref.load_state_dict(lm.state_dict())
    ref.eval()
    gen = torch.Generator().manual_seed(a.seed)
    prompt = torch.randint(0, cfg.vocab_size, (a.batch, context), generator=gen)
    ids = torch.randint(0, cfg.vocab_size, (a.batch,), generator=gen)

    # the engine: the pool's rows 0..batch-1 hold `context` positions (the prompt's real keys and values)
    pool = KVPool(cfg.num_hidden_layers, a.batch, context + 1, "cpu")
    lean = LeanDecoder(lm, pool, cpu_step=a.cpu_step)
    positions = torch.full((a.batch,), context)
    params = [SamplingParams(temperature=0.0, ignore_eos=True)] * a.batch
    generators = [None] * a.batch
    with torch.inference_mode():
        hf_cache = ref(prompt, use_cache=True).past_key_values
        for layer in range(cfg.num_hidden_layers):
            pool.keys[layer][:, :, :context] = hf_cache.layers[layer].keys
            pool.values[layer][:, :, :context] = hf_cache.layers[layer].values
    mask = torch.ones(a.batch, context + 1, dtype=torch.long)

    def engine_step() -> None:
        if lean.native_step is not None:  # greedy rows: the kernel picks them (as the scheduler has it do)
            tokens, logprobs = lean.native_step.greedy(ids, positions)
        else:
            tokens, logprobs = sample(lean(ids, positions, context + 1, masked=False), params, generators)
        tokens.tolist(), logprobs.tolist()

    def transformers_step() -> None:
        out = ref(ids[:, None], past_key_values=hf_cache, use_cache=True, attention_mask=mask)
        out.logits[:, -1].argmax(-1).tolist()
        hf_cache.crop(-1)  # back to `context` positions for the next call

    def generate_step_ms() -> float:
        """A whole ``generate`` per new token at about this context: (17 tokens - 1 token) / 16."""
        short = prompt[:, : context - 8]
        kw = dict(attention_mask=torch.ones_like(short), do_sample=False, eos_token_id=None, pad_token_id=0)
        t0 = time.process_time()
        ref.generate(short, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.process_time()
        ref.generate(short, max_new_tokens=17, min_new_tokens=17, **kw)
        t2 = time.process_time()
        return ((t2 - t1) - (t1 - t0)) / 16 * 1e3

    with torch.inference_mode():
        engine_logits = lean(ids, positions, context + 1, masked=False)
        hf_logits = ref(ids[:, None], past_key_values=hf_cache, use_cache=True, attention_mask=mask).logits[
            :, -1
        ]
        hf_cache.crop(-1)
        max_diff = (engine_logits - hf_logits).abs().max().item()
        rounds: dict[str, list[float]] = {"engine": [], "transformers": [], "generate": []}
        for fn in (engine_step, transformers_step):
            fn()
        for _ in range(a.repeats):
            rounds["engine"].append(cpu_ms(engine_step, 10))
            rounds["transformers"].append(cpu_ms(transformers_step, 10))
            rounds["generate"].append(generate_step_ms())
        if lean.native is not None:
            lean.native = _Labelled(lean.native)
        profiled: dict[str, list[dict[str, float]]] = {"engine": [], "transformers": []}
        native_split: list[dict[str, float]] = []
        for _ in range(3):
            if lean.native_step is not None:
                native_split.append(native_parts_ms(lean, engine_step, 10))
            else:
                profiled["engine"].append(categorised_ms(engine_step, 10))
            profiled["transformers"].append(categorised_ms(transformers_step, 10))
    # per category: the median over three profiled rounds, then the shares scaled to the un-profiled step
    # (the profiler's own per-op cost inflates small ops, so its absolute times overstate them)
    splits = {
        side: {cat: statistics.median(r.get(cat, 0.0) for r in rounds_) for cat in [*CATEGORIES, OTHER]}
        for side, rounds_ in profiled.items()
        if rounds_
    }
    step = {k: statistics.median(v) for k, v in rounds.items()}
    rate = matmul_rate_gmacs(a.batch, cfg.hidden_size, a.repeats)
    native_rate = None
    if lean.native_step is not None:
        native_rate = native_matmul_rate_gmacs(lean.native_step.lib, a.batch, cfg.hidden_size, a.repeats)
    gemm_macs, attention_macs = step_macs(cfg, a.batch, context)
    kv_bytes = (
        2
        * cfg.num_hidden_layers
        * a.batch
        * (context + 1)
        * pool.keys[0].shape[1]
        * pool.keys[0].shape[3]
        * 4
    )
    floor = {
        "GEMMs at the measured matmul rate": gemm_macs / rate / 1e6,
        "attention MACs at the same rate": attention_macs / rate / 1e6,
    }
    if native_rate is not None:
        floor["GEMMs at the native step's matmul rate"] = gemm_macs / native_rate / 1e6
    print(
        f"batch {a.batch}, context {context}, {a.threads} thread(s); engine step: {lean.step}; "
        f"attention: {lean.attention}\n"
        f"logits max |engine - transformers| "
        f"{max_diff:.1e}; matmul rate {rate:.1f} GMAC/s (torch)"
        + (f", {native_rate:.1f} GMAC/s (native step)" if native_rate else "")
        + f"; KV read per step {kv_bytes / 1e6:.1f} MB"
    )
    print(
        f"step (CPU ms, median of {a.repeats}): engine {step['engine']:.3f} | transformers forward "
        f"{step['transformers']:.3f} | transformers generate per token {step['generate']:.3f} | "
        f"ratio generate/engine {step['generate'] / step['engine']:.2f}x"
    )
    scaled = {
        side: {cat: ms / sum(split.values()) * step[side] for cat, ms in split.items()}
        for side, split in splits.items()
    }
    if native_split:
        # the kernel's own clock per part and the rest of the same steps, as shares of the un-profiled step
        cats = [*CATEGORIES, OTHER, OUTSIDE]
        splits["engine"] = {cat: statistics.median(r.get(cat, 0.0) for r in native_split) for cat in cats}
        total = sum(splits["engine"].values())
        scaled["engine"] = {cat: ms / total * step["engine"] for cat, ms in splits["engine"].items()}
    print(
        "\n| where (ms per step: profiled share x un-profiled step) | engine | share | transformers | share |"
        "\n|---|---:|---:|---:|---:|"
    )
    for cat in [*CATEGORIES, OTHER, *([OUTSIDE] if native_split else [])]:
        e, t = scaled["engine"][cat], scaled["transformers"].get(cat, 0.0)
        print(f"| {cat} | {e:.3f} | {e / step['engine']:.0%} | {t:.3f} | {t / step['transformers']:.0%} |")
    print(f"| un-profiled step | {step['engine']:.3f} | | {step['transformers']:.3f} | |")
    print(
        f"| (sum of profiled op self times) | {sum(splits['engine'].values()):.3f} | | "
        f"{sum(splits['transformers'].values()):.3f} | |"
    )
    for name, ms in floor.items():
        print(f"| floor: {name} | {ms:.3f} | | {ms:.3f} | |")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        record = {
            "model": cfg.model_dump(exclude={"path"}),
            "batch": a.batch,
            "context": context,
            "threads": a.threads,
            "step_cpu_ms": step,
            "rounds_cpu_ms": rounds,
            "profiled_split_ms": splits,
            "scaled_split_ms": scaled,
            "matmul_gmac_s": rate,
            "native_matmul_gmac_s": native_rate,
            "floor_ms": floor,
            "kv_bytes_per_step": kv_bytes,
            "logits_max_abs_diff": max_diff,
            "engine_attention": lean.attention,
            "engine_step": lean.step,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
        Path(a.out).write_text(json.dumps(record, indent=2))
        print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
