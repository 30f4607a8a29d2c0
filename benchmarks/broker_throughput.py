"""Samples/s and MB/s from 2 producers to 1 consumer: tidal's broker against three baselines, same bytes.

Each sample is ``tokens`` x (int32 id + float32 logprob + int32 version) plus ~200 B of metadata. Methods:

- ``zmq``: raw pyzmq PUSH/PULL, one msgpack frame per sample (the ceiling: no broker, no journal);
- ``broker``: a ``tidal broker`` process (journal on, default fsync policy ``interval``); producers are
  rollout-node clients on uvloop, as `tidal rollout` runs them (a standing lease request the broker fills as groups are submitted, or with
  ``--request-leases`` one ``lease`` call each; then submit whole groups of ``--group-size`` samples), the
  consumer is the trainer client: ``get_batch`` of ``--batch-groups`` groups (the broker's default) one
  ahead on a thread, asking the broker one batch further ahead while it waits for its batch as the trainer
  does (``--ask-ahead``), and after each batch ``publish_version`` (as the trainer after a step) and
  ``report_consumed``, sent without waiting for their replies (``--wait-reports`` waits). The broker admits
  by its staleness bound (``--max-staleness``, policy ``keep``), so what it holds stays bounded as in a run;
  ``--open-admission`` publishes no versions and opens the bound wide (producers run ahead, the broker
  holds most of the run's bytes: the setting of the figures before session 4);
- ``ray_deque``: verl's pattern, a Ray actor holding a deque, one ``put`` and one ``get`` call per sample;
- ``ray_queue``: ``ray.util.queue.Queue`` with batched puts and gets (``--ray-batch`` samples a call).

Every method runs ``--repeats`` times per size, interleaved; the table shows medians and the broker's ratio
to each baseline, and the CPU time per sample of each process (producers, broker, consumer); stderr also
has the broker's CPU per sample by thread (event loop, journal writer and fsync, ZeroMQ I/O) and its peak
resident memory, and per run the cores busy on the host against those the run's processes used (the rest
is other work) and the journal device's read and write MB/s (a broker run bound by the device shows
idle cores of its own and the disk's bandwidth in use), and the share of their time the producers waited
for leases and the consumer for batches (both high with idle cores: the run is bound by the latency of the
cycle the staleness bound closes, batch -> trainer version -> leases -> groups -> batch; with every core
busy a process also waits while the others run), and for every method the share of the run's wall time each
process (a producer, the consumer, the broker and its event loop) ran and waited runnable for a CPU (the
scheduler's own clocks; high waits with cores idle: the processes are runnable in bursts). Ray is optional (``make bench-deps``); without it those columns are skipped. Temporary
folders (the journals: GBs at 32K tokens) are removed also when a run fails.

    .venv/bin/python benchmarks/broker_throughput.py --out runs/bench/broker_throughput.json
    .venv/bin/python benchmarks/broker_throughput.py --sizes 1024 --seconds 2 --repeats 1   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tidal.broker.config import BrokerConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import free_codec  # noqa: E402
from broker_baselines import (  # noqa: E402
    PRODUCERS,
    run_ray_deque,
    run_ray_queue,
    run_zmq,
    sample_bytes,
)
from broker_method import BrokerOptions, run_broker  # noqa: E402
from interpreter_build import describe, interpreter_build  # noqa: E402


def count_for(method: str, tokens: int, seconds: float, guess: dict[str, float]) -> int:
    """Samples for a run of about ``seconds``, from a rough rate (samples/s at 1K tokens) scaled by size."""
    rate = guess[method] * min(1.0, (1024 / tokens) ** 0.8)
    return max(64, int(rate * seconds) // 64 * 64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 8192, 32768], help="tokens per sample")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--seconds",
        type=float,
        default=12.0,
        help="nominal length of one run: its sample count follows a rough rate guess per method and size "
        "(a broker run at 32K tokens moves ~22k samples at 12, ~4 s now). The broker's journal reaches its "
        "steady state (spare files that compactions write over) after two or three compactions, which "
        "shorter runs at 32K tokens end before (docs/protocol.md, Journal)",
    )
    ap.add_argument("--group-size", type=int, default=8, help="samples per group through the broker")
    ap.add_argument("--per-lease", type=int, default=4, help="groups a producer leases and submits at once")
    ap.add_argument("--in-flight", type=int, default=4, help="submissions in flight per broker producer")
    ap.add_argument(
        "--batch-groups",
        type=int,
        default=BrokerConfig().batch_groups,
        help="groups per batch the consumer fetches (default: the broker's default batch_groups)",
    )
    ap.add_argument(
        "--wait-acks",
        action="store_true",
        help="broker producers wait for each submit's acknowledgement (as before protocol v3) "
        "instead of streaming within the client's window",
    )
    ap.add_argument(
        "--request-leases",
        action="store_true",
        help="broker producers ask for each lease (request/reply) instead of standing a lease request "
        "(stream_leases) that the broker fills as their groups are submitted",
    )
    ap.add_argument(
        "--no-journal-reads",
        action="store_true",
        help="the consumer gets group frames on the wire even on the broker's host (as a trainer on "
        "another machine does) instead of reading them from the journal",
    )
    ap.add_argument(
        "--no-submit-memory",
        action="store_true",
        help="producers on the broker's host send their group frames over the wire instead of encoding "
        "them into the memory the broker shares with them (submit_memory)",
    )
    ap.add_argument(
        "--no-memory-reads",
        action="store_true",
        help="the consumer on the broker's host reads batches back from the journal (O_DIRECT) instead "
        "of copying them out of the broker's memory (the broker's journal device then only writes)",
    )
    ap.add_argument(
        "--max-staleness",
        type=int,
        default=BrokerConfig().max_staleness,
        help="the broker's eta (policy keep); the consumer publishes a version after each batch as the "
        "trainer does after each step, so admission bounds what the broker holds (default: the broker's)",
    )
    ap.add_argument(
        "--open-admission",
        action="store_true",
        help="publish no versions and open the staleness bound wide: producers run as far ahead of the "
        "consumer as they can (how the benchmark ran before; the broker then holds most of the run)",
    )
    ap.add_argument(
        "--wait-reports",
        action="store_true",
        help="the consumer waits for each report_consumed / publish_version reply (a durable round trip "
        "per batch) instead of sending them without waiting",
    )
    ap.add_argument(
        "--ask-ahead",
        choices=("starved", "always", "never"),
        default="starved",
        help="when the consumer's client asks for the next batch before it copies and decodes the one it "
        "got (BrokerClient.ask_ahead): while the consumer waits for its batch, as the trainer does "
        "(starved, the default), always, or never (the trainer's rule before session 32)",
    )
    ap.add_argument("--ray-batch", type=int, default=64, help="samples per put/get call for ray_queue")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray baselines")
    ap.add_argument(
        "--broker-set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help='extra broker.* setting for experiments, e.g. journal=\'{"dir": "/dev/shm/j"}\'',
    )
    ap.add_argument(
        "--broker-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment of the broker process, e.g. GLIBC_TUNABLES=glibc.malloc.hugetlb=1",
    )
    ap.add_argument(
        "--free-codec",
        choices=free_codec.LEVELS,
        default=None,
        help="analysis only: the codec's work in every process replaced by the least a native codec could "
        "still do (encode_inspect: encode one copy of a template frame, inspect the header's parse, decode "
        "without validation; all: decoding free too), to bound what one would gain (benchmarks/free_codec.py)",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    interpreter = interpreter_build()
    if args.free_codec:
        free_codec.install(args.free_codec)  # here: the consumer and the producers forked from this process
        site = str(Path(__file__).resolve().parent / "free_codec_site")
        path = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)
        args.broker_env += [f"{free_codec.ENV}={args.free_codec}", f"PYTHONPATH={path}"]

    methods = ["zmq", "broker"]
    if not args.no_ray:
        try:
            import ray

            # the Ray baselines' remote functions live in broker_baselines.py, next to this file
            here = str(Path(__file__).resolve().parent)
            path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
            ray.init(
                num_cpus=4,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
                runtime_env={"env_vars": {"PYTHONPATH": path}},
            )
            methods += ["ray_deque", "ray_queue"]
        except ImportError:
            print("ray is not installed (make bench-deps): skipping the Ray baselines", file=sys.stderr)
    extra = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.broker_set)}
    opts = BrokerOptions(
        group_size=args.group_size,
        per_lease=args.per_lease,
        in_flight=args.in_flight,
        batch_groups=args.batch_groups,
        wait_acks=args.wait_acks,
        journal_reads=not args.no_journal_reads,
        memory_reads=not args.no_memory_reads,
        request_leases=args.request_leases,
        submit_memory=not args.no_submit_memory,
        max_staleness=None if args.open_admission else args.max_staleness,
        wait_reports=args.wait_reports,
        ask_ahead=args.ask_ahead,
        extra=extra,
        env=dict(item.split("=", 1) for item in args.broker_env),
    )
    workdir = Path(tempfile.mkdtemp(prefix="broker-bench-"))
    try:
        results = run_all(args, methods, opts, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # journals of GBs: never leave them behind
    table = summarise(results, methods)
    print_table(table, methods)
    print(f"interpreter: {describe(interpreter)}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "interpreter": interpreter,
                    "runs": results,
                    "summary": table,
                },
                indent=2,
            )
        )
        print(f"wrote {args.out}")
    return 0


def run_all(
    args: argparse.Namespace, methods: list[str], opts: BrokerOptions, workdir: Path
) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """Every method at every size, ``args.repeats`` times, interleaved (one repeat of each in turn)."""
    guess = {"zmq": 40_000, "broker": 30_000, "ray_deque": 500, "ray_queue": 4_000}
    results: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for tokens in args.sizes:
        results[tokens] = {m: [] for m in methods}
        for rep in range(args.repeats):
            for method in methods:
                n = count_for(method, tokens, args.seconds, guess)
                cpu: dict[str, float] = {}
                host: dict[str, float] = {}
                if method == "zmq":
                    elapsed, got, cpu, host = run_zmq(tokens, n, workdir)
                elif method == "broker":
                    elapsed, got, cpu, host = run_broker(tokens, n, workdir, opts)
                elif method == "ray_deque":
                    elapsed, got = run_ray_deque(tokens, n), n // PRODUCERS * PRODUCERS
                else:
                    elapsed, got = run_ray_queue(tokens, n, args.ray_batch), n // PRODUCERS * PRODUCERS
                rate = got / elapsed
                cpu_us = {k: v / got * 1e6 for k, v in cpu.items()}
                results[tokens][method].append(
                    {
                        "samples": got,
                        "seconds": elapsed,
                        "samples_per_s": rate,
                        "mb_per_s": rate * sample_bytes(tokens) / 1e6,
                        "cpu_us_per_sample": cpu_us,
                        "host": host,
                    }
                )
                shown = " ".join(f"{k} {v:.1f}" for k, v in cpu_us.items())
                print(
                    f"  {tokens:>6} tokens  {method:<10} rep {rep}: {rate:>10.0f} samples/s"
                    + (f"   CPU us/sample: {shown} (total {sum(cpu_us.values()):.1f})" if cpu_us else "")
                    + (
                        f"; cores busy: host {host['host_busy_cores']} of {host['host_cores']}, this run"
                        f" {host['run_cores']}; disk MB/s read {host['disk_read_mb_s']} written"
                        f" {host['disk_write_mb_s']}"
                        if host
                        else ""
                    ),
                    file=sys.stderr,
                )
    return results


def summarise(results: dict[int, dict[str, list[dict[str, float]]]], methods: list[str]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for tokens, by_method in results.items():
        row: dict[str, Any] = {}
        for m in methods:
            runs = by_method[m]
            row[m] = {
                "samples_per_s": statistics.median(r["samples_per_s"] for r in runs),
                "mb_per_s": statistics.median(r["mb_per_s"] for r in runs),
            }
            roles = runs[0].get("cpu_us_per_sample", {})
            if roles:
                row[m]["cpu_us_per_sample"] = {
                    k: statistics.median(r["cpu_us_per_sample"][k] for r in runs) for k in roles
                }
        for m in methods:
            if m != "broker":
                row[f"broker_vs_{m}"] = row["broker"]["samples_per_s"] / row[m]["samples_per_s"]
        # Runs of one repeat ran back to back under about the same load: their ratio is the steadier figure.
        row["broker_vs_zmq_paired"] = statistics.median(
            b["samples_per_s"] / z["samples_per_s"]
            for b, z in zip(by_method["broker"], by_method["zmq"], strict=True)
        )
        table[str(tokens)] = row
    return table


def print_table(table: dict[str, Any], methods: list[str]) -> None:
    head = f"{'tokens':>7} | " + " | ".join(f"{m + ' s/s':>14} {'MB/s':>7}" for m in methods)
    ratios = [m for m in methods if m != "broker"]
    head += " | " + " | ".join(f"{'broker/' + m:>16}" for m in ratios) + " | broker/zmq paired"
    print(head)
    print("-" * len(head))
    for tokens, row in table.items():
        line = f"{tokens:>7} | " + " | ".join(
            f"{row[m]['samples_per_s']:>14.0f} {row[m]['mb_per_s']:>7.0f}" for m in methods
        )
        line += " | " + " | ".join(f"{row[f'broker_vs_{m}']:>15.2f}x" for m in ratios)
        line += f" | {row['broker_vs_zmq_paired']:>16.2f}x"
        print(line)
    print("\nCPU microseconds per sample (medians), by process:")
    for tokens, row in table.items():
        for m in methods:
            cpu = row[m].get("cpu_us_per_sample")
            if cpu:
                parts = "  ".join(f"{k} {v:7.1f}" for k, v in cpu.items())
                print(f"{tokens:>7} {m:<8} {parts}  total {sum(cpu.values()):7.1f}")


if __name__ == "__main__":
    sys.exit(main())
