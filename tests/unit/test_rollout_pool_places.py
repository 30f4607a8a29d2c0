"""The engine pool's request places: a group sent as one request holds its n places on one engine.

No request is sent here: the places are the pool's own bookkeeping (the engines' URLs are never contacted).
"""

import asyncio

from tidal.rollout.engine_pool import EnginePool, EngineSlot


def _pool(engines: int, concurrency: int) -> EnginePool:
    slots = [EngineSlot(i, f"http://127.0.0.1:{9 + i}", port=0) for i in range(engines)]
    pool = EnginePool(slots, concurrency=concurrency, request_timeout_s=1.0, start_timeout_s=1.0)
    for slot in slots:
        slot.healthy = True
    return pool


def test_a_group_waits_for_room_for_all_its_places_on_one_engine():
    async def go():
        pool = _pool(engines=2, concurrency=4)
        async with pool.slot(3) as first, pool.slot(3) as second:
            assert first is not second  # the other engine had room for three
            assert [s.inflight for s in pool.slots] == [3, 3]
            async with pool.slot(1) as single:
                assert single.inflight == 4
            third = asyncio.create_task(_hold(pool, 3))
            await asyncio.sleep(0.05)
            assert not third.done(), "a group took places that were not free"
        assert await asyncio.wait_for(third, 5) == 3
        assert [s.inflight for s in pool.slots] == [0, 0]

    asyncio.run(go())


def test_a_group_larger_than_the_concurrency_takes_a_whole_engine():
    async def go():
        pool = _pool(engines=1, concurrency=4)
        async with pool.slot(16) as slot:
            assert slot.inflight == 4  # clamped: it would never fit otherwise
        assert slot.inflight == 0

    asyncio.run(go())


async def _hold(pool: EnginePool, places: int) -> int:
    async with pool.slot(places) as slot:
        return slot.inflight
