"""benchmarks/codec_cost.py: the fit separates a frame's fixed cost from its per-sample cost, and a short run
times every stage at every size."""

import json
import math
import sys
from pathlib import Path

import pytest

from tidal.broker import native_codec

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import codec_cost  # noqa: E402


def test_the_fit_recovers_a_line():
    assert codec_cost.fit([8, 16, 32], [10 + 2 * n for n in (8, 16, 32)]) == pytest.approx((10.0, 2.0))


@pytest.mark.skipif(native_codec.load()[0] is None, reason="the native codec cannot be built here")
def test_a_short_run_times_every_stage_at_every_size(tmp_path, capsys):
    out = tmp_path / "codec.json"
    argv = ["--tokens", "64", "--group-sizes", "2", "4", "--number", "3", "--repeats", "1", "--out", str(out)]
    assert codec_cost.main(argv) == 0
    result = json.loads(out.read_text())
    assert set(result["codecs"]) == set(codec_cost.CODECS)
    for got in result["codecs"].values():
        assert set(got["us_per_frame"]) == {"2", "4"}
        for timings in got["us_per_frame"].values():
            assert set(timings) == set(codec_cost.STAGES) and all(t > 0 for t in timings.values())
        assert all(math.isfinite(f["per_frame_us"]) for f in got["fit"].values())
    printed = capsys.readouterr().out
    assert "native codec" in printed and "python codec" in printed and "python / native" in printed


def test_one_size_cannot_be_fitted():
    with pytest.raises(SystemExit):
        codec_cost.main(["--group-sizes", "8"])
