"""A rollout node's cost: tokens/s through the node (broker lease -> agent -> engine -> reward -> submit
-> batch) against the same requests sent straight to the engine with the engine client, in one run.

One embedded engine (``tidal serve``, started by the node's engine pool) serves both paths; a real broker
process serves the node; a consumer pulls the batches. The direct path sends every sample of every prompt
with the same sampling parameters and concurrency limit; the ratio node/direct is what the node's
machinery costs (1.0: nothing). Paths alternate per repeat; medians are reported. Prints a table, writes
JSON with ``--out``.

    .venv/bin/python benchmarks/rollout_agent.py --out runs/bench/rollout_agent.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
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


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight on the engine")
    p.add_argument("--repeats", type=int, default=3)
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
    results: dict[str, list[tuple[float, int]]] = {"direct": [], "node": []}
    try:
        await direct(pool, task, prompt_ids[:4], a, base)  # warm-up
        for r in range(a.repeats):
            results["direct"].append(await direct(pool, task, prompt_ids, a, base))
            results["node"].append(await through_node(pool, task, config, rows, a, tmp / f"broker{r}"))
    finally:
        await pool.close()
        task.close()
    rates = {k: statistics.median(tok / sec for sec, tok in v) for k, v in results.items()}
    return {
        "config": vars(a),
        "runs": {k: [{"seconds": sec, "tokens": tok} for sec, tok in v] for k, v in results.items()},
        "median_tokens_per_s": rates,
        "node_over_direct": rates["node"] / rates["direct"],
    }


def main() -> None:
    a = parse_args()
    out = asyncio.run(main_async(a))
    print(f"{'path':<8} {'median tokens/s':>16} {'runs (s)':>28}")
    for k in ("direct", "node"):
        secs = ", ".join(f"{r['seconds']:.2f}" for r in out["runs"][k])
        print(f"{k:<8} {out['median_tokens_per_s'][k]:>16.1f} {secs:>28}")
    print(f"node / direct: {out['node_over_direct']:.3f}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
