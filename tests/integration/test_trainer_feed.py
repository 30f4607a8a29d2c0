"""The trainer's broker connection (rank 0's) against a real broker process.

Through a broker SIGKILLed and restarted on its journal: version publishes, consumption reports and engine
lookups that get no answer are let go (each is cumulative: the next one covers it) instead of killing the
trainer; the next ones reach the restarted broker; once a stop is asked for, they wait only briefly. When no batch comes, the feed tells a starved broker
(a failure: the trainer saves and exits non-zero) from one whose data is exhausted (the run ends early).
"""

import os
import signal

import pytest

from tidal.broker.client import BrokerClient
from tidal.broker.testing import fake_group, start_broker
from tidal.procs import free_port, kill_tree, stop
from tidal.trainer.main import STOPPING_BROKER_TIMEOUT_S, _BatchFeed
from tidal.trainer.stop_request import StopRequest

pytestmark = pytest.mark.slow


def _policy_version(feed: _BatchFeed) -> int:
    with feed._control_lock:  # the connection is shared with the feed's heartbeat thread
        return feed.control.policy_version()


def test_unanswered_reports_are_let_go_and_the_next_reach_the_restarted_broker(tmp_path, caplog):
    port = free_port()
    proc, address = start_broker(tmp_path, 16, port=port)
    feed = _BatchFeed(address, timeout_s=5.0, name="trainer-test")
    try:
        feed.control.timeout_s = 1.0
        feed.publish_version(1)
        assert _policy_version(feed) == 1
        kill_tree(proc, signal.SIGKILL)
        proc.wait(10)
        feed.publish_version(2)  # no broker: a warning, not an exception
        feed.report_consumed(-1)
        assert feed.engines() == []
        assert sum("going on" in r.getMessage() for r in caplog.records) == 3
        proc, _ = start_broker(tmp_path, 16, port=port)
        feed.publish_version(3)
        assert _policy_version(feed) == 3

        # a stop asked for (SIGTERM): the calls left get a short timeout, the broker may be gone with the job
        feed.control.timeout_s = 30.0
        feed.stop = StopRequest()
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # recorded by the handler, as in the trainer
            stop(proc)
            feed.report_consumed(0)
            assert feed.stop.requested and feed.control.timeout_s == STOPPING_BROKER_TIMEOUT_S
        finally:
            feed.stop.restore()
    finally:
        feed.close()
        stop(proc)


def test_no_batch_is_a_starved_broker_until_the_data_is_exhausted(tmp_path):
    proc, address = start_broker(tmp_path, 4, group_size=4, batch_groups=2, data={"epochs": 1})
    feed = _BatchFeed(address, timeout_s=1.0, name="trainer-test")
    try:
        assert feed.get(-1) is None  # nobody generates: batch_timeout_s passes
        reason, detail = feed.why_no_batch()
        assert reason == "timeout"
        assert detail == "broker: 0 rollout node(s) alive, 4 groups queued, 0 in flight, 0 buffered"
        with BrokerClient(address, timeout_s=10) as node:
            node.register("rollout", "scripted-node")
            lease = node.lease(4)
            reason, detail = feed.why_no_batch()
            assert (reason, detail.split(", ")[2]) == ("timeout", "4 in flight")
            node.submit(lease.lease_id, [fake_group(g, response_len=3) for g in lease.groups])
        assert [feed.get(-1).batch_id, feed.get(0).batch_id] == [0, 1]
        assert feed.get(1) is None  # at once: no group will ever come again
        reason, detail = feed.why_no_batch()
        assert reason == "exhausted"
        assert detail == (
            "the broker's data is exhausted: it handed out its 4 rows 1 time(s) (broker.data.epochs) "
            "and nothing is in flight"
        )
    finally:
        feed.close()
        stop(proc)


def _submit(address, groups: int) -> None:
    with BrokerClient(address, timeout_s=10) as node:
        node.register("rollout", "scripted-node")
        lease = node.lease(groups)
        node.submit(lease.lease_id, [fake_group(g, response_len=3) for g in lease.groups])


def test_a_starved_feed_asks_one_batch_ahead_and_a_fed_one_does_not(tmp_path):
    proc, address = start_broker(tmp_path, 16, group_size=4, batch_groups=2, max_staleness=8)
    feed = _BatchFeed(address, timeout_s=5.0, name="trainer-test")
    try:
        # fed: the fetch is done when the trainer wants its batch, so it asks for nothing further
        _submit(address, 4)
        feed.prefetch(-1)
        feed.pending[1].result(10)
        assert feed.get(-1).batch_id == 0
        assert not feed.fetcher.ask_ahead
        feed.prefetch(0)
        feed.pending[1].result(10)
        assert feed.get(0).batch_id == 1
        assert feed.fetcher.batches_asked_ahead == 0
        # starved: it waits for batch 2, so that fetch asks for batch 3 as soon as batch 2 comes
        feed.prefetch(1)
        with pytest.raises(TimeoutError):
            feed.get(1, wait_s=0.3)
        assert feed.fetcher.ask_ahead
        _submit(address, 4)
        assert feed.get(1, wait_s=10).batch_id == 2
        feed.prefetch(2)
        feed.pending[1].result(10)  # batch 3: the reply to the request sent ahead
        assert feed.get(2).batch_id == 3
        assert feed.fetcher.batches_asked_ahead == 1
        # trainer.ask_ahead=never: starved, it still sends one request a batch
        feed.ask_ahead = "never"
        feed.prefetch(3)
        with pytest.raises(TimeoutError):
            feed.get(3, wait_s=0.3)
        assert not feed.fetcher.ask_ahead
    finally:
        feed.close()
        stop(proc)
