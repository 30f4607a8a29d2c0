"""The trainer's broker connection through a broker SIGKILLed and restarted on its journal: version
publishes, consumption reports and engine lookups that get no answer are let go (each is cumulative: the
next one covers it) instead of killing the trainer; the next ones reach the restarted broker."""

import signal

import pytest
import torch.distributed as dist

from tidal.broker.testing import start_broker
from tidal.procs import free_port, kill_tree, stop
from tidal.trainer.main import _BatchFeed

pytestmark = pytest.mark.slow


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_unanswered_reports_are_let_go_and_the_next_reach_the_restarted_broker(
    tmp_path, world_of_one, caplog
):
    port = free_port()
    proc, address = start_broker(tmp_path, 16, port=port)
    feed = _BatchFeed(address, timeout_s=5.0)
    try:
        feed.control.timeout_s = 1.0
        feed.publish_version(1)
        assert feed.control.policy_version() == 1
        kill_tree(proc, signal.SIGKILL)
        proc.wait(10)
        feed.publish_version(2)  # no broker: a warning, not an exception
        feed.report_consumed(-1)
        assert feed.engines() == []
        assert sum("going on" in r.getMessage() for r in caplog.records) == 3
        proc, _ = start_broker(tmp_path, 16, port=port)
        feed.publish_version(3)
        assert feed.control.policy_version() == 3
    finally:
        feed.close()
        stop(proc)
