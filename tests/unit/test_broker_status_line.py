"""The broker's periodic status line, from two stats snapshots of a real BrokerState."""

import pytest

from tidal.broker.codec import encode_group
from tidal.broker.config import BrokerConfig
from tidal.broker.protocol import ANOTHER_TRAINER, MODEL_MISMATCH, ProtocolError
from tidal.broker.source import PromptSource, load_rows
from tidal.broker.state import BrokerState
from tidal.broker.status_line import status_line
from tidal.broker.testing import fake_group, write_rows

T0 = 1_000_000.0


def test_status_line_names_nodes_queue_batches_counts_and_the_rate_since_the_last_line(tmp_path):
    config = BrokerConfig(group_size=2, batch_groups=2, max_staleness=1)
    state = BrokerState(
        config,
        PromptSource(load_rows(write_rows(tmp_path / "d.jsonl", 10)), seed=0, shuffle=True, epochs=1),
        None,
    )
    before = state.stats(T0)
    node = state.register(b"a", "rollout", "a", {}, T0)
    state.register(b"b", "rollout", "b", {}, T0)
    state.register(b"t", "trainer", "t", {}, T0)
    lease = state.lease(node, 3, T0)
    state.submit(node, lease.lease_id, [encode_group(fake_group(pg)) for pg in lease.groups[:2]], T0)
    state.get_batch(-1, 2)
    after = state.stats(T0 + 2)
    line = status_line(after, before, 2.0)
    assert line.startswith("status: nodes alive 2 rollout, 1 trainer; policy version 0; ")
    assert "queue 7 groups, in flight 1, buffered 0;" in line
    # 2 groups of 2 samples in 2 s
    assert "accepted 2 groups (2 samples/s," in line and "batches cut 1, consumed through -1;" in line
    assert "dropped stale 0, filtered 0," in line and "epoch 0 at row 3 of 10" in line
    assert "refused nodes" not in line  # named only once there are some


def test_status_line_counts_nodes_refused_for_serving_another_model(tmp_path):
    state = BrokerState(
        BrokerConfig(group_size=2, batch_groups=2),
        PromptSource(load_rows(write_rows(tmp_path / "d.jsonl", 4)), seed=0, shuffle=False, epochs=1),
        None,
    )
    state.register(b"t", "trainer", "t", {"model": {"fingerprint": "a", "summary": "A"}}, T0)
    with pytest.raises(ProtocolError) as refused:
        state.register(b"n", "rollout", "n", {"model": {"fingerprint": "b", "summary": "B"}}, T0)
    assert refused.value.code == MODEL_MISMATCH
    line = status_line(state.stats(T0), None)
    assert "failed 0, refused nodes 1 (another model), expired leases 0," in line


def test_status_line_counts_trainers_refused_while_another_was_alive(tmp_path):
    state = BrokerState(
        BrokerConfig(group_size=2, batch_groups=2, node_timeout_s=30.0),
        PromptSource(load_rows(write_rows(tmp_path / "d.jsonl", 4)), seed=0, shuffle=False, epochs=1),
        None,
    )
    state.register(b"t", "trainer", "t", {}, T0)
    assert "refused trainers" not in status_line(state.stats(T0), None)
    with pytest.raises(ProtocolError) as refused:
        state.register(b"u", "trainer", "u", {}, T0 + 29.0)
    assert refused.value.code == ANOTHER_TRAINER
    assert "failed 0, refused trainers 1 (another alive), expired leases 0," in status_line(
        state.stats(T0), None
    )
    state.register(b"u", "trainer", "u", {}, T0 + 31.0)  # the first is forgotten 30 s after it was seen
    assert [n.name for n in state.nodes.values()] == ["u"]


def test_status_line_counts_trainers_that_took_a_gone_predecessors_place(tmp_path):
    state = BrokerState(
        BrokerConfig(group_size=2, batch_groups=2, node_timeout_s=30.0),
        PromptSource(load_rows(write_rows(tmp_path / "d.jsonl", 4)), seed=0, shuffle=False, epochs=1),
        None,
    )
    here = {"host": "vm", "pid_ns": "pid:[7]", "pid": 10, "start": 5}
    dead = state.register(b"t", "trainer", "t", {"process": here}, T0)
    assert "trainer takeovers" not in status_line(state.stats(T0), None)
    state.register(b"u", "trainer", "u", {"process": {**here, "pid": 11}}, T0 + 1.0, replaces=dead.node_id)
    assert [n.name for n in state.nodes.values()] == ["u"]
    assert "trainer takeovers 1 (predecessor's process gone), expired leases 0," in status_line(
        state.stats(T0), None
    )
