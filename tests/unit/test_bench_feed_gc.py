"""benchmarks/feed_gc.py: a short run of the broker benchmark's consumer heap times both collector settings,
and the frozen one has its start-up objects frozen (each variant in its own process)."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "feed_gc.py"


def test_a_short_run_reports_both_settings(tmp_path):
    out = tmp_path / "feed_gc.json"
    cmd = [sys.executable, str(SCRIPT), "--heaps", "bench", "--tokens", "64", "--batches", "20"]
    done = subprocess.run(
        [*cmd, "--batch-groups", "4", "--repeats", "1", "--out", str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    medians = json.loads(out.read_text())["medians"]
    assert set(medians) == {"bench/default", "bench/frozen"}
    for m in medians.values():
        assert m["cpu_us_per_sample"] > 0 and m["batch_ms_max"] >= m["batch_ms_median"] > 0
        assert m["objects_tracked"] > 1000  # the imports' objects, frozen or not
    # (an import may freeze a few objects of its own: the frozen variant freezes the whole start-up heap)
    assert medians["bench/frozen"]["objects_frozen"] > medians["bench/default"]["objects_frozen"] + 1000
    assert "bench/frozen" in done.stdout and "CPU us/sample" in done.stdout
