"""The async-vs-sync benchmark's stand-ins: length distributions, the timed engine, the task, the train step."""

import asyncio
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tidal.broker.types import Batch, Group, PromptRow, Sample
from tidal.rollout.engine import EngineClient, EngineError, token_versions
from tidal.rollout.generation import Segment

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from standins import (  # noqa: E402
    EmpiricalLengths,
    LogNormalLengths,
    StandinEngine,
    StandinTask,
    TrainStepCost,
    batch_tokens,
    version_spans,
)


def fixed_lengths(tmp_path: Path, n: int) -> EmpiricalLengths:
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps([n]))
    return EmpiricalLengths(path=str(path))


def test_lognormal_mean_is_exact_for_the_sampler():
    dist = LogNormalLengths(median=40, sigma=1.0, max_tokens=300)
    draws = dist.draw(np.random.default_rng(0), 400_000)
    assert draws.min() >= 1 and draws.max() == 300
    standard_error = draws.std() / math.sqrt(draws.size)
    assert abs(draws.mean() - dist.mean()) < 5 * standard_error


def test_expected_longest_of_k_draws_is_exact():
    dist = LogNormalLengths(median=40, sigma=1.0, max_tokens=300)
    longest = dist.draw(np.random.default_rng(2), (100_000, 4)).max(axis=1)
    assert abs(longest.mean() - dist.mean_max(4)) < 5 * longest.std() / math.sqrt(longest.size)
    assert dist.mean_max(1) == dist.mean()


def test_empirical_expected_longest(tmp_path):
    path = tmp_path / "lengths.json"
    path.write_text("[1, 3]")
    dist = EmpiricalLengths(path=str(path))
    assert dist.mean_max(1) == pytest.approx(2.0)
    assert dist.mean_max(2) == pytest.approx(1 * 0.25 + 3 * 0.75)


def test_lognormal_default_has_a_long_tail():
    dist = LogNormalLengths()
    draws = dist.draw(np.random.default_rng(1), 200_000)
    median = np.median(draws)
    assert median == pytest.approx(dist.median, abs=1)
    assert np.quantile(draws, 0.99) > 9 * median  # e^(2.33 sigma) = 10.3x the median
    assert (draws == dist.max_tokens).mean() > 0  # the cap truncates some


def test_empirical_lengths_resample_and_cap(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("5\n10\n1000\n")
    dist = EmpiricalLengths(path=str(path), max_tokens=100)
    assert set(dist.draw(np.random.default_rng(0), 300).tolist()) == {5, 10, 100}
    assert dist.mean() == pytest.approx(115 / 3)
    assert EmpiricalLengths(path=str(path)).max_tokens == 1000


def test_empirical_lengths_reject_bad_files(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("12\nmany\n")
    with pytest.raises(ValueError, match="one integer per line"):
        EmpiricalLengths(path=str(bad))
    bad.write_text("[0, 3]")
    with pytest.raises(ValueError, match=">= 1"):
        EmpiricalLengths(path=str(bad))


def test_version_spans_follow_changes_by_token_time():
    changes = [(-math.inf, "0"), (10.0, "1"), (10.0, "2"), (10.35, "3"), (50.0, "4")]
    # tokens at 10.1, 10.2, ..., 11.0
    spans = version_spans(changes, start=10.0, step=0.1, n=10)
    assert spans == [{"version": "2", "start": 0, "end": 3}, {"version": "3", "start": 3, "end": 10}]
    assert token_versions({"weight_versions": spans}, 10) == ["2"] * 3 + ["3"] * 7
    # a change exactly at a token's time applies to that token
    assert version_spans([(-math.inf, "0"), (1.2, "1")], start=1.0, step=0.1, n=4) == [
        {"version": "0", "start": 0, "end": 1},
        {"version": "1", "start": 1, "end": 4},
    ]
    assert version_spans(changes, start=0.0, step=1.0, n=0) == []


def test_engine_is_an_engine_client_and_sleeps_per_token(tmp_path):
    async def main():
        engine = StandinEngine("standin://t/0", fixed_lengths(tmp_path, 30), per_token_s=0.002, seed=0)
        assert isinstance(engine, EngineClient)
        t0 = time.monotonic()
        res = await engine.generate([5, 6, 7], {"max_new_tokens": 100, "stop_token_ids": [2]})
        took = time.monotonic() - t0
        return res, took

    res, took = asyncio.run(main())
    assert took >= 30 * 0.002
    assert len(res.output_ids) == len(res.output_logprobs) == len(res.token_versions) == 30
    assert res.finish_type == "stop" and res.output_ids[-1] == 2
    assert res.prompt_tokens == 3 and res.weight_version == "0"
    segment = Segment.from_result(res)  # what the agent's generation loop reads
    assert segment.finish_reason == "stop" and segment.versions.tolist() == [0] * 30


def test_engine_truncates_at_max_new_tokens(tmp_path):
    engine = StandinEngine("standin://t/0", fixed_lengths(tmp_path, 50), per_token_s=0.001, seed=0)
    res = asyncio.run(engine.generate([1], {"max_new_tokens": 7}))
    assert len(res.output_ids) == 7 and res.finish_type == "length"


def test_engine_stamps_tokens_with_the_version_current_when_produced(tmp_path):
    async def main():
        engine = StandinEngine("standin://t/0", fixed_lengths(tmp_path, 40), per_token_s=0.005, seed=0)
        request = asyncio.create_task(engine.generate([1], {"max_new_tokens": 40}))
        await asyncio.sleep(0.1)
        await engine.update_weight_version("7")
        return await request

    res = asyncio.run(main())
    versions = res.token_versions
    cut = versions.index("7")
    assert 0 < cut < 40
    assert versions == ["0"] * cut + ["7"] * (40 - cut)
    assert res.weight_version == "7"


def test_engine_abort_and_pause(tmp_path):
    async def main():
        engine = StandinEngine("standin://t/0", fixed_lengths(tmp_path, 1000), per_token_s=0.001, seed=0)
        request = asyncio.create_task(engine.generate([1], {"max_new_tokens": 1000}))
        await asyncio.sleep(0.05)
        await engine.pause("abort")
        aborted = await request
        later = asyncio.create_task(engine.generate([1], {"max_new_tokens": 3}))
        await asyncio.sleep(0.05)
        held = not later.done()
        await engine.resume()
        return aborted, held, await later

    aborted, held, later = asyncio.run(main())
    assert aborted.finish_type == "abort" and 0 < len(aborted.output_ids) < 1000
    assert held  # paused: new requests wait for resume
    assert later.finish_type == "length" and len(later.output_ids) == 3


def test_engine_refuses_weight_routes_and_bad_pause(tmp_path):
    engine = StandinEngine("standin://t/0", fixed_lengths(tmp_path, 3), per_token_s=0.001, seed=0)
    with pytest.raises(EngineError, match="holds no weights"):
        asyncio.run(engine.update_weights_from_distributed(names=[], dtypes=[], shapes=[], group_name="g"))
    with pytest.raises(EngineError, match="mode must be"):
        asyncio.run(engine.pause("freeze"))
    with pytest.raises(ValueError, match="per_token_s"):
        StandinEngine("standin://t/0", fixed_lengths(tmp_path, 3), per_token_s=0, seed=0)


def test_task_prompts_and_reward():
    task = StandinTask(prompt_tokens=6)
    row = PromptRow(index=3, data_source="bench", prompt="x")
    assert len(task.prompt_ids(row)) == 6
    assert asyncio.run(task.score(row, [1, 2, 3])).reward == 1.0
    assert asyncio.run(task.score(row, [1, 2])).reward == 0.0


def make_batch(prompt_len: int, response_lens: list[int]) -> Batch:
    samples = [
        Sample(
            prompt_ids=np.zeros(prompt_len, np.int32),
            response_ids=np.zeros(n, np.int32),
            logprobs=np.zeros(n, np.float32),
            versions=np.zeros(n, np.int32),
            reward=0.0,
            finish_reason="stop",
        )
        for n in response_lens
    ]
    return Batch(0, [Group("0:0", samples)], 0)


def test_train_step_takes_overhead_plus_per_token_time():
    batch = make_batch(4, [10, 30])
    assert batch_tokens(batch) == 48
    cost = TrainStepCost(overhead_s=0.01, per_token_s=0.001)
    assert cost.seconds(48) == pytest.approx(0.058)
    t0 = time.monotonic()
    assert cost.run(batch) == pytest.approx(0.058)
    assert time.monotonic() - t0 >= 0.058
