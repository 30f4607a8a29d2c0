"""Generation through the node's engine pool across weight updates and an engine crash, on a real
embedded engine (``tidal serve`` started by the pool, as a node starts it).

- abort mode: in-flight requests come back aborted with partial output; the agent resumes them from
  prompt + partial output; the tokens before the update keep version 0, the rest get version 1; the same
  for a group sent as one request (sampling_params.n), whose aborted samples continue one by one;
- in_place mode: requests keep running; one segment carries both versions (the engine's spans);
- crash: the engine process is SIGKILLed mid-request; the pool restarts it on the same URL and the
  requests (a group's one request among them) are resent and finish;
- stop (what SIGTERM does): a node whose requests cannot finish (the engine is paused) releases its
  groups to the broker after rollout.agent.drain_timeout_s, aborts its requests on the engine, leaves.
"""

import asyncio
import os
import signal

import numpy as np
import pytest

from tidal.broker.client import AsyncBrokerClient
from tidal.broker.testing import start_broker
from tidal.config import RunConfig
from tidal.configio import load_config
from tidal.procs import stop
from tidal.rollout.agent import RolloutAgent
from tidal.rollout.generation import generate, generate_group
from tidal.rollout.main import build_pool
from tidal.rollout.tasks import build_task
from tidal.rollout.tasks.arithmetic import make_records
from tidal.rollout.tasks.char_tokenizer import save_char_tokenizer

# long enough that the pause lands mid-generation even on a fast machine; the engine also runs PyTorch's
# lean step one step at a time (rollout.engine.cpu_step=torch, decode_burst=1): the native step ran these
# 2-row steps of the tiny model, 8 to a burst, fast enough to finish 400 tokens between the test seeing the
# requests run and its pause arriving (a fresh-clone CI run, session 7)
MAX_NEW_TOKENS = 400
PROMPT = [1, 4, 11, 14, 8, 9, 17]  # "<bos>07+45=" in the arithmetic tokenizer
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}


def _config(tmp_path) -> RunConfig:
    return load_config(
        RunConfig,
        "configs/tiny.yaml",
        [
            f"run_dir={tmp_path}",
            "model.max_position_embeddings=512",
            "rollout.engine.max_seq_len=512",
            "rollout.engine.max_batch_size=8",
            "rollout.engine.cpu_step=torch",
            "rollout.engine.decode_burst=1",
            "rollout.agent.engine_start_timeout_s=120",
            "rollout.agent.request_timeout_s=120",
            "rollout.agent.drain_timeout_s=0.5",
            "rollout.agent.lease_poll_s=0.1",
            "rollout.heartbeat_s=0.5",
        ],
    )


async def _running(client) -> int:
    return (await client.server_info())["internal_states"][0]["running"]


async def _start_requests(pool, limits, n: int, *, group: int = 0):
    """n long requests (no stop token) and ``group`` more sent as one request with sampling_params.n (the
    last job, whose result is the list of its responses) in flight, each with some tokens generated."""
    common = dict(max_new_tokens=MAX_NEW_TOKENS, sampling=SAMPLING, stop_token_ids=[], limits=limits)
    jobs = [asyncio.create_task(generate(pool, PROMPT, **common)) for _ in range(n)]
    if group:
        jobs.append(asyncio.create_task(generate_group(pool, PROMPT, group, **common)))
    n += group
    client = pool.slots[0].client
    steps0 = None
    for _ in range(600):
        info = (await client.server_info())["internal_states"][0]
        if info["running"] == n:
            steps0 = info["steps"] if steps0 is None else steps0
            if info["steps"] >= steps0 + 2:  # decode steps ran: every request has partial output
                return jobs
        await asyncio.sleep(0.02)
    raise AssertionError(f"{n} requests never ran together: {info}")


def _check_lengths(partial):
    n = len(partial.token_ids)
    assert n == MAX_NEW_TOKENS and partial.finish_reason == "length"
    assert len(partial.logprobs) == n and partial.version_array().shape == (n,)
    assert np.all(np.isfinite(partial.logprobs)) and max(partial.logprobs) <= 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_generation_across_updates_an_engine_crash_and_a_stop(tmp_path):
    config = _config(tmp_path)
    node_dir = tmp_path / "node"
    node_dir.mkdir()

    async def scenario():
        pool = build_pool(config, [], node_dir)
        limits = config.rollout.agent
        await pool.start()
        client = pool.slots[0].client
        try:
            # --- abort mode: partial outputs come back and are resumed ---------------------------------
            jobs = await _start_requests(pool, limits, 2)
            await client.pause("abort")
            await client.update_weight_version("1")
            await client.resume()
            results = await asyncio.gather(*jobs)
            for partial in results:
                _check_lengths(partial)
                versions = partial.version_array()
                assert partial.segments >= 2 and partial.resumes >= 1, "finished before the pause landed"
                assert versions[0] == 0 and versions[-1] == 1
                assert np.all(np.diff(versions) >= 0)  # each token keeps the version that produced it

            # --- in_place mode: requests keep going; one segment spans both versions ---------------
            jobs = await _start_requests(pool, limits, 2)
            await client.pause("in_place")
            await client.update_weight_version("2")
            await client.resume()
            results = await asyncio.gather(*jobs)
            for partial in results:
                _check_lengths(partial)
                versions = partial.version_array()
                assert partial.segments == 1 and partial.resumes == 0
                assert versions[0] == 1 and versions[-1] == 2
                assert np.all(np.diff(versions) >= 0)

            # --- a group sent as one request (sampling_params.n): its aborted samples go on one by one
            jobs = await _start_requests(pool, limits, 0, group=2)
            await client.pause("abort")
            await client.update_weight_version("3")
            await client.resume()
            (results,) = await asyncio.gather(*jobs)
            assert len(results) == 2
            for partial in results:
                _check_lengths(partial)
                versions = partial.version_array()
                assert partial.segments >= 2 and partial.resumes >= 1, "finished before the pause landed"
                assert versions[0] == 2 and versions[-1] == 3 and np.all(np.diff(versions) >= 0)

            # --- crash: the engine dies mid-request; the pool restarts it and the requests resend ---
            old_pid = pool.slots[0].process.pid
            jobs = await _start_requests(pool, limits, 2, group=2)
            os.kill(old_pid, signal.SIGKILL)
            *results, group = await asyncio.gather(*jobs)
            results += group  # the group's request is sent again whole
            slot = pool.slots[0]
            assert slot.restarts == 1 and slot.process.pid != old_pid and slot.healthy
            for partial in results:
                _check_lengths(partial)
                assert partial.retries >= 1
            # the restarted engine serves the initial weights again (version 0) until the trainer's
            # sender updates it: its tokens say so
            assert all(partial.version_array()[-1] == 0 for partial in results)

            await _stop_releases_unfinished_groups(pool, config, address)
        finally:
            await pool.close()
        assert pool.slots[0].process.poll() is not None  # close() stopped the engine

    rows, _ = make_records(digits=2, num_train=4, num_eval=1, seed=0)
    broker, address = start_broker(
        tmp_path / "broker", rows=rows, group_size=2, batch_groups=2, max_staleness=0, data={"epochs": 1}
    )
    save_char_tokenizer(tmp_path / "tokenizer")
    try:
        asyncio.run(asyncio.wait_for(scenario(), 240))
    finally:
        stop(broker)


async def _stop_releases_unfinished_groups(pool, config, address):
    engine = pool.slots[0].client
    await engine.pause("in_place")  # requests wait in the engine: the node holds its leases
    broker = AsyncBrokerClient(address, timeout_s=10.0)
    agent = RolloutAgent(config.rollout, broker, pool, build_task(config), name="drainer", group_size_hint=2)
    run = asyncio.create_task(agent.run())
    try:
        for _ in range(600):
            waiting = (await engine.server_info())["internal_states"][0]["waiting"]
            if len(agent.inflight) == 2 and waiting == 4:  # 2 groups of 2 samples queued on the engine
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"the agent never held 2 groups: {agent.inflight}, engine waiting {waiting}")
        agent.request_stop()  # what SIGTERM does
        assert await asyncio.wait_for(run, 30) == 0
        stats = await broker.stats()
        assert stats["counters"]["released_groups"] == 2 and stats["in_flight_groups"] == 0
        assert stats["requeued"] == 2  # the prompts wait for another node
        assert not any(n["role"] == "rollout" for n in stats["nodes"].values())  # it left
        state = (await engine.server_info())["internal_states"][0]
        assert state["waiting"] == 0 and state["running"] == 0  # its requests were aborted on the engine
    finally:
        await engine.resume()
        await broker.close()
