"""The planner's per-GPU memory estimate (tidal/memory_model.py) against the measured peak of real steps.

Each case trains a few steps of the real trainer (megatron-core model, DDP / distributed optimizer,
pipeline schedule, the config's loss) under torchrun, on packed synthetic sequences that fill
``trainer.micro_batch_tokens`` exactly, with ``max(2, pp)`` micro-batches per step (the planner assumes
enough micro-batches to fill the pipeline). Every rank measures, from right before its model is built:

- CUDA: ``torch.cuda.max_memory_allocated()`` (and ``max_memory_reserved()``), the bytes of live tensors;
- CPU: the same quantity from torch's CPU allocator, since torch keeps no peak counter on CPU: its
  live-byte counter over all threads (c10's ``caffe2_report_cpu_memory_usage``) read at every allocation
  event the profiler records on the measuring thread (``torch.profiler`` with ``profile_memory``); a
  replay of those events alone would miss the frees gloo makes on its own threads (an all-to-all's
  buffers) and count them as live forever. Also reported: the growth of the process's peak RSS
  (``VmHWM``, reset through ``/proc/self/clear_refs``) over its RSS before the build, which adds glibc's
  heap slack, lazily loaded code and the profiler's own event records to the tensors.

``static`` is what is live right before the last step (weights, gradient buffers, optimizer state, and
a few tensors megatron keeps from the previous step that the next one frees before its peak);
``dynamic`` is the last step's peak above that (activations, logits, backward temporaries). The table
compares each with the planner's estimate for the same config and mesh (``tidal plan``'s numbers).

    python benchmarks/planner_memory.py --out runs/bench/planner_memory_cpu.json
    python benchmarks/planner_memory.py --device cuda --cases dense-0.6b,dense-0.6b-rc --out planner_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proc_stats import status_kib  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# Qwen3-0.6B's architecture (its public config.json): 28 layers, hidden 1024, 16 heads of 128, 8 KV heads
QWEN3_0_6B = dict(
    family="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


@dataclass(frozen=True)
class Case:
    """A run config (YAML + dotted overrides, optionally a replaced model section) and how to run it."""

    config: str
    overrides: tuple[str, ...] = ()
    seq_len: int = 512  # tokens per packed sequence (divides trainer.micro_batch_tokens)
    recompute: bool = False  # megatron's full, uniform recompute of every layer
    device: str = "cpu"
    model: dict | None = None
    note: str = ""


_TINY = ("model.max_position_embeddings=512",)
_KIMI = ("model.max_position_embeddings=512", "trainer.nproc=2")
_DENSE_GPU = ("trainer.bf16=true", "trainer.micro_batch_tokens=4096", "device=cuda", "trainer.nproc=1")

CASES: dict[str, Case] = {
    "tiny": Case("configs/tiny.yaml", _TINY, note="the default job's model, fp32, world 1"),
    "tiny-rc": Case("configs/tiny.yaml", _TINY, recompute=True, note="same, full recompute"),
    "kimi-pp2": Case(
        "configs/tiny/kimi_k2_6.yaml", (*_KIMI, "trainer.mesh.ep=1"), note="tiny Kimi K2.6 (MLA, MoE), PP2"
    ),
    "kimi-pp2-rc": Case(
        "configs/tiny/kimi_k2_6.yaml", (*_KIMI, "trainer.mesh.ep=1"), recompute=True, note="same, recompute"
    ),
    "kimi-ep2": Case(
        "configs/tiny/kimi_k2_6.yaml", (*_KIMI, "trainer.mesh.pp=1"), note="tiny Kimi K2.6, EP2 x DP2"
    ),
    "dense-0.6b": Case(
        "configs/tiny.yaml",
        _DENSE_GPU,
        seq_len=4096,
        device="cuda",
        model=QWEN3_0_6B,
        note="Qwen3-0.6B shape, bf16, one 4096-token sequence per micro-batch",
    ),
    "dense-0.6b-rc": Case(
        "configs/tiny.yaml",
        _DENSE_GPU,
        seq_len=4096,
        device="cuda",
        model=QWEN3_0_6B,
        recompute=True,
        note="same, full recompute",
    ),
}
DEFAULT_CASES = {"cpu": "tiny,tiny-rc,kimi-pp2,kimi-pp2-rc,kimi-ep2", "cuda": "dense-0.6b,dense-0.6b-rc"}


def load_case_config(case: Case):
    from tidal.config import RunConfig
    from tidal.configio import apply_overrides, build, load_yaml

    data = load_yaml(REPO / case.config)
    if case.model is not None:
        data["model"] = dict(case.model)
    apply_overrides(data, list(case.overrides))
    return build(RunConfig, data)


def micro_batches_per_step(config) -> int:
    return max(2, config.trainer.mesh.pp)


# ---------------------------------------------------------------------------------------------- worker


class CpuMeter:
    """Live bytes of torch's CPU allocator over time: the profiler's allocation events, each carrying the
    allocator's counter over all threads (``cpu_memory_counted_on_all_threads``)."""

    def __init__(self):
        from torch.profiler import ProfilerActivity, profile

        self.profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.rss_before = 0

    def __enter__(self):
        from tidal.memory_measured import cpu_memory_counted_on_all_threads

        self.counter = cpu_memory_counted_on_all_threads()
        self.counter.__enter__()
        self.rss_before = status_kib("VmRSS") * 1024
        _reset_peak_rss()
        self.profile.__enter__()
        return self

    def __exit__(self, *exc):
        self.rss_peak = status_kib("VmHWM") * 1024
        self.profile.__exit__(*exc)
        self.counter.__exit__(*exc)

    def mark(self, name: str) -> None:
        from torch.profiler import record_function

        with record_function(f"tidal_mark:{name}"):
            pass

    def result(self) -> dict:
        from tidal.memory_measured import allocation_timeline, counted_allocations, profiled_allocations

        samples, marks = profiled_allocations(self.profile, "tidal_mark:")
        timeline = allocation_timeline(counted_allocations(samples), marks)
        # the same events replayed without the counter: what this thread saw allocated and freed
        replay = allocation_timeline([(t, nbytes) for t, nbytes, _ in samples], marks)
        return {
            "method": "cpu: torch CPU allocator's all-threads counter, at the profiler's allocation events",
            "peak_bytes": timeline.peak,
            "static_bytes": timeline.live_at["last_step"],
            "step_peak_bytes": timeline.peak_after["last_step"],
            "static_growth_bytes": timeline.live_at["last_step"] - timeline.live_at["previous_step"],
            "this_thread_static_growth_bytes": replay.live_at["last_step"] - replay.live_at["previous_step"],
            "rss_growth_bytes": self.rss_peak - self.rss_before,
        }


class CudaMeter:
    def __enter__(self):
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()
        self.live: dict[str, int] = {}
        return self

    def __exit__(self, *exc):
        import torch

        torch.cuda.synchronize()
        self.step_peak = torch.cuda.max_memory_allocated() - self.base
        self.reserved = torch.cuda.max_memory_reserved()

    def mark(self, name: str) -> None:
        import torch

        torch.cuda.synchronize()
        self.live[name] = torch.cuda.memory_allocated() - self.base
        if name == "last_step":
            self.peak_so_far = torch.cuda.max_memory_allocated() - self.base
            torch.cuda.reset_peak_memory_stats()

    def result(self) -> dict:
        return {
            "method": "cuda: torch.cuda.max_memory_allocated",
            "peak_bytes": max(self.peak_so_far, self.step_peak),
            "static_bytes": self.live["last_step"],
            "step_peak_bytes": self.step_peak,
            "static_growth_bytes": self.live["last_step"] - self.live["previous_step"],
            "max_reserved_bytes": self.reserved,
        }


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux: writing 5 to clear_refs)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def synthetic_plan(config, layout, seq_len: int, micro_batches: int):
    """Sequences of exactly ``seq_len`` tokens filling ``micro_batches`` micro-batches per DP rank."""
    from tidal.trainer.synthetic import plan, synthetic_groups

    tokens = config.trainer.micro_batch_tokens
    if tokens % seq_len:
        raise ValueError(f"seq_len {seq_len} must divide trainer.micro_batch_tokens {tokens}")
    group_size = min(config.broker.group_size, tokens // seq_len)
    sequences = layout.dp * micro_batches * tokens // seq_len
    groups = synthetic_groups(
        vocab_size=config.model.vocab_size,
        groups=sequences // group_size,
        group_size=group_size,
        prompt_len=(seq_len // 4, seq_len // 4 + 1),
        response_len=(seq_len - seq_len // 4, seq_len - seq_len // 4 + 1),
        seed=config.seed,
    )
    pad = 2 * layout.cp * layout.tp if (layout.cp > 1 or layout.tp > 1) else 1
    return plan(groups, dp_size=layout.dp, max_tokens=tokens, pad_multiple=pad)


def worker(case_name: str, steps: int, out_dir: Path) -> int:
    import torch
    from megatron.core import parallel_state as ps

    from tidal.memory_measured import write_peak
    from tidal.trainer import models, parallel
    from tidal.trainer.optimizer import build_train_state
    from tidal.trainer.step import train_step
    from tidal.trainer.synthetic import make_loss

    case = CASES[case_name]
    config = load_case_config(case)
    tc = config.trainer
    model = config.model.resolved()
    layout = parallel.init_parallel(tc.mesh, model, seed=tc.seed)
    count = micro_batches_per_step(config)
    minibatch = synthetic_plan(config, layout, case.seq_len, count)
    micro_batches = minibatch.micro_batches(ps.get_data_parallel_rank())
    if len(micro_batches) != count or any(mb.num_tokens != tc.micro_batch_tokens for mb in micro_batches):
        raise RuntimeError(f"expected {count} micro-batches of {tc.micro_batch_tokens} tokens each")
    loss_fn = make_loss(tc.loss.kind, tc.loss, minibatch.normalizer)
    meter = CudaMeter() if case.device == "cuda" else CpuMeter()
    with meter:
        tconfig = models.transformer_config(
            model, tc.mesh, bf16=tc.bf16, moe_dispatcher=tc.moe_dispatcher, deterministic=tc.deterministic
        )
        if case.recompute:
            tconfig = dataclasses.replace(
                tconfig, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
            )
        chunks = models.build_model(model, tconfig, seed=tc.seed)
        state = build_train_state(chunks, tconfig, tc.optimizer, total_steps=steps)
        for step in range(steps):
            if step == steps - 2:
                meter.mark("previous_step")
            if step == steps - 1:
                meter.mark("last_step")
            result = train_step(state, micro_batches, loss_fn)
        if case.device == "cuda":
            torch.cuda.synchronize()
    measured = meter.result()
    write_peak(
        out_dir,
        torch.distributed.get_rank(),
        ps.get_pipeline_model_parallel_rank(),
        measured.pop("peak_bytes"),
        **measured,
        loss=result.loss,
    )
    parallel.shutdown()
    return 0


# ---------------------------------------------------------------------------------------------- driver


@dataclass
class CaseResult:
    name: str
    note: str
    world: int
    mesh: str
    optimizer: str
    dtype: str
    tokens: int
    micro_batches: int
    recompute: bool
    seconds: float
    stages: list[dict] = field(default_factory=list)


def launch(name: str, steps: int, timeout_s: float, work: Path) -> tuple[Path, float]:
    from tidal.procs import free_port, kill_tree

    case = CASES[name]
    config = load_case_config(case)
    out_dir = work / name
    log = work / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={config.trainer.nproc}",
        f"--master-port={free_port()}",
        __file__,
        "--worker",
        name,
        "--steps",
        str(steps),
        "--work",
        str(out_dir),
    ]
    started = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            proc.wait()
            raise RuntimeError(f"case {name}: no result within {timeout_s:.0f} s; log: {log}") from None
    if rc != 0:
        raise RuntimeError(f"case {name}: torchrun exited {rc}:\n{log.read_text()[-4000:]}")
    return out_dir, time.perf_counter() - started


def compare_case(name: str, out_dir: Path, seconds: float) -> CaseResult:
    from tidal.memory_measured import compare_stage, measured_stages
    from tidal.plan import Workload, describe_mesh, evaluate

    case = CASES[name]
    config = load_case_config(case)
    tc = config.trainer
    world = tc.nproc * tc.nnodes
    model = config.model.resolved()
    work = Workload.of(model, tc.micro_batch_tokens, tc.bf16, config.device)
    est = evaluate(work, tc.mesh, world, tc.optimizer.kind).estimate
    result = CaseResult(
        name=name,
        note=case.note,
        world=world,
        mesh=describe_mesh(tc.mesh),
        optimizer=tc.optimizer.kind,
        dtype="bf16" if tc.bf16 else "fp32",
        tokens=tc.micro_batch_tokens,
        micro_batches=micro_batches_per_step(config),
        recompute=case.recompute,
        seconds=seconds,
    )
    measured = measured_stages(out_dir)
    for stage in est.stages:
        if stage.stage in measured:
            result.stages.append(compare_stage(stage, measured[stage.stage], case.recompute))
    return result


def print_table(results: list[CaseResult]) -> None:
    mib = 1 << 20
    head = (
        f"{'case':<16}{'stage':>6}{'est MiB':>10}{'meas MiB':>10}{'error':>8}"
        f"{'static est':>12}{'meas':>9}{'err':>8}{'dynamic est':>13}{'meas':>9}{'err':>8}{'RSS grow':>10}"
        f"{'growth/step':>13}"
    )
    print(head)
    for r in results:
        for s in r.stages:
            rss = s.get("rss_growth_bytes")
            print(
                f"{r.name:<16}{s['stage']:>6}{s['estimate'] / mib:>10.1f}{s['measured'] / mib:>10.1f}"
                f"{s['error']:>+8.1%}{s['static_estimate'] / mib:>12.1f}{s['static_measured'] / mib:>9.1f}"
                f"{s['static_error']:>+8.1%}{s['dynamic_estimate'] / mib:>13.1f}"
                f"{s['dynamic_measured'] / mib:>9.1f}{s['dynamic_error']:>+8.1%}"
                + (f"{rss / mib:>10.1f}" if rss is not None else f"{'-':>10}")
                + f"{s['static_growth_bytes'] / mib:>13.2f}"
            )
    print(
        "error = (estimate - measured) / measured; static: weights + grads + optimizer state (live before the "
        "last step); dynamic: the last step's peak above it vs activations + logits; growth/step: static "
        "memory of the last step minus the one before (nonzero: memory that grows every step, a leak or "
        "frees the measurement missed)"
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--cases", default=None, help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument(
        "--steps", type=int, default=3, help="optimizer steps per case (>= 3: Adam state exists, growth)"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, default=None, help="keep the per-rank files and logs here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker, args.steps, args.work)
    if args.steps < 3:
        print(
            "--steps must be >= 3: Adam's state appears in the first step, and the static memory of the "
            "last two steps is compared",
            file=sys.stderr,
        )
        return 2
    names = (args.cases or DEFAULT_CASES[args.device]).split(",")
    unknown = [n for n in names if n not in CASES]
    wrong_device = [n for n in names if n in CASES and CASES[n].device != args.device]
    if unknown or wrong_device:
        print(
            f"--cases: unknown {unknown}, not for --device {args.device}: {wrong_device}; "
            f"choose from {[n for n, c in CASES.items() if c.device == args.device]}",
            file=sys.stderr,
        )
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="planner_memory_"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        out_dir, seconds = launch(name, args.steps, args.timeout, work)
        results.append(compare_case(name, out_dir, seconds))
    print_table(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        device_name = platform.processor()
        if args.device == "cuda":
            import torch

            device_name = torch.cuda.get_device_name()
        args.out.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "host": platform.node(),
                    "cpus": os.cpu_count(),
                    "device_name": device_name,
                    "cases": [dataclasses.asdict(r) for r in results],
                    "max_abs_error": max(abs(s["error"]) for r in results for s in r.stages),
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
