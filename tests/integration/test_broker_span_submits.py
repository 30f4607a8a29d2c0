"""How a rollout node's streamed submit through shared memory ends, against a real broker process on
loopback: the future ``submit_streamed`` returns completes with the broker's answer (accepted and filtered
groups, or its refusal), times out when the broker never answers, and a caller that cancels it leaves
nothing waiting."""

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable

import pytest

from tidal.broker.client import AsyncBrokerClient, BrokerTimeout, LeaseRejected
from tidal.broker.local_journal import host_id
from tidal.broker.testing import fake_group, start_broker
from tidal.procs import stop

pytestmark = pytest.mark.skipif(
    not hasattr(os, "memfd_create") or host_id() is None, reason="needs memfd_create and a boot id (Linux)"
)


def _as_node(
    tmp_path, scenario: Callable[[AsyncBrokerClient, int], Awaitable[None]], timeout_s: float = 20, **settings
) -> None:
    """Run ``scenario(client, broker_pid)`` as a registered node of a fresh broker (16 rows, groups of 2)."""
    proc, address = start_broker(tmp_path, 16, group_size=2, batch_groups=2, **settings)

    async def main() -> None:
        client = AsyncBrokerClient(address, timeout_s=timeout_s)
        await client.register("rollout", "spans")
        assert client._ring is not None, "the broker on this host offers its submit memory"
        try:
            await scenario(client, proc.pid)
        finally:
            await client.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        stop(proc)


def _nothing_waiting(client: AsyncBrokerClient) -> bool:
    return not client._pending and not client._submits.by_id


def test_a_span_submit_resolves_with_the_accepted_and_the_filtered_groups(tmp_path):
    async def scenario(client: AsyncBrokerClient, _: int) -> None:
        lease = await client.lease(2)
        same, mixed = lease.groups
        groups = [fake_group(same, rewards=[1.0, 1.0]), fake_group(mixed, rewards=[0.0, 1.0])]
        done = await client.submit_streamed(lease.lease_id, groups)
        assert await done == {"accepted": [mixed.group_id], "filtered": [same.group_id]}
        assert (client.span_submits, client.wire_submits) == (1, 0)
        assert _nothing_waiting(client)

    _as_node(tmp_path, scenario, dynamic_sampling=True)


def test_a_span_submit_on_an_unknown_lease_fails_with_lease_rejected(tmp_path):
    async def scenario(client: AsyncBrokerClient, _: int) -> None:
        lease = await client.lease(1)
        done = await client.submit_streamed("no-such-lease", [fake_group(lease.groups[0])])
        with pytest.raises(LeaseRejected, match="unknown or expired"):
            await done
        assert _nothing_waiting(client)
        # the node goes on: the same group on its own lease is accepted
        ok = await client.submit_streamed(lease.lease_id, [fake_group(lease.groups[0])])
        assert (await ok)["accepted"] == [lease.groups[0].group_id]

    _as_node(tmp_path, scenario)


def test_a_span_submit_the_broker_never_answers_times_out_and_a_cancelled_one_leaves_nothing(tmp_path):
    async def scenario(client: AsyncBrokerClient, broker_pid: int) -> None:
        lease = await client.lease(2)
        first, second = (fake_group(pg) for pg in lease.groups)
        os.kill(broker_pid, signal.SIGSTOP)  # the broker hangs: no acknowledgement comes
        try:
            done = await client.submit_streamed(lease.lease_id, [first])
            with pytest.raises(BrokerTimeout, match="no reply to submit"):
                await done
            assert _nothing_waiting(client)
            given_up = await client.submit_streamed(lease.lease_id, [second])
            assert client._pending
            given_up.cancel()
            await asyncio.sleep(0)  # the cancellation's callbacks run
            assert _nothing_waiting(client)
        finally:
            os.kill(broker_pid, signal.SIGCONT)

    _as_node(tmp_path, scenario, timeout_s=1.0)
