"""Which failures a node lays on the prompt (a `release` with the error, counted by the broker towards
dropping the group) and which it does not: an engine that did not answer, or a node that fails everything
in a row. The broker client is a recording stand-in here (the agent's decision is all that is tested); the
whole path with a real broker and engine is tests/integration/test_rollout_nodes.py."""

import asyncio

from tidal.broker.types import PromptGroup, PromptRow
from tidal.cli import load_run_config
from tidal.rollout.agent import RolloutAgent
from tidal.rollout.engine_pool import EngineUnavailable
from tidal.rollout.generation import SampleFailed


class RecordingClient:
    def __init__(self) -> None:
        self.releases: list[tuple[str, list[str], str | None]] = []

    async def release(self, lease_id, group_ids, error=None):
        self.releases.append((lease_id, group_ids, error))


class Pool:
    all_failed = False


def _agent(failures: list[Exception]) -> tuple[RolloutAgent, RecordingClient]:
    config = load_run_config(None, ["broker.max_group_failures=3"])
    client = RecordingClient()
    agent = RolloutAgent(config.rollout, client, Pool(), task=None, name="n", group_failures_reported=3)

    async def sample_group(pg):
        raise failures.pop(0)

    agent._sample_group = sample_group
    return agent, client


def _group(i: int) -> PromptGroup:
    return PromptGroup(group_id=f"0:{i}", row=PromptRow(index=i, data_source="d", prompt="p"), n=2)


def test_a_prompts_failures_are_reported_until_the_node_fails_too_often_in_a_row():
    too_long = SampleFailed("engine rejected the request: /generate: HTTP 400: the input is too long")
    agent, client = _agent([too_long] * 5)
    for i in range(5):
        asyncio.run(agent._run_group("L", _group(i)))
    errors = [error for _, _, error in client.releases]
    assert errors[:3] == [f"SampleFailed: {too_long}"] * 3
    assert errors[3:] == [None, None]  # beyond the broker's max_group_failures the node is suspect


def test_an_engine_that_did_not_answer_is_not_the_prompts_fault():
    gone = EngineUnavailable("engine http://127.0.0.1:1: connection refused")
    retried_out = SampleFailed("4 engine failures, the last: refused")
    retried_out.__cause__ = gone
    agent, client = _agent([gone, retried_out, ValueError("row 7 has chat messages but no template")])
    for i in range(3):
        asyncio.run(agent._run_group("L", _group(i)))
    assert [error for _, _, error in client.releases] == [
        None,
        None,
        "ValueError: row 7 has chat messages but no template",
    ]
