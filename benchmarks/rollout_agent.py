"""A rollout node's cost: tokens/s through the node (broker lease -> agent -> engine -> reward -> submit
-> batch) against the same requests sent straight to the engine with the engine client, in one run.

One embedded engine (``tidal serve``, started by the node's engine pool) serves every path; a real broker
process serves the node; a consumer pulls the batches. The direct path sends every sample of every prompt
as its own request with the same sampling parameters and concurrency limit; direct_n sends each prompt's
samples as one request with ``sampling_params.n`` (what the node does for short samples); the ratio
node/direct_n is what the node's machinery costs (1.0: nothing). Paths alternate per repeat; medians are reported, with the CPU time each
sample cost the benchmark's process (the agent, or the direct client, plus the consumer) and the engine's
process (HTTP server and scheduler threads). Prints a table, writes JSON with ``--out``.

    .venv/bin/python benchmarks/rollout_agent.py --out runs/bench/rollout_agent.json
    .venv/bin/python benchmarks/rollout_agent.py --max-new-tokens 6 --prompts 128 --set rollout.concurrency=128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tidal.broker.client import AsyncBrokerClient
from tidal.broker.testing import start_broker
from tidal.broker.types import PromptRow
from tidal.config import RunConfig
from tidal.configio import load_config
from tidal.procs import stop
from tidal.rollout.agent import RolloutAgent
from tidal.rollout.generation import PartialResponse, sampling_params
from tidal.rollout.main import build_pool
from tidal.rollout.tasks import build_task
from tidal.rollout.tasks.arithmetic import make_records
from tidal.rollout.tasks.char_tokenizer import save_char_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proc_stats import cpu_seconds  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight on the engine")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--set", action="append", default=[], help="config override KEY=VALUE (repeatable)")
    p.add_argument("--out", default=None)
    return p.parse_args()


async def direct(pool, task, prompt_ids: list[list[int]], a, base: dict) -> tuple[float, int]:
    client = pool.slots[0].client
    gate = asyncio.Semaphore(a.concurrency)

    async def one(ids: list[int]) -> int:
        async with gate:
            params = sampling_params(base, PartialResponse(ids, a.max_new_tokens), task.stop_token_ids)
            return len((await client.generate(ids, params)).output_ids)

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(ids) for ids in prompt_ids for _ in range(a.group_size)))
    return time.perf_counter() - t0, sum(counts)


async def direct_groups(pool, task, prompt_ids: list[list[int]], a, base: dict) -> tuple[float, int]:
    """Each prompt's samples as one request with sampling_params.n (what the node sends for short samples)."""
    client = pool.slots[0].client
    gate = asyncio.Semaphore(max(1, a.concurrency // a.group_size))

    async def one(ids: list[int]) -> int:
        async with gate:
            params = sampling_params(base, PartialResponse(ids, a.max_new_tokens), task.stop_token_ids)
            return sum(len(r.output_ids) for r in await client.generate_n(ids, params, a.group_size))

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(ids) for ids in prompt_ids))
    return time.perf_counter() - t0, sum(counts)


async def through_node(pool, task, config, rows, a, workdir: Path) -> tuple[float, int]:
    broker, address = start_broker(
        workdir,
        rows=rows,
        group_size=a.group_size,
        batch_groups=4,
        max_staleness=1_000_000,
        data={"epochs": 1, "shuffle": False},
    )
    consumer = AsyncBrokerClient(address, timeout_s=30.0)
    agent = RolloutAgent(config.rollout, AsyncBrokerClient(address), pool, task, name="bench")
    try:
        t0 = time.perf_counter()
        run = asyncio.create_task(agent.run())
        after, groups, tokens = -1, 0, 0
        while groups < len(rows):
            batch = await consumer.get_batch(after, timeout_s=1.0)
            if batch is None:
                continue
            after = batch.batch_id
            groups += len(batch.groups)
            tokens += sum(s.response_ids.size for g in batch.groups for s in g.samples)
        elapsed = time.perf_counter() - t0
        agent.request_stop()
        await run
        await agent.client.close()
        return elapsed, tokens
    finally:
        await consumer.close()
        stop(broker)


async def main_async(a) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="tidal-bench-rollout-"))
    config = load_config(
        RunConfig,
        a.config,
        [
            f"run_dir={tmp}",
            f"rollout.sampling.max_new_tokens={a.max_new_tokens}",
            f"rollout.concurrency={a.concurrency}",
            "rollout.engine.max_seq_len=64",
            "model.max_position_embeddings=64",
            "rollout.agent.lease_poll_s=0.02",
            *a.set,
        ],
    )
    save_char_tokenizer(tmp / "tokenizer")
    task = build_task(config)
    rows, _ = make_records(digits=2, num_train=a.prompts, num_eval=1, seed=0)
    prompt_ids = [task.prompt_ids(PromptRow(i, r["data_source"], r["prompt"])) for i, r in enumerate(rows)]
    s = config.rollout.sampling
    base = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}
    (tmp / "node").mkdir()
    pool = build_pool(config, [], tmp / "node")
    await pool.start()
    results: dict[str, list[dict]] = {"direct": [], "direct_n": [], "node": []}
    engine_pid = pool.slots[0].process.pid
    samples = a.prompts * a.group_size

    async def measured(path: str, run) -> None:
        own, engine = time.process_time(), cpu_seconds(engine_pid)
        seconds, tokens = await run
        results[path].append(
            {
                "seconds": seconds,
                "tokens": tokens,
                "own_cpu_ms_per_sample": 1e3 * (time.process_time() - own) / samples,
                "engine_cpu_ms_per_sample": 1e3 * (cpu_seconds(engine_pid) - engine) / samples,
            }
        )

    try:
        await direct(pool, task, prompt_ids[:4], a, base)  # warm-up
        for r in range(a.repeats):
            await measured("direct", direct(pool, task, prompt_ids, a, base))
            await measured("direct_n", direct_groups(pool, task, prompt_ids, a, base))
            await measured("node", through_node(pool, task, config, rows, a, tmp / f"broker{r}"))
    finally:
        await pool.close()
        task.close()

    def median(path: str, key: str) -> float:
        return statistics.median(r[key] for r in results[path])

    rates = {k: statistics.median(r["tokens"] / r["seconds"] for r in v) for k, v in results.items()}
    return {
        "config": vars(a),
        "runs": results,
        "median_tokens_per_s": rates,
        "median_samples_per_s": {k: rates[k] * samples / median(k, "tokens") for k in results},
        "median_own_cpu_ms_per_sample": {k: median(k, "own_cpu_ms_per_sample") for k in results},
        "median_engine_cpu_ms_per_sample": {k: median(k, "engine_cpu_ms_per_sample") for k in results},
        "node_over_direct": rates["node"] / rates["direct"],
        "node_over_direct_n": rates["node"] / rates["direct_n"],
    }


def main() -> None:
    a = parse_args()
    out = asyncio.run(main_async(a))
    print(
        f"{'path':<8} {'median tokens/s':>16} {'samples/s':>10} {'own CPU ms/sample':>18} "
        f"{'engine CPU ms/sample':>21} {'runs (s)':>24}"
    )
    for k in ("direct", "direct_n", "node"):
        secs = ", ".join(f"{r['seconds']:.2f}" for r in out["runs"][k])
        print(
            f"{k:<8} {out['median_tokens_per_s'][k]:>16.1f} {out['median_samples_per_s'][k]:>10.1f} "
            f"{out['median_own_cpu_ms_per_sample'][k]:>18.3f} {out['median_engine_cpu_ms_per_sample'][k]:>21.3f} "
            f"{secs:>24}"
        )
    print(f"node / direct: {out['node_over_direct']:.3f}; node / direct_n: {out['node_over_direct_n']:.3f}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
