"""benchmarks/broker_throughput.py's two local methods, briefly: tidal's broker path (a real broker process,
two producer processes, the trainer's feed) and raw pyzmq each deliver every sample and report their CPU
and how their processes were scheduled; the driver saves its table with the interpreter it ran on. Never the
speed."""

import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import broker_throughput  # noqa: E402
from broker_baselines import PRODUCERS, run_zmq  # noqa: E402
from broker_method import BrokerOptions, run_broker  # noqa: E402

SCHED_KEYS = {"running", "waiting_for_cpu"}


def _shares_are_sane(scheduling: dict, processes: set[str]) -> None:
    assert set(scheduling) == processes
    for shares in scheduling.values():
        assert set(shares) == SCHED_KEYS
        assert all(v >= 0 for v in shares.values())
    # every process ran some of the time (the consumer's and producers' threads summed)
    assert all(s["running"] > 0 for s in scheduling.values())


def test_the_broker_method_delivers_every_sample_and_reports_its_scheduling(tmp_path):
    group_size, groups_per_producer = 4, 16
    n = group_size * groups_per_producer * PRODUCERS
    opts = BrokerOptions(group_size=group_size, per_lease=2, in_flight=2, batch_groups=4)
    elapsed, received, cpu, host = run_broker(64, n, tmp_path, opts)
    assert received == n and elapsed > 0
    assert set(cpu) == {"producers", "broker", "consumer"}
    # the clients time themselves (process_time); the broker's CPU comes from /proc in clock ticks (10 ms),
    # which a run this short may not reach: its scheduler shares below (nanoseconds) show it ran
    assert cpu["producers"] > 0 and cpu["consumer"] > 0 and cpu["broker"] >= 0
    _shares_are_sane(host["scheduling"], {"broker_loop", "broker", "producer", "consumer"})
    # the loop is one of the broker's threads
    assert host["scheduling"]["broker_loop"]["running"] <= host["scheduling"]["broker"]["running"]
    assert 0 <= host["producers_waiting_for_leases"] <= 1


def test_the_broker_loop_is_found_whatever_the_interpreter_is_called(tmp_path, monkeypatch):
    # the broker process's main thread takes the name its interpreter was started by: "python3" on the
    # device host, where the loop's shares read 0 while they were looked up as "python"
    other_name = Path(sys.executable).with_name(f"python{sys.version_info.major}.{sys.version_info.minor}")
    if not other_name.exists():
        other_name = Path(sys.executable).with_name("python3")
    assert other_name.exists(), f"no second name of the interpreter beside {sys.executable}"
    monkeypatch.setattr(sys, "executable", str(other_name))
    opts = BrokerOptions(group_size=4, per_lease=2, in_flight=2, batch_groups=4)
    _, received, _, host = run_broker(64, 4 * 8 * PRODUCERS, tmp_path, opts)
    assert received == 4 * 8 * PRODUCERS
    assert host["scheduling"]["broker_loop"]["running"] > 0


def test_raw_pyzmq_delivers_every_sample_and_reports_its_scheduling(tmp_path):
    elapsed, received, cpu, host = run_zmq(64, 512, tmp_path)
    assert received == 512 and elapsed > 0
    assert set(cpu) == {"producers", "consumer"}
    _shares_are_sane(host["scheduling"], {"producer", "consumer"})


def test_the_driver_saves_the_table_with_the_interpreter_it_ran_on(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    argv = ["--no-ray", "--sizes", "64", "--seconds", "0.3", "--repeats", "1", "--out", str(out)]
    assert broker_throughput.main(argv) == 0
    saved = json.loads(out.read_text())
    row = saved["summary"]["64"]
    assert row["zmq"]["samples_per_s"] > 0 and row["broker"]["samples_per_s"] > 0
    assert row["broker_vs_zmq_paired"] > 0
    assert saved["interpreter"]["version"] == platform.python_version()
    assert f"interpreter: CPython {platform.python_version()} (" in capsys.readouterr().out
