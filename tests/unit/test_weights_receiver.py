"""The engine-side receive: announcements that arrive out of order are received in ``bucket_seq`` order,
and bucket k+1 is received into the second buffer while bucket k is still being loaded.

Both ranks of a real two-rank gloo group live in this process (the sender in the test's thread, each
announcement's handler in a thread of its own, as an engine's HTTP server runs them).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tidal.procs import free_port
from tidal.weights_sync import bucket, transport
from tidal.weights_sync.receiver import BucketOrderError, WeightReceiver


@pytest.fixture
def pair():
    """(sender group, receiver joined as rank 1)."""
    port = free_port()
    receiver = WeightReceiver("cpu", timeout_s=10)
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(
            receiver.init_group,
            master_address="127.0.0.1",
            master_port=port,
            rank_offset=1,
            world_size=2,
            group_name="g",
            backend="gloo",
        )
        sender = transport.create_group(
            master_address="127.0.0.1", master_port=port, rank=0, world_size=2, group_name="g", timeout_s=10
        )
        joined.result(timeout=30)
    yield sender, receiver
    receiver.destroy_group("g")
    sender.destroy()


def _buckets(n: int) -> list[tuple[torch.Tensor, bucket.BucketSpec]]:
    """n buckets of different sizes (a receive of the wrong announcement would not even fit)."""
    g = torch.Generator().manual_seed(0)
    return [bucket.pack([(f"w{k}", torch.randn(100 + 37 * k, generator=g))]) for k in range(n)]


def _handler(receiver: WeightReceiver, spec: bucket.BucketSpec, seq: int, got: dict, hold=None, loaded=None):
    with receiver.receive(
        names=spec.names, dtypes=spec.dtypes, shapes=spec.shapes, group_name="g", seq=seq
    ) as tensors:
        if hold is not None:
            assert hold.wait(timeout=30)  # still "loading": this bucket's buffer stays taken
        got[seq] = [(n, t.clone()) for n, t in tensors]
    if loaded is not None:
        loaded.set()


def test_announcements_arriving_out_of_order_are_received_in_sequence(pair):
    sender, receiver = pair
    buckets = _buckets(4)
    got: dict[int, list] = {}
    with ThreadPoolExecutor(4) as pool:
        # the handlers start in reverse order: each must wait for its turn
        futures = [
            pool.submit(_handler, receiver, spec, k, got)
            for k, (_, spec) in reversed(list(enumerate(buckets)))
        ]
        for buf, _ in buckets:
            sender.broadcast(buf, src=0)
        for f in futures:
            f.result(timeout=30)
    for k, (buf, spec) in enumerate(buckets):
        assert [n for n, _ in got[k]] == spec.names
        assert all(
            torch.equal(t, want) for (_, t), (_, want) in zip(got[k], bucket.unpack(buf, spec), strict=True)
        )


def test_next_bucket_is_received_while_the_previous_one_is_still_loading(pair):
    sender, receiver = pair
    (buf0, spec0), (buf1, spec1) = _buckets(2)
    hold, loaded = threading.Event(), threading.Event()
    got: dict[int, list] = {}
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(_handler, receiver, spec0, 0, got, hold, loaded)
        second = pool.submit(_handler, receiver, spec1, 1, got)
        sender.broadcast(buf0, src=0)
        sender.broadcast(buf1, src=0)  # completes although bucket 0 is still held
        second.result(timeout=30)
        assert not loaded.is_set() and 1 in got
        hold.set()
        first.result(timeout=30)
    assert torch.equal(got[0][0][1], bucket.unpack(buf0, spec0)[0][1])  # bucket 1 did not overwrite it
    assert torch.equal(got[1][0][1], bucket.unpack(buf1, spec1)[0][1])


def test_a_bucket_whose_predecessor_never_comes_fails_naming_it(pair):
    _, receiver = pair
    receiver.timeout_s = 0.5
    (_, spec), _ = _buckets(2)
    with pytest.raises(BucketOrderError, match="bucket_seq 1 waited .* for bucket 0"):
        _handler(receiver, spec, 1, {})


def test_destroying_the_group_releases_waiting_handlers(pair):
    _, receiver = pair
    (_, spec), _ = _buckets(2)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(_handler, receiver, spec, 3, {})
        while receiver._state("g").issued < 4:  # the handler registered and waits for bucket 0
            threading.Event().wait(0.01)
        assert receiver.destroy_group("g")
        with pytest.raises(BucketOrderError, match="destroyed"):
            waiting.result(timeout=30)


def _bucket_of(*tensors: tuple[str, torch.Tensor]) -> bucket.BucketSpec:
    return bucket.BucketSpec(
        names=[n for n, _ in tensors],
        dtypes=[bucket.dtype_name(t.dtype) for _, t in tensors],
        shapes=[list(t.shape) for _, t in tensors],
    )


def test_the_next_buckets_receives_are_posted_before_the_current_ones_bytes_arrive(pair):
    sender, receiver = pair
    (buf0, spec0), (buf1, spec1) = _buckets(2)
    got: dict[int, list] = {}
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_handler, receiver, spec, k, got) for k, spec in ((1, spec1), (0, spec0))]
        state = receiver._state("g")
        deadline = time.monotonic() + 30
        while state.next_seq < 2 and time.monotonic() < deadline:  # bucket 1's turn came, no byte sent yet
            time.sleep(0.01)
        assert state.next_seq == 2 and receiver.waiting == 0 and not got
        for buf in (buf0, buf1):
            sender.broadcast(buf, src=0)
        for f in futures:
            f.result(timeout=30)
    assert torch.equal(got[0][0][1], bucket.unpack(buf0, spec0)[0][1])
    assert torch.equal(got[1][0][1], bucket.unpack(buf1, spec1)[0][1])


def test_tensors_to_load_are_yielded_while_later_segments_still_arrive_in_place(pair):
    sender, receiver = pair
    small, big, last = torch.randn(5), torch.randn(1000), torch.randn(300)
    spec = _bucket_of(("small", small), ("big", big), ("last", last))
    weights = {"big": torch.zeros(1000), "last": torch.zeros(300)}  # the engine's, taken in place
    loading, seen = threading.Event(), {}

    def handler():
        with receiver.receive(
            names=spec.names,
            dtypes=spec.dtypes,
            shapes=spec.shapes,
            group_name="g",
            seq=0,
            segments=[1, 1, 1],
            target=lambda name, shape, dtype: weights.get(name),
        ) as tensors:
            seen["tensors"] = [(n, t.clone()) for n, t in tensors]
            loading.set()
        seen["exited"] = time.monotonic()

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(handler)
        sender.broadcast(small.clone(), src=0)
        # the handler loads "small" before "big" and "last" are even sent
        assert loading.wait(timeout=30)
        sent = time.monotonic()
        sender.broadcast(big.clone(), src=0)
        sender.broadcast(last.clone(), src=0)
        done.result(timeout=30)
    assert [n for n, _ in seen["tensors"]] == ["small"] and torch.equal(seen["tensors"][0][1], small)
    assert seen["exited"] >= sent  # the block exits (the engine replies) only once every byte is in
    assert torch.equal(weights["big"], big) and torch.equal(weights["last"], last)
    assert receiver.stats.in_place_bytes == (1000 + 300) * 4


def test_buckets_received_wholly_in_place_take_no_buffer_so_none_waits_for_a_load(pair):
    """Bucket 2 would share bucket 0's buffer; landing wholly in the engine's weights, it needs none, so it
    is received while bucket 0's handler is still inside its block (loading)."""
    sender, receiver = pair
    sent = [torch.randn(50 + 10 * k) for k in range(3)]
    weights = {f"w{k}": torch.zeros_like(t) for k, t in enumerate(sent)}  # the engine's, taken in place
    hold, held = threading.Event(), threading.Event()

    def handler(k: int) -> None:
        spec = _bucket_of((f"w{k}", sent[k]))
        with receiver.receive(
            names=spec.names,
            dtypes=spec.dtypes,
            shapes=spec.shapes,
            group_name="g",
            seq=k,
            segments=[1],
            target=lambda name, shape, dtype: weights.get(name),
        ) as tensors:
            assert tensors == []  # nothing to load: every byte lands in place
            if k == 0:
                held.set()
                assert hold.wait(timeout=30)

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(handler, k) for k in range(3)]
        assert held.wait(timeout=30)
        for t in sent:
            sender.broadcast(t.clone(), src=0)
        futures[1].result(timeout=30)
        futures[2].result(timeout=30)  # bucket 0 is still held
        assert not futures[0].done()
        hold.set()
        futures[0].result(timeout=30)
    assert all(torch.equal(weights[f"w{k}"], t) for k, t in enumerate(sent))
    assert receiver.stats.in_place_bytes == sum(t.numel() * 4 for t in sent)


def test_only_the_segments_not_received_in_place_take_room_each_keeping_its_alignment(pair):
    sender, receiver = pair
    # 2 + 2002 + 8 bytes: without the in-place middle, the float32 pair would sit at byte 2 (unaligned)
    head, middle, tail = torch.randn(1).bfloat16(), torch.randn(1001).bfloat16(), torch.randn(2)
    spec = _bucket_of(("head", head), ("middle", middle), ("tail", tail))
    buf, _ = bucket.pack([("head", head), ("middle", middle), ("tail", tail)])
    into = torch.zeros(1001, dtype=torch.bfloat16)
    seen = {}

    def handler():
        with receiver.receive(
            names=spec.names,
            dtypes=spec.dtypes,
            shapes=spec.shapes,
            group_name="g",
            seq=0,
            segments=[1, 1, 1],
            target=lambda name, shape, dtype: into if name == "middle" else None,
        ) as tensors:
            seen.update((n, t.clone()) for n, t in tensors)

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(handler)
        for part in (buf[:2], buf[2:2004], buf[2004:]):
            sender.broadcast(part.clone(), src=0)
        done.result(timeout=30)
    assert (
        sorted(seen) == ["head", "tail"]
        and torch.equal(seen["head"], head)
        and torch.equal(seen["tail"], tail)
    )
    assert torch.equal(into, middle)
    held = receiver._state("g").slots[0].buffer
    assert held.numel() == 12  # head at 0, tail at 4 (2004 modulo 16 is 4): 12 bytes, not the bucket's 2012


def test_a_bucket_mixing_dtypes_and_an_empty_tensor_is_yielded_bitwise(pair):
    sender, receiver = pair
    items = [
        ("a", torch.randn(3, 2).bfloat16()),
        ("b", torch.randn(6).bfloat16()),  # bf16 up to byte 24: the float32 tensors stay aligned
        ("c", torch.randn(2, 5)),
        ("empty", torch.randn(0, 4)),
        ("d", torch.randint(0, 100, (3,))),
    ]
    buf, spec = bucket.pack(items)
    got = {}

    def handler():
        with receiver.receive(
            names=spec.names, dtypes=spec.dtypes, shapes=spec.shapes, group_name="g", seq=0
        ) as tensors:
            got.update((n, t.clone()) for n, t in tensors)

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(handler)
        sender.broadcast(buf.clone(), src=0)
        done.result(timeout=30)
    assert list(got) == [n for n, _ in items]
    assert all(got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in items)


def test_a_repeated_announcement_reuses_its_views_and_a_grown_buffer_gets_new_ones(pair):
    """A sync repeats its buckets: the second receive of an announcement yields the views made for the first
    (no view per tensor per sync), with the new bytes; a larger bucket that regrows the buffer drops them."""
    sender, receiver = pair
    g = torch.Generator().manual_seed(3)

    def receive_one(items, seq):
        buf, spec = bucket.pack(items)
        got = {}
        with ThreadPoolExecutor(1) as pool:
            seen = []

            def handler():
                with receiver.receive(
                    names=spec.names, dtypes=spec.dtypes, shapes=spec.shapes, group_name="g", seq=seq
                ) as tensors:
                    seen.extend(t for _, t in tensors)
                    got.update((n, t.clone()) for n, t in tensors)

            future = pool.submit(handler)
            sender.broadcast(buf, src=0)
            future.result(timeout=30)
        assert all(torch.equal(got[n], t) for n, t in items)
        return seen

    small = [(f"w{i}", torch.randn(50 + i, generator=g)) for i in range(6)]
    first = receive_one(small, 0)
    receive_one([(f"x{i}", torch.randn(7, generator=g)) for i in range(3)], 1)  # the other buffer
    again = receive_one([(n, torch.randn(t.shape, generator=g)) for n, t in small], 2)
    assert all(a is b for a, b in zip(first, again, strict=True))
    receive_one([(f"big{i}", torch.randn(4000, generator=g)) for i in range(3)], 3)
    receive_one([(f"big{i}", torch.randn(4000, generator=g)) for i in range(3)], 4)  # regrows slot 0
    receive_one([(f"x{i}", torch.randn(7, generator=g)) for i in range(3)], 5)
    regrown = receive_one([(n, torch.randn(t.shape, generator=g)) for n, t in small], 6)  # slot 0 again
    assert not any(a is b for a, b in zip(first, regrown, strict=True))
    bad = receiver.receive(
        names=[n for n, _ in small],
        dtypes=["float32"] * len(small),
        shapes=[list(t.shape) for _, t in small],
        group_name="g",
        seq=7,
        segments=[2, 2],
    )
    with pytest.raises(ValueError, match="segments"), bad:  # a known announcement with bad segments
        pass


def test_raw_receives_land_in_one_reused_buffer_or_each_in_its_own_memory(pair):
    """The benchmark's ceiling (``receive_raw``): into one buffer of the largest size, or with ``distinct``
    each broadcast into its own part of a buffer of their sum, as a sync's bytes land in the weights."""
    sender, receiver = pair
    sizes = [300, 1000, 200]
    parts = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    for distinct in (False, True):
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(receiver.receive_raw, sizes, "g", distinct)
            sender.barrier()
            for part in parts:
                sender.broadcast(part.clone(), src=0)
            sender.barrier()
            done.result(timeout=30)
    assert torch.equal(receiver._raw_distinct, torch.cat(parts))  # every part kept where it landed
    assert receiver._raw_distinct.numel() == sum(sizes)
