"""The trainer's reports sent without waiting for their replies (``wait=False``), against a real broker:
the broker applies them in order with the connection's other requests, and the client's next call skips
their replies (also an error reply) and gets its own."""

import asyncio

from tidal.broker.client import AsyncBrokerClient, BrokerClient
from tidal.broker.testing import fake_group, start_broker
from tidal.procs import stop


async def _submit_groups(address: str, count: int) -> None:
    async with AsyncBrokerClient(address, timeout_s=20) as node:
        await node.register("rollout", "node")
        submitted = 0
        while submitted < count:
            lease = await node.lease(count - submitted)
            assert lease is not None, "the broker leased nothing"
            await node.submit(lease.lease_id, [fake_group(pg) for pg in lease.groups])
            submitted += len(lease.groups)


def test_reports_sent_without_waiting_are_applied_in_order_and_their_replies_skipped(tmp_path):
    proc, address = start_broker(tmp_path, 32, group_size=2, batch_groups=4, max_staleness=8)
    try:
        asyncio.run(_submit_groups(address, 8))
        with BrokerClient(address, timeout_s=20) as trainer:
            trainer.register("trainer", "t")
            first = trainer.get_batch(-1, timeout_s=20)
            assert first is not None and first.batch_id == 0
            trainer.publish_version(1, wait=False)
            trainer.report_consumed(first.batch_id, wait=False)
            trainer.report_consumed(5, wait=False)  # never cut: refused, and nobody reads the refusal
            stats = trainer.stats()  # its own reply, past the three unread ones
            assert stats["policy_version"] == 1
            assert stats["batches"]["consumed"] == 0
            assert stats["errors"] == {"bad_request": 1}
            second = trainer.get_batch(first.batch_id, timeout_s=20)
            assert second is not None and second.batch_id == 1
            assert sorted(g.group_id for g in second.groups) != sorted(g.group_id for g in first.groups)
            trainer.report_consumed(second.batch_id)  # waits, as before
            assert trainer.stats()["batches"]["consumed"] == 1
    finally:
        stop(proc)
