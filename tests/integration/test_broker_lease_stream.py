"""Standing lease requests (``stream_leases``) against a real broker on loopback: leases are pushed up to
the node's credit, a submit or an expiry returns credit, and nothing is lost or leased twice."""

import asyncio

import pytest

from tidal.broker.client import AsyncBrokerClient, BrokerError
from tidal.broker.testing import fake_group, start_broker
from tidal.procs import stop


async def _take(client: AsyncBrokerClient, timeout: float = 10.0):
    lease = await client.next_lease(timeout)
    assert lease is not None, "no lease pushed in time"
    return lease


async def _heartbeat(client: AsyncBrokerClient, every_s: float) -> None:
    while True:
        await client.heartbeat()
        await asyncio.sleep(every_s)


def test_leases_are_pushed_up_to_the_credit_and_each_submit_returns_credit(tmp_path):
    proc, address = start_broker(
        tmp_path, 10, group_size=2, batch_groups=2, max_staleness=100, data={"epochs": 1}
    )

    async def run():
        async with AsyncBrokerClient(address, timeout_s=10) as client:
            await client.register("rollout", "streamer")
            await client.stream_leases(credit=3, max_groups=2)
            first = [await _take(client), await _take(client)]
            assert sorted(len(lease.groups) for lease in first) == [1, 2]
            # The credit is used up: nothing more comes until a group is resolved.
            assert await client.next_lease(0.5) is None
            await client.submit(first[0].lease_id, [fake_group(first[0].groups[0])])
            refill = await _take(client)
            assert len(refill.groups) == 1
            # Drain the data: every pushed group submitted once; the end of the data is pushed too.
            seen = []
            queue = [*first, refill]
            seen.append(first[0].groups[0].group_id)
            pending = [(first[0].lease_id, pg) for pg in first[0].groups[1:]]
            pending += [(lease.lease_id, pg) for lease in queue[1:] for pg in lease.groups]
            while True:
                for lease_id, pg in pending:
                    await client.submit(lease_id, [fake_group(pg)])
                    seen.append(pg.group_id)
                lease = await client.next_lease(10.0)
                if lease is None:
                    break
                pending = [(lease.lease_id, pg) for pg in lease.groups]
            assert client.leases_finished
            assert sorted(seen) == sorted(set(seen)) and len(seen) == 10
            stats = await client.stats()
            assert stats["counters"]["accepted_groups"] == 10
            assert stats["finished"]

    try:
        asyncio.run(run())
    finally:
        stop(proc)


@pytest.mark.slow
def test_pushed_leases_of_a_vanished_node_expire_and_are_pushed_to_another(tmp_path):
    proc, address = start_broker(
        tmp_path,
        8,
        group_size=2,
        batch_groups=2,
        max_staleness=100,
        data={"epochs": 1},
        lease_timeout_s=1.0,
        node_timeout_s=1.0,
    )

    async def run():
        lost = AsyncBrokerClient(address, timeout_s=10)
        await lost.register("rollout", "vanishes")
        await lost.stream_leases(credit=4)
        lost_ids = {pg.group_id for pg in (await _take(lost)).groups}
        assert len(lost_ids) == 4
        await lost.close()  # gone without leave or heartbeat, as a killed node: its lease must expire

        async with AsyncBrokerClient(address, timeout_s=10) as client:
            await client.register("rollout", "survivor")
            # Pushes go to live nodes only: a node waiting for leases heartbeats as the agent does.
            beats = asyncio.create_task(_heartbeat(client, 0.2))
            await client.stream_leases(credit=4)
            seen = []
            while True:
                lease = await client.next_lease(15.0)
                if lease is None:
                    break
                await client.submit(lease.lease_id, [fake_group(pg) for pg in lease.groups])
                seen += [pg.group_id for pg in lease.groups]
            assert client.leases_finished
            beats.cancel()
            assert lost_ids <= set(seen) and len(seen) == len(set(seen)) == 8
            stats = await client.stats()
            assert stats["counters"]["accepted_groups"] == 8
            assert stats["counters"]["expired_leases"] >= 1

    try:
        asyncio.run(run())
    finally:
        stop(proc)


def test_a_standing_request_survives_a_broker_restart_and_bad_credit_is_refused(tmp_path):
    port_proc, address = start_broker(
        tmp_path, 6, group_size=2, batch_groups=2, max_staleness=100, data={"epochs": 1}
    )
    port = int(address.rsplit(":", 1)[1])
    procs = [port_proc]

    async def run():
        async with AsyncBrokerClient(address, timeout_s=10) as client:
            await client.register("rollout", "restarts")
            with pytest.raises(BrokerError, match="credit must be >= 0"):
                await client.stream_leases(credit=-1)
            await client.stream_leases(credit=2)
            lease = await _take(client)
            await client.submit(lease.lease_id, [fake_group(pg) for pg in lease.groups])
            acked = {pg.group_id for pg in lease.groups}
            client.pushed_leases()  # whatever came meanwhile is lost with the broker
            stop(procs.pop())
            procs.append(
                start_broker(
                    tmp_path, port=port, group_size=2, batch_groups=2, max_staleness=100, data={"epochs": 1}
                )[0]
            )
            # The first call after the restart registers again and stands the request again.
            await client.heartbeat()
            seen = set()
            while True:
                lease = await client.next_lease(15.0)
                if lease is None:
                    break
                await client.submit(lease.lease_id, [fake_group(pg) for pg in lease.groups])
                seen |= {pg.group_id for pg in lease.groups}
            # Acknowledged groups are not leased again; every other prompt is, once.
            assert not (seen & acked) and len(seen | acked) == 6
            assert (await client.stats())["counters"]["accepted_groups"] == 6

    try:
        asyncio.run(run())
    finally:
        for p in procs:
            stop(p)
