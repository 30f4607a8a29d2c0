"""benchmarks/broker_state_cost.py: a short run times every step of both variants, with either journal writer,
and serves every group it leases."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import broker_state_cost  # noqa: E402


@pytest.mark.parametrize("writer", ["thread", "loop"])
def test_a_short_run_times_every_step_of_both_variants(tmp_path, capsys, writer):
    out = tmp_path / "cost.json"
    argv = ["--tokens", "32", "--groups", "200", "--repeats", "1", "--ring-mib", "8"]
    assert broker_state_cost.main([*argv, "--journal-writer", writer, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for variant, steps in broker_state_cost.STEPS.items():
        (run,) = result["runs"][variant]
        assert run["groups"] == 200  # every group leased was submitted (the floor's: written)
        assert set(run["seconds"]) == set(steps) and all(s > 0 for s in run["seconds"].values())
        assert result["summary"][variant]["all_threads"] >= result["summary"][variant]["total"] > 0
    assert result["runs"]["tidal"][0]["batched"] == 200  # and cut into batches, the last one short
    printed = capsys.readouterr().out
    assert "tidal / floor:" in printed
    assert result["interpreter"]["executable"] == sys.executable and "interpreter: CPython" in printed


def test_a_run_of_no_groups_is_refused():
    with pytest.raises(SystemExit):
        broker_state_cost.main(["--groups", "0"])
