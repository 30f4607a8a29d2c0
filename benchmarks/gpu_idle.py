"""Where a GPU sits idle, and what the host was doing then: an analysis of a torch profiler trace.

Kernel tables say what the device ran; a step that is host-bound also has gaps in which the device waits
for the host to launch the next kernel. This reads a Chrome trace (``prof.export_chrome_trace``) and, for
every gap between device activities, finds the launch of the kernel that ended it:

- launched after the gap began: the host was late. The gap is sampled every ``sample_us`` on the launching
  thread and each sample is charged to the host stack at that moment (the innermost project frames of a
  ``with_stack`` trace, and the innermost operator or runtime call);
- a host synchronisation (``cudaStreamSynchronize``, a device-to-host copy, ...) that returned as the gap
  began: the whole gap is charged to that sync's stack, since the host could not run ahead of it;
- launched before the gap began: the device waited on something else (an event, another stream).

    python benchmarks/gpu_idle.py TRACE.json [--steps N] [--top 25]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
HOST_CATEGORIES = ("cpu_op", "python_function", "cuda_runtime", "cuda_driver", "user_annotation")
SYNC_NAMES = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",  # the blocking copy; cudaMemcpyAsync device-to-host also blocks on pageable memory
    "cudaMemcpyAsync",
    "cuStreamSynchronize",
    "cuCtxSynchronize",
)
# python frames worth naming: the project's and the libraries whose host time we can change
PROJECT_MARKERS = ("tidal", "trainer/", "megatron/", "torch/optim", "torch/autograd", "benchmarks/")


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _short_frame(name: str) -> str:
    """``.../megatron/core/optimizer/optimizer.py(412): step`` -> ``optimizer.py:step``."""
    path, _, func = name.partition(": ")
    file = path.rsplit("/", 1)[-1].split("(")[0]
    return f"{file}:{func}" if func else name


class _Stacks:
    """The nesting of host events on one thread at given times (events on a thread nest)."""

    def __init__(self, events: list[dict]):
        self.events = sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0)))

    def at(self, times: list[float]) -> list[list[dict]]:
        stacks, stack, i = [], [], 0
        for t in times:  # ascending
            while i < len(self.events) and self.events[i]["ts"] <= t:
                e = self.events[i]
                while stack and stack[-1]["ts"] + stack[-1].get("dur", 0) <= e["ts"]:
                    stack.pop()
                stack.append(e)
                i += 1
            stacks.append([e for e in stack if e["ts"] + e.get("dur", 0) > t])
        return stacks


def signature(stack: list[dict], frames: int = 2) -> str:
    """The innermost ``frames`` project python frames and the innermost operator / runtime call."""
    python = [
        _short_frame(e["name"])
        for e in stack
        if e.get("cat") == "python_function" and any(m in e["name"] for m in PROJECT_MARKERS)
    ]
    ops = [e["name"] for e in stack if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver")]
    where = " > ".join(python[-frames:]) if python else "(no python frame)"
    return f"{where} | {ops[-1]}" if ops else where


def analyse(events: list[dict], steps: int = 1, sample_us: float = 10.0, min_gap_us: float = 2.0) -> dict:
    """Idle time of the device between its first and last activity, charged to host stacks (per step)."""
    device = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES),
        key=lambda e: e["ts"],
    )
    if not device:
        return {"error": "no device activity in the trace (CPU-only run, or CUDA activity not recorded)"}
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    host_by_tid: dict[object, list[dict]] = defaultdict(list)
    syncs = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES:
            host_by_tid[e["tid"]].append(e)
            if e.get("cat") in LAUNCH_CATEGORIES and e["name"] in SYNC_NAMES:
                syncs.append(e)
    syncs.sort(key=lambda e: e["ts"] + e.get("dur", 0))
    sync_ends = [e["ts"] + e.get("dur", 0) for e in syncs]

    busy_end = device[0]["ts"] + device[0].get("dur", 0)
    start, gaps = device[0]["ts"], []
    for e in device[1:]:
        if e["ts"] - busy_end >= min_gap_us:
            gaps.append((busy_end, e["ts"], e))
        busy_end = max(busy_end, e["ts"] + e.get("dur", 0))
    window = busy_end - start

    samples: dict[object, list[tuple[float, float, str]]] = defaultdict(list)  # tid -> (t, weight, kind)
    charged: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    sync_samples: list[tuple[object, float, float]] = []
    for gap_start, gap_end, nxt in gaps:
        length = gap_end - gap_start
        launch = launches.get(nxt.get("args", {}).get("correlation"))
        k = bisect.bisect_left(sync_ends, gap_start - 20.0)
        # a sync that was already waiting while the device worked and returned as the gap began
        sync = syncs[k] if k < len(syncs) and sync_ends[k] <= gap_start + 20.0 else None
        if sync is not None and sync["ts"] > gap_start - 5.0:
            sync = None
        if sync is not None:
            sync_samples.append((sync["tid"], sync["ts"] + sync.get("dur", 0) / 2, length))
        elif launch is None:
            charged["(launch not in trace)"] += length
            counts["(launch not in trace)"] += 1
        elif launch["ts"] <= gap_start:
            charged["(launched before the gap: the device waited on an event or stream)"] += length
            counts["(launched before the gap: the device waited on an event or stream)"] += 1
        else:
            late = min(launch["ts"], gap_end) - gap_start
            n = max(1, int(late // sample_us))
            for j in range(n):
                samples[launch["tid"]].append((gap_start + (j + 0.5) * late / n, length / n, "host"))
    for tid, t, length in sync_samples:
        samples[tid].append((t, length, "sync"))
    for tid, rows in samples.items():
        rows.sort()
        stacks = _Stacks(host_by_tid.get(tid, [])).at([t for t, _, _ in rows])
        for (_, weight, kind), stack in zip(rows, stacks, strict=True):
            key = f"{'after sync' if kind == 'sync' else 'host'}: {signature(stack)}"
            charged[key] += weight
            counts[key] += 1
    idle = sum(end - begin for begin, end, _ in gaps)
    per_step = max(steps, 1)
    rows = sorted(charged.items(), key=lambda kv: -kv[1])
    return {
        "steps": per_step,
        "window_ms_per_step": window / 1e3 / per_step,
        "idle_ms_per_step": idle / 1e3 / per_step,
        "gaps_per_step": len(gaps) / per_step,
        "by_stack": [
            {"ms_per_step": us / 1e3 / per_step, "samples": counts[key], "where": key} for key, us in rows
        ],
    }


def format_report(report: dict, top: int = 25) -> str:
    if "error" in report:
        return report["error"]
    lines = [
        f"device window {report['window_ms_per_step']:.1f} ms/step, idle {report['idle_ms_per_step']:.1f} "
        f"ms/step in {report['gaps_per_step']:.0f} gaps/step",
        f"{'ms/step':>9} {'samples':>8}  where the host was (innermost frames | innermost call)",
    ]
    for row in report["by_stack"][:top]:
        lines.append(f"{row['ms_per_step']:>9.2f} {row['samples']:>8}  {row['where'][:200]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="a Chrome trace from torch.profiler (.json or .json.gz)")
    parser.add_argument("--steps", type=int, default=1, help="steps the trace covers (figures are per step)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, help="write the report as JSON here")
    args = parser.parse_args(argv)
    report = analyse(load_events(args.trace), steps=args.steps)
    print(format_report(report, args.top))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0 if "error" not in report else 1


if __name__ == "__main__":
    sys.exit(main())
