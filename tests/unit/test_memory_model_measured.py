"""Checking the estimate against measured memory: the allocation replay and the per-component comparison."""

import threading

import pytest

from tidal.memory_measured import (
    allocation_timeline,
    compare_stage,
    counted_allocations,
    cpu_memory_counted_on_all_threads,
    load_measured,
    measured_stages,
    profiled_allocations,
    write_peak,
)
from tidal.memory_model import estimate, parallelism
from tidal.model_config import ModelConfig
from tidal.trainer.mesh import MeshConfig

MiB = 1 << 20


def test_allocation_timeline_replays_events_in_time_order():
    # (time, +-bytes): the model's 10 before the mark, then a step that peaks 7 above it; out of order
    events = [(5, -4), (1, 10), (3, 4), (4, 3), (6, -3), (2, 2), (7, -2)]
    timeline = allocation_timeline(events, {"build": 0, "last_step": 2.5, "end": 100})
    assert timeline.peak == 19  # 10 + 2 + 4 + 3
    assert timeline.live_at == {"build": 0, "last_step": 12, "end": 10}
    assert timeline.peak_after == {"build": 19, "last_step": 7, "end": 0}


def test_a_step_that_only_frees_has_no_dynamic_peak():
    timeline = allocation_timeline([(1, 8), (3, -8)], {"last_step": 2})
    assert timeline.live_at["last_step"] == 8 and timeline.peak_after["last_step"] == 0


def test_counted_allocations_follow_the_counter_between_this_threads_events():
    # (time, +-bytes, counter after it): another thread freed 6 bytes between the second and third events
    samples = [(3, 4, 10), (1, 8, 8), (5, -2, 2)]
    assert counted_allocations(samples) == [(1, 8), (3, 2), (5, -8)]
    assert allocation_timeline(counted_allocations(samples), {}).peak == 10


def _profiled_allocations(free_on_other_thread):
    """(time, +-bytes, counter) of this thread's allocation events while a 1 MiB tensor is made here
    and dropped by another thread, three times."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    held = []
    with (
        cpu_memory_counted_on_all_threads(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        for _ in range(3):
            held.append(torch.empty(MiB, dtype=torch.uint8))
            free_on_other_thread(held)
            torch.empty(16, dtype=torch.uint8)  # an event on this thread after the free
    return profiled_allocations(prof)[0]


def test_frees_on_other_threads_are_counted():
    def free_on_other_thread(held):
        thread = threading.Thread(target=held.clear)
        thread.start()
        thread.join()

    samples = _profiled_allocations(free_on_other_thread)
    # this thread's own events never see the frees: replayed alone, 3 MiB stay live
    replay = allocation_timeline([(t, n) for t, n, _ in samples], {"end": max(t for t, _, _ in samples) + 1})
    assert replay.live_at["end"] == 3 * MiB
    counted = allocation_timeline(counted_allocations(samples), {"end": max(t for t, _, _ in samples) + 1})
    assert counted.live_at["end"] == 0 and counted.peak == MiB


def test_compare_stage_splits_the_error_into_static_and_dynamic(tmp_path):
    model = ModelConfig(family="qwen3")
    stage = estimate(
        model, parallelism(MeshConfig(), 1, 2), "dist_opt", 1024, bf16=False, device="cpu"
    ).stages[0]
    # the rank with the larger peak stands for the stage; its static part 10% above the estimate, its
    # dynamic part 20% below
    static = int(stage.static * 1.1)
    dynamic = int((stage.total - stage.static) * 0.8)
    write_peak(
        tmp_path, rank=0, pp_rank=0, peak_bytes=static + dynamic, static_bytes=static, step_peak_bytes=3
    )
    write_peak(tmp_path, rank=1, pp_rank=0, peak_bytes=MiB, static_bytes=MiB // 2)
    entry = measured_stages(tmp_path)[0]
    assert entry["rank"] == 0 and load_measured(tmp_path) == {0: static + dynamic}
    row = compare_stage(stage, entry, recompute=False)
    assert row["static_error"] == pytest.approx(1 / 1.1 - 1, rel=1e-4)
    assert row["dynamic_error"] == pytest.approx(1 / 0.8 - 1, rel=1e-4)
    assert row["error"] == pytest.approx((stage.total - static - dynamic) / (static + dynamic))
    assert row["step_peak_bytes"] == 3  # extra fields of the entry travel with the row
    recompute = compare_stage(stage, entry, recompute=True)
    assert recompute["estimate"] == stage.total_recompute < row["estimate"]


def test_on_cpu_rms_norms_keep_their_normalised_input_too():
    model = ModelConfig(family="qwen3")
    p = parallelism(MeshConfig(), 1, 2)
    cuda = estimate(model, p, "dist_opt", 1024, bf16=False, device="cuda").stages[0]
    cpu = estimate(model, p, "dist_opt", 1024, bf16=False, device="cpu").stages[0]
    # per layer: two hidden-size norms, and the q- and k-norms (4 heads of 32, 2 KV heads); the final norm
    per_layer = 2 * 128 + 4 * 32 + 2 * 32
    assert cpu.activations - cuda.activations == pytest.approx(2 * per_layer * 4 * 1024)
    assert cpu.logits - cuda.logits == pytest.approx(128 * 4 * 1024)
