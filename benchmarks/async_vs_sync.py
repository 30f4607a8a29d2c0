"""Trained samples/s of synchronous vs asynchronous scheduling, on the real broker, node agents and trainer
loop, with generation and train steps replaced by timed stand-ins (``benchmarks/standins.py``).

Each mode starts, as separate processes on loopback: a ``tidal broker`` (``max_staleness`` = eta; eta = 0
is synchronous on-policy training, rollout and training alternate), ``--nodes`` rollout node agents
(the real :class:`~tidal.rollout.agent.RolloutAgent` and engine pool over one :class:`StandinEngine`
each, whose requests sleep ``--per-token-ms`` per output token, output lengths drawn from a long-tailed
distribution), and one trainer process with the trainer loop's shape over the real ``BrokerClient``:
``get_batch -> timed train step -> weight sync -> publish_version -> report_consumed``. The weight sync
stand-in sets the new version on every engine (over a ZeroMQ request to each node) before the version is
published, as the real sender updates engines before the trainer bumps the version.

The ideal bound is min(rollout capacity, trainer capacity): rollout capacity = engine slots / (per-token
time * E[output length]) (every slot always busy), trainer capacity = batch samples / step time of an
average batch. The train step's per-token time is chosen so that trainer capacity = ``--balance`` x rollout
capacity (1: balanced, where async matters most). Throughput is measured by the trainer over the steps
after ``--warmup`` (pipeline fill); staleness is what the trainer observed (its version minus each group's
oldest token version).

The default scale: 2 nodes x 8 slots, batches of 16 groups x 4 samples, 1 ms per token, lengths
lognormal(median 128, sigma 1) capped at 2048. A batch is 4x the slots, so a balanced train step lasts about
four average generations and the longest (16x the median) spans a few steps, as when long-reasoning
rollouts meet a large batch. A full run (sync and eta = 1, 2, 4, 40 steps each) takes about 5 minutes.

By default the node agents lease by free sample slots. With ``--max-inflight-groups K`` they keep at most
K groups in flight instead, and a second limit is printed beside the ideal bound: a group holds its place
until its longest sample ends, so rollout cannot exceed
``nodes * K * G / (per-token time * E[longest of G])`` (Little's law).

    .venv/bin/python benchmarks/async_vs_sync.py --out runs/bench/async_vs_sync.json
    .venv/bin/python benchmarks/async_vs_sync.py --max-inflight-groups 6 --out runs/bench/async_vs_sync_if6.json
    .venv/bin/python benchmarks/async_vs_sync.py --steps 8 --median-tokens 64 --etas 2   # quick look
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from pydantic import BaseModel, ConfigDict, Field
from standins import (
    LengthDistribution,
    LogNormalLengths,
    StandinEngine,
    StandinTask,
    TrainStepCost,
)

from tidal.broker.client import AsyncBrokerClient, BrokerClient
from tidal.broker.testing import start_broker
from tidal.procs import free_port, spawn, stop, tail

SCRIPT = Path(__file__).resolve()
log = logging.getLogger("async_vs_sync")


class BenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lengths: LengthDistribution = LogNormalLengths()
    per_token_s: float = Field(1e-3, gt=0, description="stand-in engine time per output token")
    prompt_tokens: int = Field(32, ge=1)
    nodes: int = Field(2, ge=1, description="rollout node processes, one stand-in engine each")
    concurrency: int = Field(8, ge=1, description="requests in flight per engine (rollout.concurrency)")
    group_size: int = Field(4, ge=1)
    batch_groups: int = Field(16, ge=1)
    steps: int = Field(40, ge=2, description="train steps per mode")
    warmup: int = Field(3, ge=1, description="first steps left out of the throughput (pipeline fill)")
    train_overhead_s: float = Field(0.05, ge=0, description="fixed part of every train step")
    balance: float = Field(1.0, gt=0, description="trainer capacity / rollout capacity")
    weight_sync_s: float = Field(0.0, ge=0, description="stand-in weight broadcast time per step")
    lease_poll_s: float = Field(0.2, gt=0, description="rollout.agent.lease_poll_s (the agent's default)")
    max_inflight_groups: int | None = Field(
        None, ge=1, description="rollout.agent.max_inflight_groups; None: the agent's default"
    )
    batch_timeout_s: float = Field(120.0, gt=0, description="the trainer gives up waiting for a batch")
    seed: int = 0

    @property
    def batch_samples(self) -> int:
        return self.batch_groups * self.group_size

    @property
    def slots(self) -> int:
        return self.nodes * self.concurrency


def capacities(cfg: BenchConfig) -> dict[str, Any]:
    """Rollout and trainer capacity (samples/s), the train step's per-token time, and how they follow."""
    mean_len = cfg.lengths.mean()
    rollout = cfg.slots / (cfg.per_token_s * mean_len)
    tokens_per_sample = cfg.prompt_tokens + mean_len
    step_s = cfg.batch_samples / (cfg.balance * rollout)  # an average batch's step at the chosen balance
    per_token = (step_s - cfg.train_overhead_s) / (cfg.batch_samples * tokens_per_sample)
    if per_token <= 0:
        raise SystemExit(
            f"--train-overhead-ms {cfg.train_overhead_s * 1e3:g} is longer than a whole train step at "
            f"--balance {cfg.balance:g} ({step_s * 1e3:.1f} ms); lower it or the balance"
        )
    cost = TrainStepCost(overhead_s=cfg.train_overhead_s, per_token_s=per_token)
    trainer = cfg.batch_samples / cost.seconds(cfg.batch_samples * tokens_per_sample)
    ideal = min(rollout, trainer)
    # a fixed group cap (--max-inflight-groups) bounds rollout below the ideal; by default the agent leases
    # by free sample slots and has no such cap
    groups_in_flight = cfg.max_inflight_groups
    longest_of_group = cfg.lengths.mean_max(cfg.group_size)
    inflight = (
        cfg.nodes * groups_in_flight * cfg.group_size / (cfg.per_token_s * longest_of_group)
        if groups_in_flight
        else None
    )
    derivation = [
        f"E[output length] = {mean_len:.1f} tokens ({cfg.lengths.describe()})",
        f"rollout capacity = slots / (per-token time * E[L]) = {cfg.slots} / ({cfg.per_token_s * 1e3:g} ms * "
        f"{mean_len:.1f}) = {rollout:.1f} samples/s",
        f"train step = {cfg.train_overhead_s * 1e3:g} ms + {per_token * 1e6:.3f} us/token * tokens; an average "
        f"batch has {cfg.batch_samples} * ({cfg.prompt_tokens} + {mean_len:.1f}) tokens -> "
        f"{cost.seconds(cfg.batch_samples * tokens_per_sample):.3f} s",
        f"trainer capacity = {cfg.batch_samples} samples / step = {trainer:.1f} samples/s "
        f"(balance {cfg.balance:g} x rollout)",
        f"ideal bound = min(rollout, trainer) = {ideal:.1f} samples/s",
    ]
    if inflight is None:
        derivation.append("the agent leases by free sample slots (no fixed cap on groups in flight)")
    else:
        derivation.append(
            f"not part of the bound: with at most {groups_in_flight} groups in flight per node (the agent's "
            f"max_inflight_groups), each held until its longest sample ends (E[longest of {cfg.group_size}] = "
            f"{longest_of_group:.1f} tokens), rollout cannot exceed nodes * groups * G / (per-token time * "
            f"E[longest]) = {cfg.nodes} * {groups_in_flight} * {cfg.group_size} / ({cfg.per_token_s * 1e3:g} ms * "
            f"{longest_of_group:.1f}) = {inflight:.1f} samples/s (Little's law)"
        )
    return {
        "mean_output_tokens": mean_len,
        "rollout_samples_per_s": rollout,
        "trainer_samples_per_s": trainer,
        "ideal_samples_per_s": ideal,
        "groups_in_flight_per_node": groups_in_flight,
        "mean_longest_of_group_tokens": longest_of_group,
        "inflight_bound_samples_per_s": inflight,
        "train_step": cost.model_dump(),
        "derivation": derivation,
    }


# --- node process ----------------------------------------------------------------------------------


async def serve_versions(address: str, engines: list[StandinEngine]) -> None:
    """The weight-sync stand-in's receiving end: set each version the trainer sends on every engine."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    try:
        while True:
            msg = msgpack.unpackb(await sock.recv())
            for engine in engines:
                await engine.update_weight_version(str(msg["version"]))
            await sock.send(b"ok")
    finally:
        sock.close(0)
        ctx.term()


async def run_node(cfg: BenchConfig, broker: str, name: str, control: str, seed: int) -> int:
    from tidal.rollout.agent import RolloutAgent
    from tidal.rollout.config import AgentConfig, RolloutConfig, SamplingConfig
    from tidal.rollout.engine_pool import EnginePool, EngineSlot

    engine = StandinEngine(f"standin://{name}/0", cfg.lengths, per_token_s=cfg.per_token_s, seed=seed)
    pool = EnginePool(
        [EngineSlot(0, engine.url, port=0, client=engine)],
        concurrency=cfg.concurrency,
        request_timeout_s=600.0,
        start_timeout_s=10.0,
    )
    rollout = RolloutConfig(
        concurrency=cfg.concurrency,
        sampling=SamplingConfig(max_new_tokens=cfg.lengths.max_tokens),
        agent=AgentConfig(
            lease_poll_s=cfg.lease_poll_s, drain_timeout_s=0.0, max_inflight_groups=cfg.max_inflight_groups
        ),
    )
    client = AsyncBrokerClient(broker)
    versions = asyncio.create_task(serve_versions(control, [engine]))
    try:
        await pool.start()
        agent = RolloutAgent(
            rollout, client, pool, StandinTask(cfg.prompt_tokens), name=name, group_size_hint=cfg.group_size
        )
        agent.install_signal_handlers()
        return await agent.run()
    finally:
        versions.cancel()
        await asyncio.gather(versions, return_exceptions=True)
        await pool.close()
        await client.close()


# --- trainer process -------------------------------------------------------------------------------


def push_version(socks: list[zmq.Socket], version: int, timeout_s: float = 30.0) -> None:
    for sock in socks:
        sock.send(msgpack.packb({"version": version}))
    for sock in socks:
        if not sock.poll(int(timeout_s * 1000)):
            raise RuntimeError(f"a node did not acknowledge version {version} within {timeout_s}s")
        sock.recv()


def run_trainer(cfg: BenchConfig, broker: str, controls: list[str], out: Path) -> int:
    """The trainer loop's shape with a timed step in place of forward/backward/optimizer."""
    cost = TrainStepCost(**capacities(cfg)["train_step"])
    ctx = zmq.Context()
    socks = []
    for address in controls:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        socks.append(sock)
    client = BrokerClient(broker)
    client.register("trainer", "standin-trainer")
    records, version, after = [], 0, -1
    origin = time.monotonic()
    try:
        for step in range(cfg.steps):
            t0 = time.monotonic()
            batch = client.get_batch(after, timeout_s=cfg.batch_timeout_s)
            if batch is None:
                raise RuntimeError(
                    f"step {step}: no batch within {cfg.batch_timeout_s}s; broker stats: {client.stats()}"
                )
            t1 = time.monotonic()
            staleness = [version - g.min_version for g in batch.groups]
            cost.run(batch)
            t2 = time.monotonic()
            version += 1
            time.sleep(cfg.weight_sync_s)
            push_version(socks, version)
            t3 = time.monotonic()
            client.publish_version(version)
            client.report_consumed(batch.batch_id)
            after = batch.batch_id
            records.append(
                {
                    "step": step,
                    "batch_id": batch.batch_id,
                    "cut_version": batch.policy_version,
                    "wait_s": t1 - t0,
                    "train_s": t2 - t1,
                    "sync_s": t3 - t2,
                    "end_s": time.monotonic() - origin,
                    "samples": sum(len(g.samples) for g in batch.groups),
                    "response_tokens": sum(int(s.response_ids.size) for g in batch.groups for s in g.samples),
                    "staleness": staleness,
                }
            )
    finally:
        out.write_text(json.dumps({"steps": records}))
        client.close()
        for sock in socks:
            sock.close(0)
        ctx.term()
    return 0


# --- one mode --------------------------------------------------------------------------------------


def run_mode(cfg: BenchConfig, eta: int, work: Path, timeout_s: float) -> dict[str, Any]:
    label = "sync" if eta == 0 else f"async eta={eta}"
    mode_dir = work / ("sync" if eta == 0 else f"async_eta{eta}")
    mode_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = mode_dir / "bench_config.json"
    cfg_path.write_text(cfg.model_dump_json())
    broker, address = start_broker(
        mode_dir,
        rows=(cfg.steps + eta + 4) * cfg.batch_groups,
        group_size=cfg.group_size,
        batch_groups=cfg.batch_groups,
        max_staleness=eta,
    )
    procs = []
    stats: dict[str, Any] = {}
    try:
        controls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(cfg.nodes)]
        nodes = []
        for i, control in enumerate(controls):
            cmd = [sys.executable, str(SCRIPT), "_node", str(cfg_path), address, f"node-{i}", control]
            cmd.append(str(cfg.seed * 1000 + 100 * eta + i))
            nodes.append(spawn(cmd, log_path=mode_dir / f"node-{i}.log"))
        procs += nodes
        trainer_out = mode_dir / "trainer.json"
        trainer = spawn(
            [sys.executable, str(SCRIPT), "_trainer", str(cfg_path), address, str(trainer_out), *controls],
            log_path=mode_dir / "trainer.log",
        )
        procs.append(trainer)
        deadline = time.monotonic() + timeout_s
        while trainer.poll() is None:
            for i, node in enumerate(nodes):
                if node.poll() is not None:
                    raise RuntimeError(
                        f"{label}: node-{i} exited with {node.returncode}:\n{tail(mode_dir / f'node-{i}.log')}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label}: not done within {timeout_s:.0f}s (--timeout-s)")
            time.sleep(0.2)
        if trainer.returncode != 0:
            raise RuntimeError(
                f"{label}: the trainer exited with {trainer.returncode}:\n{tail(mode_dir / 'trainer.log')}"
            )
        with BrokerClient(address, timeout_s=10) as client:
            stats = client.stats()
    finally:
        for p in procs:
            stop(p)
        stop(broker)
    steps = json.loads(trainer_out.read_text())["steps"]
    return summarize(label, eta, cfg, steps, stats)


def summarize(label: str, eta: int, cfg: BenchConfig, steps: list[dict], stats: dict) -> dict[str, Any]:
    measured = steps[cfg.warmup :]
    window_s = steps[-1]["end_s"] - steps[cfg.warmup - 1]["end_s"]
    samples = sum(s["samples"] for s in measured)
    staleness = [x for s in steps for x in s["staleness"]]
    response_tokens = sum(s["response_tokens"] for s in steps)
    trained_samples = sum(s["samples"] for s in steps)  # the whole run's, warm-up included
    return {
        "mode": label,
        "eta": eta,
        "samples_per_s": samples / window_s,
        "measured_steps": len(measured),
        "window_s": window_s,
        "median_step_s": statistics.median(
            b["end_s"] - a["end_s"] for a, b in itertools.pairwise(steps[cfg.warmup - 1 :])
        ),
        "trainer_busy": sum(s["train_s"] for s in measured) / window_s,
        "trainer_wait_s_mean": statistics.mean(s["wait_s"] for s in measured),
        "staleness": {
            "mean": statistics.mean(staleness),
            "max": max(staleness),
            "histogram": dict(sorted(Counter(staleness).items())),
        },
        "broker_staleness_histogram": stats.get("staleness_histogram", {}),
        "dropped_stale_groups": stats.get("counters", {}).get("dropped_stale_groups"),
        "mean_response_tokens": response_tokens / trained_samples,
        # every request the broker handled (nodes' and trainer's), per group trained in the whole run
        "broker_requests_per_group": stats.get("requests", 0) * cfg.group_size / trained_samples,
        "steps": steps,
    }


# --- the whole comparison --------------------------------------------------------------------------


def parse_args(argv: list[str]) -> tuple[BenchConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--etas", default="1,2,4", help="async max_staleness values (sync, eta=0, always runs)")
    p.add_argument("--steps", type=int, default=40, help="train steps per mode")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the throughput")
    p.add_argument("--median-tokens", type=float, default=128.0, help="lognormal median output length")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of ln(length)")
    p.add_argument("--max-tokens", type=int, default=2048, help="output length cap (max_new_tokens)")
    p.add_argument("--lengths-file", default=None, help="resample these measured lengths instead")
    p.add_argument("--per-token-ms", type=float, default=1.0)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight per node's engine")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--batch-groups", type=int, default=16)
    p.add_argument("--train-overhead-ms", type=float, default=50.0)
    p.add_argument("--balance", type=float, default=1.0, help="trainer capacity / rollout capacity")
    p.add_argument("--weight-sync-ms", type=float, default=0.0)
    p.add_argument("--lease-poll-s", type=float, default=0.2)
    p.add_argument("--max-inflight-groups", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=900.0, help="per mode")
    p.add_argument("--work-dir", default=None, help="keep logs and journals here (default: a temp dir)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    a = p.parse_args(argv)
    if a.lengths_file:
        lengths: Any = {"type": "empirical", "path": a.lengths_file}
    else:
        lengths = {
            "type": "lognormal",
            "median": a.median_tokens,
            "sigma": a.sigma,
            "max_tokens": a.max_tokens,
        }
    try:
        etas = [int(e) for e in a.etas.split(",") if e.strip()]
    except ValueError:
        p.error(f"--etas {a.etas!r}: give comma-separated integers >= 1, e.g. 1,2,4")
    if any(e < 1 for e in etas):
        p.error(f"--etas {a.etas!r}: async modes need eta >= 1 (eta = 0 is the sync mode, always run)")
    a.etas = etas
    if a.warmup >= a.steps:
        p.error(f"--warmup {a.warmup} must be below --steps {a.steps} (some steps must be measured)")
    cfg = BenchConfig(
        lengths=lengths,
        per_token_s=a.per_token_ms / 1e3,
        prompt_tokens=a.prompt_tokens,
        nodes=a.nodes,
        concurrency=a.concurrency,
        group_size=a.group_size,
        batch_groups=a.batch_groups,
        steps=a.steps,
        warmup=a.warmup,
        train_overhead_s=a.train_overhead_ms / 1e3,
        balance=a.balance,
        weight_sync_s=a.weight_sync_ms / 1e3,
        lease_poll_s=a.lease_poll_s,
        max_inflight_groups=a.max_inflight_groups,
        seed=a.seed,
    )
    return cfg, a


def table(results: list[dict], cap: dict[str, Any]) -> str:
    ideal, mean_len = cap["ideal_samples_per_s"], cap["mean_output_tokens"]
    inflight = cap["inflight_bound_samples_per_s"]
    sync = results[0]["samples_per_s"]
    head = (
        f"{'mode':<14}{'samples/s':>10}{'x sync':>8}{'/ ideal':>9}{'step s':>8}{'trainer busy':>14}"
        f"{'staleness mean/max':>20}{'dropped':>9}{'mean len':>10}{'requests/group':>16}"
    )
    rows = [head, "-" * len(head)]
    for r in results:
        st = r["staleness"]
        rows.append(
            f"{r['mode']:<14}{r['samples_per_s']:>10.1f}{r['samples_per_s'] / sync:>8.2f}"
            f"{r['samples_per_s'] / ideal:>9.2f}{r['median_step_s']:>8.3f}{r['trainer_busy']:>13.0%} "
            f"{st['mean']:>13.2f} / {st['max']:<4d}{r['dropped_stale_groups']!s:>9}"
            f"{r['mean_response_tokens']:>10.1f}{r['broker_requests_per_group']:>16.1f}"
        )
    rows.append(f"{'ideal bound':<14}{ideal:>10.1f}{ideal / sync:>8.2f}{1.0:>9.2f}{'':>51}{mean_len:>10.1f}")
    if inflight is not None:
        rows.append(f"{'in-flight cap':<14}{inflight:>10.1f}{inflight / sync:>8.2f}{inflight / ideal:>9.2f}")
    rows.append(
        "dropped: groups the broker dropped as staler than eta; mean len: response tokens per trained sample "
        "(ideal bound's row: the distribution's mean); in-flight cap: the agent's max_inflight_groups limit; "
        "requests/group: requests the broker handled (nodes' and trainer's) per group trained"
    )
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    cfg, a = parse_args(argv)
    cap = capacities(cfg)
    revision = source_revision()
    print(f"code at {revision}")
    print("ideal bound:\n  " + "\n  ".join(cap["derivation"]), flush=True)
    with tempfile.TemporaryDirectory(prefix="async_vs_sync-") as tmp:
        work = Path(a.work_dir) if a.work_dir else Path(tmp)
        results = []
        for eta in [0, *a.etas]:
            r = run_mode(cfg, eta, work, a.timeout_s)
            print(
                f"{r['mode']}: {r['samples_per_s']:.1f} samples/s over {r['measured_steps']} steps "
                f"({r['window_s']:.1f}s), staleness max {r['staleness']['max']}",
                flush=True,
            )
            results.append(r)
    ideal = cap["ideal_samples_per_s"]
    print()
    print(table(results, cap))
    sync = results[0]["samples_per_s"]
    goal = None
    eta2 = next((r for r in results if r["eta"] == 2), None)
    if eta2 is not None:
        goal = {
            "eta2_over_sync": eta2["samples_per_s"] / sync,
            "eta2_over_ideal": eta2["samples_per_s"] / ideal,
            "met": eta2["samples_per_s"] >= 2.5 * sync and eta2["samples_per_s"] >= 0.9 * ideal,
        }
        print(
            f"\ngoal (eta=2 >= 2.5x sync and within 10% of the ideal bound): "
            f"{goal['eta2_over_sync']:.2f}x sync, {goal['eta2_over_ideal']:.0%} of ideal -> "
            f"{'met' if goal['met'] else 'NOT met'}"
        )
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "revision": revision,
            "config": cfg.model_dump(),
            "capacities": cap,
            "results": results,
            "goal": goal,
        }
        out.write_text(json.dumps(payload, indent=1))
        print(f"wrote {out}")
    return 0


def source_revision() -> str:
    """The commit the measured code came from, ``-dirty`` when the system's folders had local changes."""
    root = SCRIPT.parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            [
                "git",
                "status",
                "--porcelain",
                "--",
                "broker",
                "rollout",
                "tidal",
                "benchmarks/async_vs_sync.py",
                "benchmarks/standins.py",
            ],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if changed else "")


def _load_config(path: str) -> BenchConfig:
    return BenchConfig.model_validate_json(Path(path).read_text())


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    role, rest = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    if role == "_node":
        import uvloop

        config_path, broker_addr, node_name, control_addr, node_seed = rest
        sys.exit(
            uvloop.run(
                run_node(_load_config(config_path), broker_addr, node_name, control_addr, int(node_seed))
            )
        )
    elif role == "_trainer":
        config_path, broker_addr, out_path, *control_addrs = rest
        sys.exit(run_trainer(_load_config(config_path), broker_addr, control_addrs, Path(out_path)))
    else:
        # SIGTERM unwinds main, so that the broker, nodes and trainer it started are stopped
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        sys.exit(main(sys.argv[1:]))
