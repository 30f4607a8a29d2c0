"""benchmarks/broker_floor.py: a short run of the least broker path (real broker, producer and consumer
processes on loopback) delivers every sample and journals every group, with tidal's codec and without;
then the driver's table. Never the speed."""

import json
import platform
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import broker_floor  # noqa: E402
from broker_baselines import PRODUCERS, sample_arrays  # noqa: E402
from broker_method import _group  # noqa: E402

from tidal.broker.codec import encode_group  # noqa: E402

GROUP_SIZE, PER_LEASE, BATCH_GROUPS = 4, 2, 4


def _setup(variant: str, groups_per_producer: int) -> broker_floor.Setup:
    args = broker_floor.argparse.Namespace(
        tokens=64,
        samples=groups_per_producer * GROUP_SIZE * PRODUCERS,
        group_size=GROUP_SIZE,
        per_lease=PER_LEASE,
        in_flight=2,
        batch_groups=BATCH_GROUPS,
        max_staleness=1,
    )
    return broker_floor.setup_for(variant, args)


@pytest.mark.parametrize("variant", ["floor", "floor_free_codec", "floor_wire"])
def test_every_sample_arrives_and_every_group_is_journaled(tmp_path, variant):
    s = _setup(variant, groups_per_producer=24)
    assert s.groups_per_producer == 24
    elapsed, received, cpu, journaled = broker_floor.run_floor(s, tmp_path)
    groups = s.groups_per_producer * PRODUCERS
    assert received == groups * GROUP_SIZE
    assert elapsed > 0 and set(cpu) == {"producers", "broker", "consumer"}
    assert all(seconds > 0 for seconds in cpu.values())
    frame = len(encode_group(_group("0:0", sample_arrays(64), GROUP_SIZE)))
    # each group's frame behind an 8-byte length and CRC, plus a small record per batch
    assert journaled >= groups * (frame + 8)
    assert not list(Path("/dev/shm").glob(f"tidal-floor-{broker_floor.os.getpid()}-*"))  # rings removed


def test_the_driver_prints_and_saves_ratios_to_raw_pyzmq(tmp_path, capsys):
    out = tmp_path / "floor.json"
    argv = ["--variants", "floor", "--tokens", "64", "--samples", "2048", "--repeats", "1"]
    argv += ["--group-size", "4", "--per-lease", "2", "--batch-groups", "4", "--out", str(out)]
    assert broker_floor.main(argv) == 0
    saved = json.loads(out.read_text())
    summary = saved["summary"]
    assert set(summary) == {"zmq", "floor"}
    assert summary["zmq"]["vs_zmq_paired"] == 1.0
    assert summary["floor"]["samples_per_s"] > 0
    assert set(summary["floor"]["cpu_us_per_sample"]) == {"producers", "broker", "consumer"}
    printed = capsys.readouterr().out
    assert "/ raw (paired)" in printed
    assert saved["interpreter"]["version"] == platform.python_version()  # which Python the figures are of
    assert f"interpreter: CPython {platform.python_version()} (" in printed
