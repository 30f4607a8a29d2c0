"""Checking the estimate against measured memory: the allocation replay and the per-component comparison."""

import pytest

from tidal.memory_measured import (
    allocation_timeline,
    compare_stage,
    load_measured,
    measured_stages,
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
