"""A real broker on loopback turns away rollout nodes serving another model than the trainer's."""

import signal

import pytest

from tidal.broker.client import BrokerClient, BrokerError
from tidal.broker.testing import start_broker
from tidal.procs import free_port, kill_tree, stop

pytestmark = pytest.mark.slow

TRAINED = {"fingerprint": "aaaa", "summary": "qwen3 (vocab 512, hidden 128, 2 layers)"}
OTHER = {"fingerprint": "bbbb", "summary": "qwen3 (vocab 512, hidden 64, 2 layers)"}


def test_nodes_of_another_model_are_refused_or_let_go_and_their_prompts_go_to_the_others(tmp_path):
    port, settings = free_port(), dict(group_size=2, batch_groups=2, max_staleness=4)
    proc, address = start_broker(tmp_path, 8, port=port, **settings)
    names = ("early", "same", "trainer", "late", "retrained", "after_restart", "other_after_restart")
    clients = {name: BrokerClient(address, timeout_s=10) for name in names}
    try:
        # nodes that name their model lease nothing until a trainer says which model it trains
        clients["early"].register("rollout", "early", {"model": OTHER})
        clients["same"].register("rollout", "same", {"model": TRAINED})
        assert clients["early"].lease(2) is None and clients["same"].lease(2) is None
        # the trainer's registration lets the other model's node go; its next call registers again by itself
        # and is refused, naming both models
        clients["trainer"].register("trainer", "t", {"model": TRAINED})
        stats = clients["trainer"].stats()
        assert sorted(n["name"] for n in stats["nodes"].values()) == ["same", "t"]
        assert stats["trainer_model"] == TRAINED
        with pytest.raises(BrokerError) as refused:
            clients["early"].lease(1)
        assert refused.value.code == "model_mismatch"
        assert "'early' serves qwen3 (vocab 512, hidden 64, 2 layers) (fingerprint bbbb)" in str(
            refused.value
        )
        assert "the trainer trains qwen3 (vocab 512, hidden 128, 2 layers) (fingerprint aaaa)" in str(
            refused.value
        )
        with pytest.raises(BrokerError, match="model_mismatch"):
            clients["late"].register("rollout", "late", {"model": OTHER})
        held = sorted(g.group_id for g in clients["same"].lease(2).groups)
        # a trainer started again on another model lets go of the nodes of the old one, leases and all
        clients["retrained"].register("trainer", "t2", {"model": OTHER})
        stats = clients["trainer"].stats()
        assert (stats["in_flight_groups"], stats["requeued"], stats["counters"]["refused_nodes"]) == (0, 2, 4)
        # the model is journaled: a broker restarted on the journal checks nodes before any trainer returns
        kill_tree(proc, signal.SIGKILL)
        proc.wait(10)
        proc, _ = start_broker(tmp_path, 8, port=port, **settings)
        with pytest.raises(BrokerError, match="model_mismatch"):
            clients["after_restart"].register("rollout", "after", {"model": TRAINED})
        clients["other_after_restart"].register("rollout", "other", {"model": OTHER})
        assert sorted(g.group_id for g in clients["other_after_restart"].lease(2).groups) == held
    finally:
        for client in clients.values():
            client.close()
        stop(proc)


def test_a_malformed_model_in_a_registration_gets_an_error_naming_it(tmp_path):
    proc, address = start_broker(tmp_path, 4, group_size=2, batch_groups=2)
    client = BrokerClient(address, timeout_s=10)
    try:
        with pytest.raises(BrokerError) as bad:
            client.register("rollout", "n", {"model": "qwen3"})
        assert bad.value.code == "bad_request"
        assert "meta.model must be a map of strings fingerprint and summary, got 'qwen3'" in str(bad.value)
        client.register("rollout", "n", {"model": TRAINED})  # and the broker goes on serving
    finally:
        client.close()
        stop(proc)
