"""The live view shows every figure it has a row for, from the keys the trainer and the broker really write:
the trainer's metrics line (tests/integration/test_run_default_job.py checks a real run's) and the stats of
a real broker state. Before, it read keys nobody wrote and showed '-' in four of its eight rows."""

from rich.console import Console

from tidal.broker.codec import encode_group
from tidal.broker.config import BrokerConfig
from tidal.broker.source import PromptSource, load_rows
from tidal.broker.state import BrokerState
from tidal.broker.state_stats import state_stats
from tidal.broker.testing import fake_group, write_rows
from tidal.live_view import LiveView

T0 = 1_000_000.0


def _stats(tmp_path) -> dict:
    """A broker state that filtered three groups (equal rewards), holds two in flight and three queued."""
    write_rows(tmp_path / "data.jsonl", 8)
    config = BrokerConfig(group_size=2, batch_groups=2, max_staleness=3, dynamic_sampling=True)
    state = BrokerState(
        config, PromptSource(load_rows(tmp_path / "data.jsonl"), seed=0, shuffle=False, epochs=1), None
    )
    node = state.register(b"a", "rollout", "a", {}, T0)
    lease = state.lease(node, 3, T0)
    groups = [encode_group(fake_group(pg, rewards=[1.0, 1.0])) for pg in lease.groups]
    state.submit(node, lease.lease_id, groups, T0)
    state.lease(node, 2, T0)
    return state_stats(state, T0)


def test_the_broker_row_names_the_queue_the_groups_in_flight_and_the_drops(tmp_path):
    view = LiveView(10, "tidal tiny", interactive=False)
    view.update([], _stats(tmp_path), {})
    rows = dict(view.rows())
    assert rows["broker"] == (
        "1 rollout node(s); queued 3, in flight 2, buffered 0 groups; dropped stale 0, filtered 3, failed 0"
    )


def test_the_view_renders_a_metrics_line_with_no_empty_rows(tmp_path):
    view = LiveView(10, "tidal tiny", interactive=False)
    metrics = {
        "step": 3,
        "reward/mean": 0.5,
        "reward/solved": 0.25,
        "offpolicy/staleness_mean": 1.5,
        "offpolicy/staleness_max": 2,
        "throughput/samples_per_s": 410.0,
        "throughput/tokens_per_s": 9000.0,
        "time/weight_sync_s": 0.02,
        "loss/total": -0.01,
    }
    view.update([metrics], _stats(tmp_path), {"trainer": "up 3s"})
    assert [label for label, value in view.rows() if "-" in value.split()] == []
    console = Console(record=True, width=140)
    console.print(view.render())
    text = console.export_text()
    assert "0.250" in text and "1.50 / 2" in text and "filtered 3" in text and "up 3s" in text
