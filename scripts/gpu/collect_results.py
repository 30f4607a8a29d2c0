"""Fold the GPU suite's outputs into one results.json and print a short summary (run_suite.sh's last step).

Inputs: pytest's JUnit XML, the benchmarks' JSON files and each benchmark's exit status. The summary is
printed last so that the device tool's output tail carries it.
"""

from __future__ import annotations

import argparse
import json
import platform
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path


def parse_junit(path: Path) -> dict:
    if not path.exists():
        return {"present": False}
    root = ET.parse(path).getroot()
    cases = []
    for case in root.iter("testcase"):
        outcome, detail = "passed", ""
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                detail = (node.get("message") or node.text or "").strip()
                if kind == "skipped" and node.get("type") == "pytest.xfail":
                    outcome = "xfailed"
                break
        cases.append(
            {
                "test": f"{case.get('classname', '')}::{case.get('name', '')}",
                "outcome": outcome,
                "seconds": float(case.get("time") or 0),
                "detail": detail[:2000],
            }
        )
    counts: dict[str, int] = {}
    for c in cases:
        counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    return {"present": True, "counts": counts, "cases": cases}


def environment() -> dict:
    env = {"python": platform.python_version()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env["device"] = props.name
            env["device_memory_gib"] = round(props.total_memory / 2**30, 1)
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # the summary must still be written
        env["torch_error"] = repr(exc)
    for dist in ("transformers", "megatron-core", "triton"):
        try:
            env[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[dist] = "not installed"
    return env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--junit", required=True)
    p.add_argument("--bench-dir", required=True)
    p.add_argument("--status-dir", required=True)
    p.add_argument("--tests-rc", default="skipped")
    p.add_argument("--seconds", type=float, default=0.0)
    a = p.parse_args()

    benches = {}
    for status in sorted(Path(a.status_dir).glob("*.status")):
        name = status.stem
        entry: dict = {"status": status.read_text().strip()}
        figures = Path(a.bench_dir) / f"{name}.json"
        if figures.exists():
            entry["figures"] = json.loads(figures.read_text())
        benches[name] = entry
    results = {
        "environment": environment(),
        "seconds": a.seconds,
        "pytest_exit": a.tests_rc,
        "tests": parse_junit(Path(a.junit)),
        "benchmarks": benches,
    }
    Path(a.out).write_text(json.dumps(results, indent=1))

    print(json.dumps(results["environment"]))
    tests = results["tests"]
    if tests.get("present"):
        print("tests:", json.dumps(tests["counts"]))
        skipped: dict[str, int] = {}
        for c in tests["cases"]:
            first_line = c["detail"].splitlines()[0][:300] if c["detail"] else ""
            if c["outcome"] == "skipped":
                skipped[first_line] = skipped.get(first_line, 0) + 1
            elif c["outcome"] != "passed":
                print(f"  {c['outcome']:>7} {c['test']}: {first_line}")
        for reason, n in skipped.items():
            print(f"  skipped x{n}: {reason}")
    for name, entry in benches.items():
        print(f"bench {name}: exit {entry['status']}")
        for row in entry.get("figures", {}).get("rows", []):
            print("  ", json.dumps({k: v for k, v in row.items() if not isinstance(v, list)}))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
