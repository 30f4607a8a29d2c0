"""scripts/gpu/collect_results.py on a real pytest JUnit report and benchmark outputs (no GPU needed)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "collect_results.py"


def _load():
    spec = importlib.util.spec_from_file_location("collect_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _junit(tmp_path: Path) -> Path:
    (tmp_path / "test_sample.py").write_text(
        textwrap.dedent(
            """
            import pytest

            def test_ok():
                pass

            def test_bad():
                assert 1 == 2, "one is not two"

            @pytest.mark.skip(reason="no device here")
            def test_skipped():
                pass

            @pytest.mark.xfail(strict=True, reason="known bug")
            def test_known():
                assert False
            """
        )
    )
    report = tmp_path / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         "-c", "/dev/null", f"--junitxml={report}", str(tmp_path / "test_sample.py")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    return report


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    return _junit(tmp_path_factory.mktemp("junit"))


def test_junit_outcomes_are_classified(report):
    parsed = _load().parse_junit(report)
    outcomes = {c["test"].rsplit("::", 1)[1]: c["outcome"] for c in parsed["cases"]}
    assert outcomes == {
        "test_ok": "passed",
        "test_bad": "failed",
        "test_skipped": "skipped",
        "test_known": "xfailed",
    }
    assert parsed["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "xfailed": 1}
    bad = next(c for c in parsed["cases"] if c["test"].endswith("test_bad"))
    assert "one is not two" in bad["detail"]


def test_results_json_folds_tests_and_benchmarks(report, tmp_path, monkeypatch, capsys):
    bench, status = tmp_path / "bench", tmp_path / "status"
    bench.mkdir()
    status.mkdir()
    (bench / "engine_throughput.json").write_text(json.dumps({"rows": [{"batch": 1, "engine_tok_s": 5.0}]}))
    (status / "engine_throughput.status").write_text("0\n")
    (status / "trainer_throughput.status").write_text("absent\n")
    out = tmp_path / "results.json"
    argv = ["collect_results.py", "--out", str(out), "--junit", str(report), "--bench-dir", str(bench),
            "--status-dir", str(status), "--tests-rc", "1", "--seconds", "12"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    _load().main()
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    assert results["pytest_exit"] == "1" and results["seconds"] == 12
    assert results["tests"]["counts"]["failed"] == 1
    assert results["benchmarks"] == {
        "engine_throughput": {"status": "0", "figures": {"rows": [{"batch": 1, "engine_tok_s": 5.0}]}},
        "trainer_throughput": {"status": "absent"},
    }
    assert "python" in results["environment"]
    assert "failed" in printed and "skipped x1: no device here" in printed
