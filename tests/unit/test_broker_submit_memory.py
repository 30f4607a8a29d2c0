"""The ring a rollout node and the broker share for submits (broker/submit_memory.py), both sides in one
process: the node allocates, the broker checks spans and gives them back, the node reuses only freed room."""

import os

import numpy as np
import pytest

from tidal.broker.protocol import BAD_FRAME, ProtocolError
from tidal.broker.submit_memory import HEADER_BYTES, SubmitArena, SubmitMemoryUnavailable, SubmitRing

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create (Linux)")


def _pair(capacity: int) -> tuple[SubmitArena, SubmitRing]:
    arena = SubmitArena(capacity)
    return arena, SubmitRing(arena.offer(os.getpid()))


def test_bytes_the_node_writes_are_the_bytes_the_broker_holds():
    arena, ring = _pair(1 << 16)
    start, memory = ring.alloc(1000)
    memory[:] = np.frombuffer(bytes(range(250)) * 4, np.uint8)
    (span,) = arena.spans([[start, 1000]], 1 << 20)
    assert len(span) == 1000
    assert bytes(span.buffer) == bytes(range(250)) * 4


def test_the_node_reuses_room_only_once_the_broker_let_go_of_everything_before_it():
    arena, ring = _pair(4096)
    spans = []
    for _ in range(4):
        start, _ = ring.alloc(1000)  # 1024 bytes each once aligned: the ring is full
        spans.append(arena.spans([[start, 1000]], 1 << 20)[0])
    assert ring.alloc(64) is None and ring.full == 1
    del spans[1]  # out of order: the oldest is still held, so no room yet
    assert ring.alloc(64) is None
    del spans[0]  # now the first two are free
    start, _ = ring.alloc(2000)
    assert start == 4096  # back at the ring's start (positions keep counting)
    assert arena.spans([[start, 2000]], 1 << 20)


def test_a_span_that_would_not_fit_before_the_end_starts_again_at_the_beginning():
    arena, ring = _pair(4096)
    first = arena.spans([[ring.alloc(3000)[0], 3000]], 1 << 20)
    del first
    start, memory = ring.alloc(2000)  # 3008 + 2000 > 4096: skips to position 4096
    assert start == 4096 and len(memory) == 2000


def _take(arena: SubmitArena, ring: SubmitRing, held: list, nbytes: int = 1000) -> int:
    start, _ = ring.alloc(nbytes)
    held.append(arena.spans([[start, nbytes]], 1 << 20)[0])
    return start


def test_the_node_goes_back_to_the_start_once_the_room_there_is_twice_its_peak_in_flight():
    arena, ring = _pair(1 << 20)
    held: list = []
    for _ in range(3):
        _take(arena, ring, held)  # the peak: three spans (3072 bytes) in flight
    starts = []
    for _ in range(7):  # one let go, one taken: two or three in flight, the free start grows by 1024
        del held[0]
        starts.append(_take(arena, ring, held))
    # carried on until the free start held twice the peak and the new span (7168 bytes), then the next lap
    assert starts == [3072 + 1024 * k for k in range(6)] + [1 << 20]
    for _ in range(6):  # the room after it (the rest of the free start) is there to use
        _take(arena, ring, held)
    assert held[-1]._entry[0] == (1 << 20) + 6 * 1024
    assert ring.full == 0


def test_the_node_keeps_cycling_through_a_few_times_its_peak_lap_after_lap():
    # The room a jump skips at a lap's end is not in flight: were it counted, the peak would be almost
    # the whole ring after the first jump and the node would walk all of it on every later lap.
    arena, ring = _pair(1 << 20)
    held: list = []
    for _ in range(3):
        _take(arena, ring, held)
    laps = set()
    for _ in range(200):
        del held[0]
        start = _take(arena, ring, held)
        laps.add(start // (1 << 20))
        assert start % (1 << 20) < 10 * 1024  # the free start (2 x 3 KiB + the span) and what follows
    assert ring.peak == 3 * 1024
    assert len(laps) > 10 and ring.full == 0


def test_a_dip_in_what_is_in_flight_does_not_send_the_node_back_too_early():
    # Eight spans in flight, then all but the last let go (a dip), then eight again: a jump back to the
    # ring's start during the dip would find 7 KiB of room there for 8 KiB and send a submit on the wire.
    arena, ring = _pair(1 << 16)
    held: list = []
    for _ in range(8):
        _take(arena, ring, held)
    del held[:7]
    for _ in range(8):
        _take(arena, ring, held)
    assert [h._entry[0] for h in held] == [1024 * k for k in range(7, 16)]
    assert ring.full == 0


def test_spans_outside_the_free_ring_are_refused_with_the_rule():
    arena, ring = _pair(4096)
    start, _ = ring.alloc(100)
    held = arena.spans([[start, 100]], 1 << 20)
    cases = [
        [[0, 100]],  # already named
        [[128, 0]],  # empty
        [[4000, 200]],  # wraps past the end
        [[128, 4096]],  # overruns the held span
        [[128, 50], [100, 10]],  # goes backwards
        "spans",
        [[1, 2, 3]],
        [[1.0, 2]],
    ]
    for wire in cases:
        with pytest.raises(ProtocolError) as err:
            arena.spans(wire, 1 << 20)
        assert err.value.code == BAD_FRAME
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        arena.spans([[128, 900]], 512)
    assert held and arena.held == 1


def test_a_node_that_maps_other_memory_is_told_so():
    arena, _ = _pair(4096)
    offer = arena.offer(os.getpid())
    with pytest.raises(SubmitMemoryUnavailable, match="nonce"):
        SubmitRing({**offer, "nonce": b"x" * 16})
    with pytest.raises(SubmitMemoryUnavailable, match="bytes"):
        SubmitRing({**offer, "bytes": 8192})
    with pytest.raises(SubmitMemoryUnavailable):
        SubmitRing({**offer, "pid": 2**22 + 12345})
    arena.close()
    with pytest.raises(SubmitMemoryUnavailable):
        SubmitRing(offer)


def test_spans_stay_readable_after_the_node_left():
    arena, ring = _pair(4096)
    start, memory = ring.alloc(10)
    memory[:] = 7
    (span,) = arena.spans([[start, 10]], 1 << 20)
    arena.close()
    ring.close()
    assert bytes(span.buffer) == bytes([7] * 10)
    assert HEADER_BYTES % 4096 == 0
