"""When a node leases under `staleness_policy: drop`: only while its engines serve weights the broker would
not drop. The engine pool is a stand-in here (the agent's decision is all that is tested; the path with a
real broker and engine is tests/integration/test_rollout_nodes.py)."""

import asyncio

from tidal.cli import load_run_config
from tidal.rollout.agent import RolloutAgent


class Pool:
    all_failed = False
    draining = False
    urls = ["http://127.0.0.1:1"]

    def __init__(self) -> None:
        self.comebacks = 0
        self.versions = ["default"]
        self.asked = 0

    async def weight_versions(self):
        self.asked += 1
        return self.versions


def test_an_engine_back_after_a_failure_is_asked_again_for_its_weights():
    config = load_run_config(None, [])
    pool = Pool()
    agent = RolloutAgent(config.rollout, client=None, pool=pool, task=None, name="n")
    agent._stale_limit, agent.policy_version = 1, 5
    assert asyncio.run(agent._weights_fresh()) is False  # version 0 ("default"): 5 behind
    pool.versions = ["5"]
    assert asyncio.run(agent._weights_fresh()) is True
    asked = pool.asked
    agent.policy_version = 6
    assert asyncio.run(agent._weights_fresh()) is True and pool.asked == asked  # within the bound: not asked
    pool.comebacks, pool.versions = 1, ["default"]  # its engine crashed and was restarted
    assert asyncio.run(agent._weights_fresh()) is False
    assert pool.asked == asked + 1 and agent.engine_version == 0


def test_a_waiting_node_says_so_once_then_every_while_then_when_it_leases_again(monkeypatch, caplog):
    monkeypatch.setattr("tidal.rollout.agent.WEIGHT_WAIT_LOG_S", 0.0)
    config = load_run_config(None, [])
    pool = Pool()
    agent = RolloutAgent(config.rollout, client=None, pool=pool, task=None, name="n")
    agent._stale_limit, agent.policy_version = 2, 3
    caplog.set_level("INFO", logger="tidal.rollout.agent")
    for _ in range(3):
        assert asyncio.run(agent._weights_fresh()) is False
    pool.versions = ["3"]
    assert asyncio.run(agent._weights_fresh()) is True
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("engines serve weights of version 0, the trainer is at 3 and the broker drops")
    assert [line.split(" after ")[0] for line in lines[1:3]] == [
        "still waiting for the trainer's weights"
    ] * 2
    assert lines[3:] == ["engines now serve weights of version 3; leasing again"]
