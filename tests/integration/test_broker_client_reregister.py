"""A real broker on loopback, SIGKILLed and restarted under clients with calls in flight."""

import asyncio
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tidal.broker.client import AsyncBrokerClient, BrokerClient
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


def test_a_batch_request_lost_with_a_killed_broker_is_asked_again_of_its_successor(tmp_path):
    """The trainer's fetch waits in get_batch (a deadline of minutes) while the broker is killed: the request
    dies with it, and the client asks the restarted broker again instead of raising BrokerTimeout (the
    trainer then crashed and was restarted from its checkpoint; `tidal run` restarts the broker)."""
    port, settings = free_port(), dict(group_size=2, batch_groups=2, max_staleness=100)
    proc, address = start_broker(tmp_path, 32, port=port, **settings)
    try:
        with BrokerClient(address, timeout_s=1.0) as trainer, ThreadPoolExecutor(1) as pool:
            trainer.register("trainer", "t")
            waiting = pool.submit(trainer.get_batch, -1, None, 60.0)
            time.sleep(0.5)  # the request is at the broker, held until a batch is cut
            kill_tree(proc, signal.SIGKILL)
            proc.wait(10)
            time.sleep(3.0)  # the client's slice passes with no reply
            proc, _ = start_broker(tmp_path, 32, port=port, **settings)

            async def feed() -> None:
                async with AsyncBrokerClient(address, timeout_s=10) as node:
                    await node.register("rollout", "n")
                    lease = await node.lease(2)
                    await node.submit(lease.lease_id, [fake_group(g) for g in lease.groups])

            asyncio.run(feed())
            batch = waiting.result(timeout=30)
            assert batch is not None and batch.batch_id == 0 and len(batch.groups) == 2
    finally:
        stop(proc)
