"""benchmarks/gpu_idle.py charges each device gap to what the host was doing (synthetic traces: the
analysis is pure bookkeeping over profiler events, and no GPU runs here)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "gpu_idle", Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_idle.py"
)
gpu_idle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_idle)

HOST, GPU = 1, 7


def _x(cat, name, ts, dur, tid=HOST, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0, "args": args}


def _kernel(ts, dur, correlation):
    return _x("kernel", f"k{correlation}", ts, dur, tid=GPU, correlation=correlation)


def _launch(ts, correlation):
    return _x("cuda_runtime", "cudaLaunchKernel", ts, 2, correlation=correlation)


def test_a_late_launch_is_charged_to_the_host_stack_that_delayed_it():
    events = [
        _kernel(0, 100, 1),
        _launch(0, 1),
        _x("python_function", "trainer/step.py(10): train_step", 50, 300),
        _x("python_function", "megatron/core/optimizer/optimizer.py(400): step", 90, 200),
        _x("cpu_op", "aten::_foreach_norm", 100, 150),
        _launch(250, 2),  # inside the foreach op: the device waits from 100 to 260
        _kernel(260, 40, 2),
    ]
    report = gpu_idle.analyse(events, steps=1)
    assert report["idle_ms_per_step"] * 1e3 == 160
    top = report["by_stack"][0]
    assert top["where"] == "host: step.py:train_step > optimizer.py:step | aten::_foreach_norm"
    assert round(sum(r["ms_per_step"] for r in report["by_stack"]) * 1e3) == 160


def test_a_gap_after_a_host_sync_is_charged_to_the_sync():
    events = [
        _kernel(0, 500, 1),
        _launch(0, 1),
        _x("python_function", "trainer/step.py(20): grad_norm", 10, 700),
        _x("cpu_op", "aten::item", 20, 490),
        _x("cuda_runtime", "cudaMemcpyAsync", 30, 475),  # waits for the kernel, returns at 505
        _launch(650, 2),
        _kernel(660, 10, 2),
    ]
    report = gpu_idle.analyse(events, steps=2)
    (row,) = report["by_stack"]
    assert row["where"] == "after sync: step.py:grad_norm | cudaMemcpyAsync"
    assert abs(row["ms_per_step"] - 0.080) < 1e-9  # the 160 us gap over 2 steps


def test_a_kernel_launched_early_is_not_charged_to_the_host():
    events = [_kernel(0, 100, 1), _launch(0, 1), _launch(5, 2), _kernel(150, 10, 2)]
    report = gpu_idle.analyse(events, steps=1)
    assert report["by_stack"][0]["where"].startswith("(launched before the gap")
    assert report["gaps_per_step"] == 1


def test_a_trace_without_device_activity_says_so():
    report = gpu_idle.analyse([_x("cpu_op", "aten::mm", 0, 10)], steps=1)
    assert "no device activity" in gpu_idle.format_report(report)
