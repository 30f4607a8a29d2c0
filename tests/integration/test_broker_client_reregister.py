"""A real broker on loopback, SIGKILLed and restarted under an async client with several calls in flight."""

import asyncio
import signal

import pytest

from tidal.broker.client import AsyncBrokerClient
from tidal.broker.testing import fake_group, start_broker
from tidal.procs import free_port, kill_tree, stop, tail

pytestmark = pytest.mark.slow


def _registrations(log) -> int:
    return sum("joined" in line for line in log.read_text().splitlines())


def test_concurrent_calls_after_a_broker_restart_register_once_and_keep_their_leases(tmp_path):
    port, settings = free_port(), dict(group_size=2, batch_groups=4, max_staleness=100)
    proc, address = start_broker(tmp_path, 32, port=port, **settings)
    log = tmp_path / "broker.log"

    async def scenario() -> None:
        nonlocal proc
        async with AsyncBrokerClient(address, timeout_s=20) as client:
            first_id = await client.register("rollout", "n")
            kill_tree(proc, signal.SIGKILL)
            proc.wait(10)
            before = _registrations(log)
            proc, _ = start_broker(tmp_path, 32, port=port, **settings)
            # Every call meets a broker that does not know this connection: each would register on its
            # own, and each later registration would take back the leases granted under the one before.
            leases = await asyncio.gather(*(client.lease(1) for _ in range(6)), client.heartbeat())
            leases = leases[:-1]
            assert all(lease is not None and len(lease.groups) == 1 for lease in leases)
            assert _registrations(log) - before == 1, tail(log)
            assert client.node_id != first_id
            results = await asyncio.gather(
                *(client.submit(lease.lease_id, [fake_group(lease.groups[0])]) for lease in leases)
            )
            assert [len(r["accepted"]) for r in results] == [1] * len(leases)
            stats = await client.stats()
            assert stats["counters"]["rejected_submissions"] == 0
            assert stats["counters"]["accepted_groups"] == len(leases)
            assert list(stats["nodes"]) == [client.node_id]

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        stop(proc)
