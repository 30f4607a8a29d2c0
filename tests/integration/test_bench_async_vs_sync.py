"""A very short run of benchmarks/async_vs_sync.py end to end: real broker, node agent and trainer processes
over stand-in engines and train steps. Checks the figures' structure and the scheduling invariants
(staleness, batch order, every batch whole), never the speed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ETA = 2
STEPS = 4
BATCH_GROUPS = 4
GROUP_SIZE = 2


def _run_benchmark(tmp_path: Path, eta: int, lease_poll_s: float) -> tuple[dict, str]:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "async_vs_sync.py"),
        "--steps", str(STEPS),
        "--warmup", "1",
        "--etas", str(eta),
        "--batch-groups", str(BATCH_GROUPS),
        "--group-size", str(GROUP_SIZE),
        "--nodes", "1",
        "--concurrency", "4",
        "--median-tokens", "16",
        "--max-tokens", "64",
        "--train-overhead-ms", "5",
        "--lease-poll-s", str(lease_poll_s),
        "--timeout-s", "60",
        "--work-dir", str(tmp_path / "work"),
        "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:  # SIGTERM lets the benchmark stop the broker, nodes and trainer it started
            proc.terminate()
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return json.loads(out.read_text()), stdout


@pytest.mark.slow
def test_short_benchmark_run_keeps_the_scheduling_invariants(tmp_path):
    report, stdout = _run_benchmark(tmp_path, ETA, lease_poll_s=0.05)
    assert "ideal bound" in stdout and "x sync" in stdout
    cap = report["capacities"]
    assert cap["ideal_samples_per_s"] == min(cap["rollout_samples_per_s"], cap["trainer_samples_per_s"])
    assert cap["trainer_samples_per_s"] == pytest.approx(cap["rollout_samples_per_s"])  # --balance 1
    # by default the agents lease by free sample slots: no fixed cap on groups in flight
    assert cap["groups_in_flight_per_node"] is None and cap["inflight_bound_samples_per_s"] is None
    assert [r["eta"] for r in report["results"]] == [0, ETA]
    assert set(report["goal"]) == {"eta2_over_sync", "eta2_over_ideal", "met"}

    for result in report["results"]:
        eta, steps = result["eta"], result["steps"]
        assert [s["batch_id"] for s in steps] == list(range(STEPS))
        # the broker cuts batch b when the trainer, at version b, asks for it
        assert [s["cut_version"] for s in steps] == list(range(STEPS))
        for s in steps:
            assert s["samples"] == BATCH_GROUPS * GROUP_SIZE
            assert len(s["staleness"]) == BATCH_GROUPS
            assert all(0 <= x <= eta for x in s["staleness"]), (eta, s["staleness"])
        assert result["staleness"]["max"] <= eta
        # what the trainer observed is what the broker recorded when it cut the batches
        broker_hist = {str(k): v for k, v in result["broker_staleness_histogram"].items()}
        assert broker_hist == {str(k): v for k, v in result["staleness"]["histogram"].items()}
        assert result["samples_per_s"] > 0 and 0 < result["trainer_busy"] <= 1
        # a node submits each group as it finishes: at least one request per group trained
        assert result["broker_requests_per_group"] >= 1
    sync = report["results"][0]
    assert sync["staleness"]["histogram"] == {"0": STEPS * BATCH_GROUPS}
    assert sync["dropped_stale_groups"] == 0


@pytest.mark.slow
def test_a_node_starts_the_next_prompts_when_the_trainers_version_admits_them_not_after_a_poll(tmp_path):
    """Synchronous training closes admission after every batch; the trainer's next version opens it. The
    broker pushes the next leases then (a standing lease request): a node asking for each lease waited
    ``lease_poll_s`` after every refusal, so each step took at least that long."""
    lease_poll_s = 10.0
    report, _ = _run_benchmark(tmp_path, 1, lease_poll_s)
    for result in report["results"]:
        assert result["median_step_s"] < lease_poll_s / 5, (result["mode"], result["median_step_s"])
