"""Tidal's broker path as ``broker_throughput.py`` (and ``broker_floor.py``'s ``tidal`` variant) runs it: a
``tidal broker`` process, 2 rollout-node producers on uvloop and the trainer's feed as the consumer, with
the CPU each used. See broker_throughput.py's docstring for what each side does and its options.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import uvloop

from tidal.broker.client import AsyncBrokerClient, BrokerClient
from tidal.broker.config import BrokerConfig
from tidal.broker.testing import start_broker
from tidal.broker.types import Group, Sample
from tidal.heap import freeze_start_up_heap
from tidal.procs import free_port, stop, tail

sys.path.insert(0, str(Path(__file__).resolve().parent))
from broker_baselines import BATCH_WAIT_S, META, PRODUCERS, sample_arrays  # noqa: E402
from proc_stats import (  # noqa: E402
    SCHED_KEYS,
    HostWindow,
    SchedWindow,
    cpu_seconds,
    main_thread_name,
    sched_line,
    sched_mean,
    sched_totals,
    status_kib,
    thread_cpu_seconds,
)


def _group(group_id: str, arrays: dict[str, np.ndarray], group_size: int) -> Group:
    samples = [
        Sample(
            prompt_ids=np.zeros(0, np.int32),
            reward=1.0,
            finish_reason="stop",
            meta=META,
            **arrays,
        )
        for _ in range(group_size)
    ]
    return Group(group_id=group_id, samples=samples)


def _broker_producer(
    address: str,
    tokens: int,
    groups: int,
    group_size: int,
    per_lease: int,
    in_flight: int,
    wait_acks: bool,
    request_leases: bool,
    submit_memory: bool,
    go,
    cpu,
) -> None:
    arrays = sample_arrays(tokens)
    waited = [0.0]  # seconds spent waiting for a pushed lease (the broker's admission, or its latency)

    async def loop(client: AsyncBrokerClient, share: int) -> None:
        acks = []
        while share > 0:
            t = time.perf_counter()
            lease = await client.lease(min(per_lease, share))
            if lease is None:
                await asyncio.sleep(0.001)
            waited[0] += time.perf_counter() - t
            if lease is None:
                continue
            groups = [_group(pg.group_id, arrays, group_size) for pg in lease.groups]
            if wait_acks:
                await client.submit(lease.lease_id, groups)
            else:  # stream: the next lease while the broker journals these (the client's window bounds it)
                acks.append(await client.submit_streamed(lease.lease_id, groups))
            share -= len(lease.groups)
        for ack in acks:
            await ack

    async def streamed(client: AsyncBrokerClient, share: int) -> None:
        # Leases pushed under the standing request, up to ``per_lease * in_flight`` groups in flight.
        await client.stream_leases(credit=per_lease * in_flight, max_groups=per_lease)
        submits = []
        while share > 0:
            t = time.perf_counter()
            lease = await client.next_lease(120)
            waited[0] += time.perf_counter() - t
            if lease is None:
                raise RuntimeError("no lease pushed within 120 s")
            take = lease.groups[:share]
            share -= len(take)
            if len(take) < len(lease.groups):
                await client.release(lease.lease_id, [pg.group_id for pg in lease.groups[len(take) :]])
            groups = [_group(pg.group_id, arrays, group_size) for pg in take]
            if wait_acks:  # the credit bounds how many wait at once
                submits.append(asyncio.ensure_future(client.submit(lease.lease_id, groups)))
            else:
                submits.append(await client.submit_streamed(lease.lease_id, groups))
        await asyncio.gather(*submits)
        await client.stream_leases(0)
        for lease in client.pushed_leases():
            await client.release(lease.lease_id)

    async def main() -> None:
        client = AsyncBrokerClient(address, timeout_s=120, submit_memory=submit_memory)
        await client.register("rollout", "bench")
        go.wait()
        c0, t0 = time.process_time(), time.perf_counter()
        sched = SchedWindow()
        if request_leases:
            # several submissions in flight per producer, as a node agent with several engines has
            shares = [groups // in_flight + (i < groups % in_flight) for i in range(in_flight)]
            await asyncio.gather(*(loop(client, share) for share in shares))
        else:
            await streamed(client, groups)
        threads = sched.result()  # before the close, which may end ZeroMQ's I/O thread (and its record)
        await client.close()
        loops = in_flight if request_leases else 1  # the waits of concurrent loops add up
        busy = (time.perf_counter() - t0) * loops
        cpu.put(
            (
                time.process_time() - c0,
                client.span_submits,
                client.wire_submits,
                waited[0] / busy,
                sched_totals(threads),
            )
        )

    uvloop.run(main())  # as `tidal rollout` runs its node agent (rollout/main.py)


@dataclass
class BrokerOptions:
    """How the broker method runs (the command line's broker flags)."""

    group_size: int = 8
    per_lease: int = 4
    in_flight: int = 4
    batch_groups: int = BrokerConfig().batch_groups
    wait_acks: bool = False
    journal_reads: bool = True
    memory_reads: bool = True  # the consumer copies batches out of the broker's memory (else the journal)
    request_leases: bool = False
    submit_memory: bool = True  # producers encode into memory shared with the broker (submit_memory)
    # The consumer publishes a policy version after each batch, as the trainer does after each step, and
    # the broker admits by its staleness bound (this eta; "keep": nothing is dropped): the groups held
    # stay bounded and the broker reuses its memory. None: no versions, admission wide open (producers
    # may run arbitrarily far ahead of the consumer).
    max_staleness: int | None = BrokerConfig().max_staleness
    wait_reports: bool = False  # the consumer waits for each report_consumed / publish_version reply
    # when the consumer's client asks for the next batch before decoding this one (BrokerClient.ask_ahead):
    # "starved" as the trainer (while it waits for its batch), "always" or "never"
    ask_ahead: str = "starved"
    extra: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # extra environment of the broker process


def _start(run_dir: Path, groups_total: int, batch_groups: int, publish: bool, opts: BrokerOptions):
    """The broker process, with ``opts.env`` added to its environment (start_broker takes none)."""
    saved = {k: os.environ.get(k) for k in opts.env}
    os.environ.update(opts.env)
    try:
        return _start_broker(run_dir, groups_total, batch_groups, publish, opts)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _start_broker(run_dir: Path, groups_total: int, batch_groups: int, publish: bool, opts: BrokerOptions):
    return start_broker(
        run_dir,
        groups_total + 8,
        port=free_port(),
        group_size=opts.group_size,
        batch_groups=batch_groups,
        max_staleness=opts.max_staleness if publish else 1_000_000,
        staleness_policy="keep",
        max_frame_bytes=1 << 30,
        **opts.extra,
    )


def run_broker(
    tokens: int, n: int, workdir: Path, opts: BrokerOptions
) -> tuple[float, int, dict[str, float], dict[str, float]]:
    groups_total = n // opts.group_size
    per_producer = groups_total // PRODUCERS
    batch_groups = max(1, min(opts.batch_groups, per_producer))
    run_dir = Path(tempfile.mkdtemp(prefix=f"broker{tokens}-", dir=workdir))
    publish = opts.max_staleness is not None
    procs: list[mp.Process] = []
    proc = None
    try:
        proc, address = _start(run_dir, groups_total, batch_groups, publish, opts)
        go, cpu = mp.Event(), mp.Queue()
        args = (opts.per_lease, opts.in_flight, opts.wait_acks, opts.request_leases, opts.submit_memory)
        procs = [
            mp.Process(
                target=_broker_producer,
                args=(address, tokens, per_producer, opts.group_size, *args, go, cpu),
            )
            for _ in range(PRODUCERS)
        ]
        for p in procs:
            p.start()
        # The consumer is tidal's trainer feed (trainer/main.py): the next batch is fetched on a thread
        # while the current one is consumed, and versions and progress go out on a second connection.
        with (
            BrokerClient(address, timeout_s=120) as trainer,
            BrokerClient(
                address,
                timeout_s=120,
                read_journal=opts.journal_reads,
                read_memory=opts.memory_reads,
                ask_ahead=opts.ask_ahead == "always",
            ) as fetcher,
            ThreadPoolExecutor(max_workers=1) as pool,
        ):
            trainer.register("trainer", "bench")
            freeze_start_up_heap()  # as the trainer does before its first step (trainer/main.py)
            time.sleep(0.5)
            broker0 = cpu_seconds(proc.pid)
            threads0 = thread_cpu_seconds(proc.pid)
            loop_thread = main_thread_name(proc.pid)
            window = HostWindow(run_dir)
            broker_sched, consumer_sched = SchedWindow(proc.pid), SchedWindow()
            go.set()
            t0, c0 = time.perf_counter(), time.process_time()
            groups_left = per_producer * PRODUCERS
            sizes = [min(batch_groups, groups_left - i) for i in range(0, groups_left, batch_groups)]
            ahead = pool.submit(fetcher.get_batch, -1, sizes[0], BATCH_WAIT_S)
            received = 0
            wait = opts.wait_reports
            batch_wait = 0.0  # seconds the consumer waited for its next batch (fetch, copy and decode)
            for i in range(len(sizes)):
                t = time.perf_counter()
                if opts.ask_ahead == "starved":
                    fetcher.ask_ahead = not ahead.done()  # the trainer's rule (trainer/main.py)
                batch = ahead.result()
                batch_wait += time.perf_counter() - t
                if batch is None:
                    codes = [p.exitcode for p in procs]
                    raise RuntimeError(
                        f"no batch within {BATCH_WAIT_S} s; producer exit codes {codes}\n"
                        f"--- the broker's log ({run_dir / 'broker.log'}), last lines:\n{tail(run_dir / 'broker.log', 40)}"
                    )
                if i + 1 < len(sizes):
                    ahead = pool.submit(fetcher.get_batch, batch.batch_id, sizes[i + 1], BATCH_WAIT_S)
                received += sum(len(g.samples) for g in batch.groups)
                if publish:
                    trainer.publish_version(batch.batch_id + 1, wait=wait)
                trainer.report_consumed(batch.batch_id, wait=wait)
            elapsed, consumer = time.perf_counter() - t0, time.process_time() - c0
            window.stop()
            broker_threads_sched, consumer_threads_sched = broker_sched.result(), consumer_sched.result()
            broker = cpu_seconds(proc.pid) - broker0
            threads = thread_cpu_seconds(proc.pid)
            # By thread: ZeroMQ's I/O thread (receiving group frames), the event loop (the main thread), the
            # journal's writer and fsync threads: where the broker's time goes.
            per = {
                k: round((v - threads0.get(k, 0.0)) / max(received, 1) * 1e6, 1)
                for k, v in threads.items()
                if v - threads0.get(k, 0.0) > 0
            }
            local = fetcher._local
            print(
                f"    broker threads, CPU us/sample: {per}; broker peak RSS {status_kib('VmHWM', proc.pid) / 1024:.0f} MB;"
                f" batches copied from the broker's memory {local.batches_copied}, read from its journal"
                f" {local.batches_read}",
                file=sys.stderr,
            )
        reports = [cpu.get() for _ in procs]
        producers = sum(r[0] for r in reports)
        lease_wait = sum(r[3] for r in reports) / len(reports)
        batch_wait_share = batch_wait / elapsed
        print(
            f"    producer submits through shared memory {sum(r[1] for r in reports)}, over the wire"
            f" {sum(r[2] for r in reports)}; waiting for leases {lease_wait:.0%} of the"
            f" producers' time (leases come as the trainer's versions admit them), the consumer for"
            f" batches {batch_wait_share:.0%} of its own",
            file=sys.stderr,
        )
        # Each process's threads summed (a producer's: the mean of the two); the broker's event loop is
        # its main thread. Shares of the run's wall time, so a process's threads may add up past 1.
        sched = {
            "broker_loop": broker_threads_sched.get(loop_thread, dict.fromkeys(SCHED_KEYS, 0.0)),
            "broker": sched_totals(broker_threads_sched),
            "producer": sched_mean([r[4] for r in reports]),
            "consumer": sched_totals(consumer_threads_sched),
        }
        print(sched_line(sched), file=sys.stderr)
        for p in procs:
            p.join()
        cpu_s = {"producers": producers, "broker": broker, "consumer": consumer}
        host = window.result(sum(cpu_s.values()))
        host["producers_waiting_for_leases"] = round(lease_wait, 3)
        host["consumer_waiting_for_batches"] = round(batch_wait_share, 3)
        host["scheduling"] = sched
        return elapsed, received, cpu_s, host
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if proc is not None:
            stop(proc)
        shutil.rmtree(run_dir, ignore_errors=True)  # its journal: GBs at 32K tokens


# ---------------------------------------------------------------------------------------------- driver
