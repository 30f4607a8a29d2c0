"""The planner's estimate checked against a real run: per-rank peak files, allocation timelines, and
the comparison per pipeline stage (``tidal plan --measured``, ``benchmarks/planner_memory.py``)."""

from __future__ import annotations

import contextlib
import ctypes
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tidal.memory_model import Estimate, StageMemory

PEAK_DIR = "peak_memory"


def write_peak(run_dir: str | Path, rank: int, pp_rank: int, peak_bytes: int, **extra) -> Path:
    """What a trainer rank calls after a step to record its peak memory (one file per rank, no races).

    On CUDA ``peak_bytes`` is ``torch.cuda.max_memory_allocated()``. On CPU torch keeps no such counter:
    replay the profiler's allocation events (``torch.profiler.profile(profile_memory=True)``) through
    :func:`allocation_timeline`, not the RSS, which adds glibc's heap slack and lazily loaded code.
    ``extra``: more JSON fields, e.g. ``static_bytes`` (live before the measured step: weights, gradient
    buffers, optimizer state), which :func:`compare_stage` splits the error with.
    """
    path = Path(run_dir) / PEAK_DIR / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"rank": rank, "pp_rank": pp_rank, "peak_bytes": int(peak_bytes), **extra}
    path.write_text(json.dumps(entry))
    return path


@dataclass
class AllocationTimeline:
    peak: int  # the most bytes live at once
    live_at: dict[str, int]  # bytes live at each mark
    peak_after: dict[str, int]  # the most bytes live from each mark on, above what was live at it


def allocation_timeline(allocations: list[tuple[int, int]], marks: dict[str, int]) -> AllocationTimeline:
    """Replay (time, +-bytes) allocation events in time order; ``marks`` name points in time.

    Counts only what was allocated after the first event: start recording before the model is built.
    """
    order = sorted(allocations)
    named = sorted(marks.items(), key=lambda item: item[1])
    live = peak = 0
    live_at: dict[str, int] = {}
    peak_after: dict[str, int] = {}
    next_mark = 0
    for t, nbytes in order:
        while next_mark < len(named) and named[next_mark][1] <= t:
            name = named[next_mark][0]
            live_at[name] = peak_after[name] = live
            next_mark += 1
        live += nbytes
        peak = max(peak, live)
        for name in live_at:
            peak_after[name] = max(peak_after[name], live)
    for name, _t in named[next_mark:]:
        live_at[name] = peak_after[name] = live
    return AllocationTimeline(
        peak=peak,
        live_at=live_at,
        peak_after={name: peak_after[name] - live_at[name] for name in live_at},
    )


CPU_COUNTER_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


@contextlib.contextmanager
def cpu_memory_counted_on_all_threads() -> Iterator[None]:
    """Within it, torch's CPU allocator keeps its live-byte counter over every thread's allocations and
    frees.

    The profiler records allocation events only on the threads it profiles, so a replay of them misses
    tensors freed on other threads (gloo frees an all-to-all's buffers on its own threads) and keeps
    counting them as live. With c10's ``caffe2_report_cpu_memory_usage`` flag the allocator tracks every
    block's size and updates one process-wide counter under a lock on every allocation and free, on any
    thread; each profiler allocation event then carries that counter (``total_allocated``), which
    :func:`counted_allocations` reads. Blocks allocated before it is entered are not counted, also not
    when they are freed: enter it before what is measured is built. The flag costs a lock and a table
    update per allocation, so it is restored on exit.
    """
    import torch

    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
    try:
        flag = ctypes.c_bool.in_dll(lib, CPU_COUNTER_FLAG)
    except ValueError:
        raise RuntimeError(
            f"this torch build's libc10 does not export {CPU_COUNTER_FLAG} (built with gflags?): the CPU "
            "allocator cannot count frees made on other threads; measure on CUDA, or replay the profiler's "
            "events with allocation_timeline and discard runs whose static memory grows between steps"
        ) from None
    before = flag.value
    flag.value = True
    try:
        yield
    finally:
        flag.value = before


def profiled_allocations(
    prof, mark_prefix: str = "tidal_mark:"
) -> tuple[list[tuple[int, int, int]], dict[str, int]]:
    """The (time, +-bytes, counter after it) of a finished ``torch.profiler.profile(profile_memory=True)``'s
    allocation events, and the start time of each ``record_function(mark_prefix + name)`` by name."""
    from torch._C._profiler import _EventType

    samples, marks = [], {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.typed[0] == _EventType.Allocation:
            fields = event.typed[1]
            samples.append((event.start_time_ns, fields.alloc_size, fields.total_allocated))
        elif event.name.startswith(mark_prefix):
            marks[event.name.removeprefix(mark_prefix)] = event.start_time_ns
    return samples, marks


def counted_allocations(samples: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """(time, +-bytes) events whose replay follows the allocator's all-threads counter.

    ``samples``: (time, +-bytes, counter after it) of the profiler's allocation events on the measuring
    thread, inside :func:`cpu_memory_counted_on_all_threads`. Each event's change is the counter's change
    since the event before it, so what other threads allocated and freed in between is included; the
    first event's own size sets the baseline. Feed the result to :func:`allocation_timeline`.
    """
    order = sorted(samples)
    events = []
    previous = None
    for t, nbytes, counter in order:
        events.append((t, nbytes if previous is None else counter - previous))
        previous = counter
    return events


def measured_stages(path: str | Path) -> dict[int, dict]:
    """Per pipeline stage, the entry of the rank with the largest ``peak_bytes``.

    ``path`` is a run directory or its ``peak_memory/`` folder (one ``rank<N>.json`` per rank, written by
    :func:`write_peak`), or one JSON file ``{"ranks": [{"rank": 0, "pp_rank": 0, "peak_bytes": 123}]}``.
    """
    path = Path(path)
    if path.is_dir():
        folder = path / PEAK_DIR if (path / PEAK_DIR).is_dir() else path
        entries = [json.loads(f.read_text()) for f in sorted(folder.glob("rank*.json"))]
    else:
        entries = json.loads(path.read_text()).get("ranks", [])
    stages: dict[int, dict] = {}
    for entry in entries:
        stage = int(entry.get("pp_rank", 0))
        if stage not in stages or int(entry["peak_bytes"]) > int(stages[stage]["peak_bytes"]):
            stages[stage] = entry
    if not stages:
        raise ValueError(
            f"{path}: no peak_bytes found; expected a run directory with peak_memory/rank<N>.json files "
            "or a file {'ranks': [{'rank', 'pp_rank', 'peak_bytes'}]}"
        )
    return stages


def load_measured(path: str | Path) -> dict[int, int]:
    """Peak bytes per pipeline stage: the largest peak among the ranks of each stage (see
    :func:`measured_stages` for ``path``)."""
    return {stage: int(entry["peak_bytes"]) for stage, entry in measured_stages(path).items()}


def compare_with_measured(
    est: Estimate, measured: dict[int, int], recompute: bool
) -> list[tuple[int, float, int, float]]:
    """(stage, estimated bytes, measured bytes, relative error) for each measured stage."""
    rows = []
    for stage in est.stages:
        if stage.stage in measured:
            predicted = stage.total_recompute if recompute else stage.total
            actual = measured[stage.stage]
            rows.append((stage.stage, predicted, actual, (predicted - actual) / actual))
    return rows


def compare_stage(stage: StageMemory, measured: dict, recompute: bool) -> dict:
    """Estimate against one stage's measured entry, in total and, when the entry has ``static_bytes``,
    split into static (weights + grads + optimizer state) and dynamic (the step's peak above the static:
    activations + logits) parts. Errors are (estimate - measured) / measured."""
    predicted = stage.total_recompute if recompute else stage.total
    actual = int(measured["peak_bytes"])
    row = {
        "stage": stage.stage,
        "estimate": predicted,
        "measured": actual,
        "error": (predicted - actual) / actual,
        **{k: v for k, v in measured.items() if k not in ("peak_bytes", "pp_rank")},
    }
    if "static_bytes" in measured:
        static = int(measured["static_bytes"])
        dynamic_est = predicted - stage.static
        dynamic = actual - static
        row.update(
            static_estimate=stage.static,
            static_measured=static,
            static_error=(stage.static - static) / static if static else float("nan"),
            dynamic_estimate=dynamic_est,
            dynamic_measured=dynamic,
            dynamic_error=(dynamic_est - dynamic) / dynamic if dynamic else float("nan"),
        )
    return row
