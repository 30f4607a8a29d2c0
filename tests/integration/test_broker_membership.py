"""A real broker on loopback turns away rollout nodes serving another model than the trainer's, and a
second trainer while the first is alive (unless the first's process is provably gone)."""

import signal
import subprocess
import sys
import threading
import time

import pytest

from tidal.broker.client import BrokerClient, BrokerError
from tidal.broker.process_identity import this_process
from tidal.broker.testing import start_broker
from tidal.procs import free_port, kill_tree, stop
from tidal.trainer.main import _BatchFeed

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
        clients["trainer"].leave()  # one trainer at a time (the next test)
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


def test_a_second_trainer_is_refused_while_the_first_is_alive_and_joins_once_it_left_or_was_forgotten(
    tmp_path,
):
    proc, address = start_broker(tmp_path, 8, group_size=2, batch_groups=2, node_timeout_s=2.0)
    first, second, third, look = (BrokerClient(address, timeout_s=10) for _ in range(4))
    try:
        first.register("trainer", "t1")
        with pytest.raises(BrokerError) as refused:
            second.register("trainer", "t2")
        assert refused.value.code == "another_trainer"
        assert "trainer 't2' cannot join: trainer 't1' (trainer-" in str(refused.value)
        assert "forgotten 2s after it was last seen (broker.node_timeout_s)" in str(refused.value)
        first.register("trainer", "t1")  # the same connection registering again replaces itself
        first.leave()
        second.register("trainer", "t2")  # at once, once the first left
        t2_seen = time.monotonic()  # the broker saw t2 last a little before this

        # a trainer that dies without leaving (SIGKILL) holds its place until it is forgotten: one started
        # after it waits for that, asking again
        waiting = threading.Thread(target=third.register, args=("trainer", "t3", None, 30.0))
        waiting.start()
        waiting.join(timeout=30)
        waited = time.monotonic() - t2_seen
        assert not waiting.is_alive() and third.node_id is not None
        assert 1.5 < waited < 10, waited  # node_timeout_s (2 s) after t2 was last seen, asked every second
        stats = look.stats()
        trainers = [n for n in stats["nodes"].values() if n["role"] == "trainer" and n["alive"]]
        assert [n["name"] for n in trainers] == ["t3"]
        assert stats["counters"]["refused_trainers"] >= 2
    finally:
        for client in (first, second, third, look):
            client.close()
        stop(proc)


def test_the_trainers_feed_heartbeats_through_a_long_step_and_leaves_when_it_closes(tmp_path):
    """The feed's heartbeat thread keeps the trainer alive while a step outlasts node_timeout_s (before,
    it was dead in the stats, and a second trainer could have joined); its close leaves."""
    proc, address = start_broker(tmp_path, 8, group_size=2, batch_groups=2, node_timeout_s=2.0)
    feed = _BatchFeed(address, timeout_s=5.0, name="long-steps")
    other = BrokerClient(address, timeout_s=10)
    try:
        time.sleep(5.0)  # a step without a call to the broker
        trainers = [n for n in other.stats()["nodes"].values() if n["role"] == "trainer"]
        assert [(n["name"], n["alive"]) for n in trainers] == [("long-steps", True)]
        with pytest.raises(BrokerError, match="another_trainer"):
            other.register("trainer", "second")
        feed.close()
        other.register("trainer", "second")
    finally:
        other.close()
        stop(proc)


_TRAINER = """
import sys, time
from tidal.broker.client import BrokerClient
from tidal.broker.process_identity import this_process
c = BrokerClient(sys.argv[1], timeout_s=10)
print(c.register("trainer", "crashes", {"process": this_process()}), flush=True)
time.sleep(600)
"""


def test_a_trainer_restarted_after_a_crash_takes_its_dead_predecessors_place_at_once(tmp_path):
    """The predecessor (a real process, SIGKILLed) ran on this host: its successor finds its process gone
    and joins at once, where it waited node_timeout_s (here 60 s) before. A live one is never replaced,
    and a claim from elsewhere is refused."""
    proc, address = start_broker(tmp_path, 8, group_size=2, batch_groups=2, node_timeout_s=60.0)
    crashed = subprocess.Popen([sys.executable, "-c", _TRAINER, address], stdout=subprocess.PIPE, text=True)
    successor, look = BrokerClient(address, timeout_s=10), BrokerClient(address, timeout_s=10)
    try:
        crashed_id = crashed.stdout.readline().strip()
        with pytest.raises(BrokerError, match="another_trainer"):  # alive: waits, as before
            successor.register("trainer", "successor", {"process": this_process()}, wait_s=2.0)
        forged = {"process": {**this_process(), "host": "elsewhere"}}
        with pytest.raises(BrokerError, match="another_trainer"):  # the broker checks where it runs
            look._call(
                "register", {"role": "trainer", "name": "forged", "meta": forged, "replaces": crashed_id}
            )

        crashed.kill()
        crashed.wait()
        started = time.monotonic()
        successor.register("trainer", "successor", {"process": this_process()}, wait_s=30.0)
        assert time.monotonic() - started < 5.0
        stats = look.stats()
        assert [n["name"] for n in stats["nodes"].values() if n["role"] == "trainer"] == ["successor"]
        assert stats["counters"]["trainer_takeovers"] == 1
        log = (tmp_path / "broker.log").read_text()
        assert f"trainer 'successor' takes the place of {crashed_id} ('crashes')" in log
        assert (
            f"trainer 'forged' says it replaces '{crashed_id}'" in log
            and "does not run where 'crashes' ran" in log
        )
    finally:
        crashed.kill()
        for client in (successor, look):
            client.close()
        stop(proc)
