"""The staleness bound against a real broker process under randomised timing (a hypothesis property).

Three asyncio rollout nodes lease random amounts, "generate" for random times with the policy version they
saw after leasing, and submit; a trainer steps at random speeds, publishing a version per batch. Whatever the
timing: no trained group is older than eta, every prompt is trained once or counted as dropped, the
admission rule holds in every stats snapshot, and eta = 0 is exactly synchronous.
"""

import asyncio
import contextlib
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from tidal.broker.client import AsyncBrokerClient, LeaseRejected
from tidal.broker.testing import fake_group, start_broker
from tidal.procs import stop

pytestmark = pytest.mark.slow

ROWS, GROUP_SIZE, BATCH_GROUPS = 24, 2, 3


async def _node(address, rnd: random.Random, done: asyncio.Event):
    async with AsyncBrokerClient(address, timeout_s=20) as c:
        await c.register("rollout", f"n{rnd.random():.3f}")
        while not done.is_set():
            lease = await c.lease(rnd.randint(1, 3))
            if lease is None:
                await asyncio.sleep(rnd.uniform(0, 0.01))
                continue
            seen = await c.policy_version()  # the weights this node generates with
            await asyncio.sleep(rnd.uniform(0, 0.03))
            with contextlib.suppress(LeaseRejected):  # expired while "generating": re-leased elsewhere
                await c.submit(lease.lease_id, [fake_group(pg, version=seen) for pg in lease.groups])


async def _trainer(address, rnd: random.Random, batches: list, snapshots: list):
    async with AsyncBrokerClient(address, timeout_s=20) as c:
        await c.register("trainer", "t")
        after = -1
        while True:
            batch = await c.get_batch(after, timeout_s=0.2)
            snapshots.append((await c.stats())["admission"])
            if batch is None:
                if (await c.stats())["finished"]:
                    return
                continue
            batches.append(batch)
            await asyncio.sleep(rnd.uniform(0, 0.03))
            await c.publish_version(batch.batch_id + 1)
            await c.report_consumed(batch.batch_id)
            after = batch.batch_id


async def _run(address, seed):
    batches, snapshots = [], []
    done = asyncio.Event()
    nodes = [asyncio.create_task(_node(address, random.Random(seed + i), done)) for i in range(3)]
    try:
        await asyncio.wait_for(_trainer(address, random.Random(seed), batches, snapshots), 60)
    finally:
        done.set()
        await asyncio.gather(*nodes, return_exceptions=True)
    async with AsyncBrokerClient(address, timeout_s=20) as c:
        return batches, snapshots, await c.stats()


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(eta=hs.integers(0, 2), seed=hs.integers(0, 2**16))
def test_no_trained_group_is_older_than_eta_whatever_the_timing(tmp_path_factory, eta, seed):
    tmp = tmp_path_factory.mktemp("stale")
    proc, address = start_broker(
        tmp,
        ROWS,
        group_size=GROUP_SIZE,
        batch_groups=BATCH_GROUPS,
        max_staleness=eta,
        data={"epochs": 1, "seed": seed},
    )
    try:
        batches, snapshots, stats = asyncio.run(_run(address, seed))
    finally:
        stop(proc)
    trained = [g.group_id for b in batches for g in b.groups]
    assert len(trained) == len(set(trained))
    assert len(trained) + stats["counters"]["dropped_stale_groups"] == ROWS
    for b in batches:
        assert b.policy_version == b.batch_id  # the trainer publishes b before asking for batch b
        for g in b.groups:
            assert b.policy_version - g.min_version <= eta
    for adm in snapshots:
        assert adm["accepted"] + adm["leased"] <= adm["limit"]
    if eta == 0:
        assert stats["counters"]["dropped_stale_groups"] == 0
        assert all(int(s.versions.min()) == b.batch_id for b in batches for g in b.groups for s in g.samples)
