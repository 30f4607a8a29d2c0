"""A real broker on loopback, SIGKILLed and restarted under clients with calls in flight."""

import asyncio
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tidal.broker.client import AsyncBrokerClient, BrokerClient, BrokerTimeout
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


def test_clients_started_before_their_broker_wait_for_it_and_register(tmp_path, caplog):
    """On a cluster every actor may start at once: a node or a trainer whose broker is not up yet asks
    again, saying so, until it answers (``register(wait_s=...)``); without a wait it fails as before."""
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    with (
        BrokerClient(address, timeout_s=0.5) as early,
        BrokerClient(address, timeout_s=1.0) as waiting,
        ThreadPoolExecutor(2) as pool,
    ):
        with pytest.raises(BrokerTimeout):
            early.register("trainer", "no-wait")
        trainer = pool.submit(waiting.register, "trainer", "t", None, 60.0)

        async def node() -> str:
            async with AsyncBrokerClient(address, timeout_s=1.0) as client:
                return await client.register("rollout", "n", wait_s=60.0)

        rollout = pool.submit(asyncio.run, node())
        time.sleep(3.0)  # both ask, and ask again
        proc, _ = start_broker(tmp_path, 8, port=port)
        try:
            assert trainer.result(timeout=30) and rollout.result(timeout=30)
            stats = waiting.stats()
        finally:
            stop(proc)
    assert any("no reply from the broker at" in r.getMessage() for r in caplog.records)
    # requests queued while it was down may reach it too; membership still holds one of each client
    roles = sorted(n["role"] for n in stats["nodes"].values() if n["alive"] and n["name"] != "no-wait")
    assert roles == ["rollout", "trainer"], stats["nodes"]
