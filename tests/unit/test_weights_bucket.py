"""Flattened buckets: streaming planner, packing strided views, checksums."""

from __future__ import annotations

import pydantic
import pytest
import torch

from tidal.weights_sync import bucket


def test_stream_buckets_are_dtype_homogeneous_bounded_and_complete():
    tensors = [(f"f{i}", torch.randn(100)) for i in range(5)] + [
        (f"b{i}", torch.randn(300).bfloat16()) for i in range(3)
    ]
    tensors.insert(2, ("big", torch.randn(1000)))  # larger than a bucket: goes alone
    buckets = list(bucket.stream_buckets(tensors, bucket_bytes=1000))
    assert sorted(n for b in buckets for n, _ in b) == sorted(n for n, _ in tensors)
    for b in buckets:
        assert len({t.dtype for _, t in b}) == 1
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= 1000 or len(b) == 1
    assert sorted(map(len, buckets)) == sorted(map(len, bucket.plan_buckets(tensors, 1000)))


def test_pack_copies_strided_views_and_unpack_restores_them():
    base = torch.randn(6, 8)
    items = [("t", base.t()), ("slice", base[:, 2:5]), ("row", base[1])]
    staging = torch.empty(4096, dtype=torch.uint8)
    buf, spec = bucket.pack(items, out=staging)
    assert buf.data_ptr() == staging.data_ptr() and buf.numel() == spec.nbytes
    for (name, original), (got_name, got) in zip(items, bucket.unpack(buf, spec), strict=True):
        assert name == got_name and torch.equal(got, original)


def test_checksum_detects_a_flipped_byte():
    buf, _ = bucket.pack([("w", torch.randn(64))])
    crc = bucket.checksum(buf)
    buf[17] ^= 1
    assert bucket.checksum(buf) != crc


def test_stream_buckets_yield_before_the_source_is_exhausted():
    consumed = []

    def source():
        for i in range(10):
            consumed.append(i)
            yield f"w{i}", torch.zeros(100)

    first = next(iter(bucket.stream_buckets(source(), bucket_bytes=800)))
    assert len(first) == 2 and len(consumed) == 3  # the third tensor closed the first bucket


def test_stream_buckets_ramp_from_the_first_bucket_size_up_to_the_bucket_size():
    tensors = [(f"w{i}", torch.zeros(25)) for i in range(60)]  # 100 bytes each
    buckets = list(bucket.stream_buckets(tensors, bucket_bytes=800, first_bytes=100))
    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]
    assert sizes[:5] == [100, 200, 400, 800, 800] and sum(sizes) == 6000
    assert [n for b in buckets for n, _ in b] == [n for n, _ in tensors]


def test_tensors_sent_from_their_own_memory_count_only_against_the_bucket_size_in_all():
    # 100-byte tensors, packed, and 1000-byte ones that go on broadcasts of their own
    tensors = [(f"w{i}", torch.zeros(25 if i % 2 else 250)) for i in range(40)]
    buckets = list(
        bucket.stream_buckets(
            tensors, bucket_bytes=300, packed=lambda t: t.numel() * t.element_size() < 1000, max_bytes=4000
        )
    )
    for b in buckets:
        sizes = [t.numel() * t.element_size() for _, t in b]
        assert sum(n for n in sizes if n < 1000) <= 300 and sum(sizes) <= 4000
    # each holds 3 packed (300 bytes) and 3 others (3300 in all); with packed sizes only, a 1000-byte
    # tensor would close every bucket
    assert [len(b) for b in buckets] == [6] * 6 + [4]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in tensors]
    # the bucket size in all ramps up from the first bucket's size, doubling up to max_bytes
    ramped = bucket.stream_buckets(tensors, 300, first_bytes=100, packed=lambda t: False, max_bytes=4000)
    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in ramped]
    assert sizes[:6] == [1000, 100, 1000, 100, 1100, 3200] and max(sizes) <= 4000


def test_bucket_size_defaults_depend_on_the_backend():
    from tidal.weights_sync.config import WeightSyncConfig

    assert WeightSyncConfig().bucket_sizes("gloo") == (8 << 20, 64 << 20)
    assert WeightSyncConfig().bucket_sizes("nccl") == (64 << 20, 512 << 20)
    explicit = WeightSyncConfig(bucket_bytes=1000, first_bucket_bytes=4000)
    assert explicit.bucket_sizes("gloo") == (1000, 1000)  # a first bucket never exceeds the bucket size
    # to engines that take segments a bucket may hold more than its packed size
    assert WeightSyncConfig().segmented_bytes("gloo") == 256 << 20
    assert explicit.model_copy(update={"segmented_bucket_bytes": 10}).segmented_bytes("gloo") == 1000


def test_own_broadcast_threshold_depends_on_the_backend_unless_set():
    from tidal.weights_sync.config import WeightSyncConfig

    assert WeightSyncConfig().own_bytes("gloo") == 4 << 20
    assert WeightSyncConfig().own_bytes("nccl") == 64 << 20
    assert WeightSyncConfig(own_broadcast_bytes=5000).own_bytes("nccl") == 5000
    assert WeightSyncConfig(own_broadcast_bytes=None).own_bytes("gloo") is None  # pack everything
    for bad in (0, "big"):
        with pytest.raises(pydantic.ValidationError, match="own_broadcast_bytes"):
            WeightSyncConfig(own_broadcast_bytes=bad)


def test_packable_qkv_packs_bitwise_like_the_unfused_copies():
    from tidal.weights_sync.families import mapping_for
    from tidal.weights_sync.tiny_models import TINY

    model = TINY["qwen3"]  # 4 heads in 2 query groups: HF's q rows are not a view of the fused rows
    mapping = mapping_for(model)
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    fused = torch.randn(model.head_dim * (model.num_attention_heads + 2 * model.num_key_value_heads), 64)
    copies, packable = mapping.to_hf(name, fused), mapping.to_hf(name, fused, packable=True)
    assert any(isinstance(t, bucket.GroupedRows) for _, t in packable)
    assert [t.materialize() if isinstance(t, bucket.GroupedRows) else t for _, t in packable][0].equal(
        copies[0][1]
    )
    want, want_spec = bucket.pack(copies)
    got, got_spec = bucket.pack(packable, out=torch.empty(want.numel() + 64, dtype=torch.uint8))
    assert got_spec == want_spec and torch.equal(got, want)


def test_segments_plan_sends_back_to_back_tensors_from_their_memory_and_packs_the_rest():
    from tidal.weights_sync import segments

    fused_fc1 = torch.randn(8, 1024)  # gate and up of one fc1, back to back, 16 KiB each
    gate, up = fused_fc1[:4], fused_fc1[4:]
    fused_qkv = torch.randn(2, 3, 1024)  # per group: q, k, v rows; q/k/v are strided views
    q, k, v = (bucket.GroupedRows(fused_qkv[:, i : i + 1]) for i in range(3))
    strided = torch.randn(1024, 8).t()  # 32 KiB, not contiguous: packed
    items = [("norm", torch.randn(4)), ("gate", gate), ("up", up), ("q", q), ("k", k), ("v", v)]
    items += [("strided", strided), ("alone", torch.randn(4096)), ("down", torch.randn(64))]
    runs = segments.plan(items, own_bytes=16 << 10)
    # the small and the strided tensors first, packed together; then the rest in memory order (separate
    # allocations here, so in any order): gate/up as one broadcast from fc1's own memory, q/k/v packed as
    # a segment of their own, and the large tensor from its own memory
    (own, loose), *rest = runs
    assert own is None and sorted(n for n, _ in loose) == ["down", "norm", "strided"]
    assert sorted((own is not None, [n for n, _ in run]) for own, run in rest) == [
        (False, ["q", "k", "v"]),
        (True, ["alone"]),
        (True, ["gate", "up"]),
    ]
    span = next(own for own, run in rest if run[0][0] == "gate")
    assert span.data_ptr() == fused_fc1.data_ptr() and span.numel() == fused_fc1.nbytes
    assert segments.plan(items, own_bytes=None) == [(None, items)]


def test_segments_plan_finds_runs_in_a_buffer_laid_out_last_first():
    """Megatron's DDP keeps the parameters in one buffer, the last first: the tensors a bucket lists in the
    source's order lie back to back in the reverse order, and still go out as one broadcast."""
    from tidal.weights_sync import segments

    buffer = torch.randn(3 * 4096)
    a, b, c = buffer[8192:], buffer[4096:8192], buffer[:4096]  # the source's order: a, b, c
    runs = segments.plan([("a", a), ("b", b), ("c", c)], own_bytes=16 << 10)
    assert [(own is not None, [n for n, _ in run]) for own, run in runs] == [(True, ["c", "b", "a"])]
    assert runs[0][0].data_ptr() == buffer.data_ptr() and runs[0][0].numel() == buffer.nbytes
