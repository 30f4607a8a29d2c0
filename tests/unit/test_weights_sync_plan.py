"""The sender's recorded bucket plan: replayed syncs send the same bytes as planned ones, and a source that
differs from the record is planned afresh without losing or repeating a tensor."""

from __future__ import annotations

import json

import pytest
import torch

from tidal.weights_sync import bucket, replay, segments
from tidal.weights_sync.sync_plan import PlanDiverged, SyncPlan

OWN = 16 << 10  # bytes: tensors of at least this go out from their own memory


def _model(layers: int = 3, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A megatron-like state: fused fc1 (gate/up back to back, large), fused QKV (strided q/k/v), small norms."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(layers):
        state[f"l{i}.norm"] = torch.randn(16, generator=g).to(dtype)
        state[f"l{i}.qkv"] = torch.randn(2, 3, 256, generator=g).to(dtype)  # [groups, q/k/v rows, hidden]
        state[f"l{i}.fc1"] = torch.randn(16, 1024, generator=g).to(dtype)  # 64 KiB in fp32
        state[f"l{i}.fc2"] = torch.randn(64, 8, generator=g).to(dtype).t()  # strided
    return state


def _source(state: dict[str, torch.Tensor]):
    """HF-like tensors as the sender gets them: q/k/v as grouped rows, gate/up as halves of fc1."""
    for name, t in state.items():
        if name.endswith("qkv"):
            yield from ((f"{name}.{p}", bucket.GroupedRows(t[:, i : i + 1])) for i, p in enumerate("qkv"))
        elif name.endswith("fc1"):
            gate, up = t.chunk(2)
            yield f"{name}.gate", gate
            yield f"{name}.up", up
        else:
            yield name, t


def _stream(items):
    return bucket.stream_buckets(
        items,
        64 << 10,
        16 << 10,
        packed=lambda t: not (isinstance(t, torch.Tensor) and t.is_contiguous() and t.nbytes >= OWN),
        max_bytes=256 << 10,
    )


def _send(plan: SyncPlan, source) -> dict[str, torch.Tensor]:
    """Run a sync through ``plan`` and unpack what each bucket's broadcasts would deliver, by name."""
    got: dict[str, torch.Tensor] = {}
    for items, recipe, spans in plan.buckets(source, ("key",), _stream, OWN):
        staging = torch.empty(recipe.need, dtype=torch.uint8) if recipe.need else None  # as the sender
        wire = torch.cat([p.contiguous().view(torch.uint8) for p in recipe.payload(items, spans, staging)])
        assert [n for n, _ in items] == recipe.spec.names
        for name, t in bucket.unpack(wire, recipe.spec):
            assert name not in got, f"{name} sent twice"
            got[name] = t.clone()
    return got


def _expected(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        n: (t.materialize() if isinstance(t, bucket.GroupedRows) else t).clone() for n, t in _source(state)
    }


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_a_replayed_sync_sends_the_bytes_a_planned_one_sends():
    plan = SyncPlan()
    state = _model()
    _assert_equal(_send(plan, _source(state)), _expected(state))
    planned = plan.planned
    assert planned > 1 and plan.replayed == 0
    for value in (1.0, 2.0):  # new values in the same tensors, as after an optimizer step
        for t in state.values():
            t.fill_(value)
        _assert_equal(_send(plan, _source(state)), _expected(state))
        assert plan.replayed == planned and plan.planned == 0


def test_a_replayed_bucket_keeps_the_planned_order_and_own_memory_broadcasts():
    plan = SyncPlan()
    state = _model()
    first = [
        (recipe.spec.names, recipe.counts)
        for _, recipe, _ in plan.buckets(_source(state), ("k",), _stream, OWN)
    ]
    replay = list(plan.buckets(_source(state), ("k",), _stream, OWN))
    assert [(recipe.spec.names, recipe.counts) for _, recipe, _ in replay] == first
    fresh = [segments.plan(items, OWN) for items in _stream(_source(state))]
    for (_, _, spans), runs in zip(replay, fresh, strict=True):
        own = [span for span, _ in runs if span is not None]
        # gate/up of each fc1 leave as one broadcast from fc1's own memory, as planned
        assert [s.data_ptr() for s in spans] == [s.data_ptr() for s in own]


def test_a_source_that_differs_from_the_record_is_planned_afresh_from_there():
    plan = SyncPlan()
    _send(plan, _source(_model(layers=3)))
    recorded = plan.planned
    # a longer model: the record applies to the first tensors, the rest is planned; nothing lost or repeated
    bigger = _model(layers=5, seed=1)
    _assert_equal(_send(plan, _source(bigger)), _expected(bigger))
    assert plan.planned > 0
    # another dtype from the first tensor on, then a shape change in the middle: planned, bitwise
    half = _model(layers=5, seed=2, dtype=torch.bfloat16)
    _assert_equal(_send(plan, _source(half)), _expected(half))
    assert plan.replayed == 0
    reshaped = _model(layers=5, seed=3, dtype=torch.bfloat16)
    reshaped["l2.norm"] = torch.randn(32).bfloat16()
    _assert_equal(_send(plan, _source(reshaped)), _expected(reshaped))
    assert plan.replayed > 0 and plan.planned > 0
    # the last sync became the record: the same source replays entirely
    _assert_equal(_send(plan, _source(reshaped)), _expected(reshaped))
    assert plan.planned == 0 and plan.replayed > 0
    # a shorter source: the record ends early, the tensors read ahead are still sent
    shorter = _model(layers=2, seed=4, dtype=torch.bfloat16)
    _assert_equal(_send(plan, _source(shorter)), _expected(shorter))
    assert recorded > 0


def test_gate_and_up_no_longer_back_to_back_replan_their_bucket():
    plan = SyncPlan()
    state = _model()
    _send(plan, _source(state))

    def split_fc1():  # the same names and shapes, but gate and up in separate allocations
        for name, t in _source(state):
            yield name, (t.clone() if name.endswith((".gate", ".up")) else t)

    _assert_equal(_send(plan, split_fc1()), _expected(state))
    assert plan.planned > 0


def test_mixed_dtypes_interleaved_in_the_source_replay():
    def mixed():
        g = torch.Generator().manual_seed(5)
        for i in range(40):
            dtype = torch.float32 if i % 3 else torch.bfloat16  # buckets of one dtype close out of order
            yield f"w{i}", torch.randn(1000 + i, generator=g).to(dtype)

    plan = SyncPlan()
    want = dict(mixed())
    _assert_equal(_send(plan, mixed()), want)
    planned = plan.planned
    _assert_equal(_send(plan, mixed()), want)
    assert plan.replayed == planned and plan.planned == 0


def test_the_announcement_is_sglangs_json_encoded_once():
    plan = SyncPlan()
    (_, recipe, _), *_ = plan.buckets(_source(_model()), ("k",), _stream, OWN)
    body = json.loads(recipe.announcement.body(group_name="g", weight_version="3", flush_cache=True))
    assert body == {
        "names": recipe.spec.names,
        "dtypes": recipe.spec.dtypes,
        "shapes": recipe.spec.shapes,
        "load_format": "flattened_bucket",
        **({"segments": recipe.counts} if recipe.counts is not None else {}),
        "group_name": "g",
        "weight_version": "3",
        "flush_cache": True,
    }


def test_a_bucket_whose_packed_part_is_only_an_empty_tensor_is_sent():
    def source():
        yield "empty", torch.empty(0)
        yield "big", torch.arange(8192, dtype=torch.float32)  # 32 KiB: from its own memory

    plan = SyncPlan()
    for _ in range(2):  # planned, then replayed
        _assert_equal(_send(plan, source()), dict(source()))


def _send_strict(plan: SyncPlan, source) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """A replayed update: what each recorded bucket's broadcasts deliver, and their sizes (the wire)."""
    got, sizes = {}, []
    for items, recipe, spans in plan.buckets(source, ("key",), _stream, OWN, strict=True):
        if spans is None:
            payload = recipe.payload_packed(items, torch.empty(recipe.spec.nbytes, dtype=torch.uint8))
        else:
            staging = torch.empty(recipe.need, dtype=torch.uint8) if recipe.need else None
            payload = recipe.payload(items, spans, staging)
        sizes.append([p.numel() for p in payload])
        wire = torch.cat([p.contiguous().view(torch.uint8) for p in payload])
        got.update((n, t.clone()) for n, t in bucket.unpack(wire, recipe.spec))
    return got, sizes


def test_a_strict_replay_sends_the_recorded_broadcasts_even_when_tensors_moved():
    """An engine replaying an update expects the recorded broadcasts, size for size: gate and up that no
    longer lie back to back are packed into the staging buffer instead of being planned afresh."""
    plan = SyncPlan()
    state = _model()
    _send(plan, _source(state))
    _, recorded = _send_strict(plan, _source(state))

    def split_fc1():
        for name, t in _source(state):
            yield name, (t.clone() if name.endswith((".gate", ".up")) else t)

    got, sizes = _send_strict(plan, split_fc1())
    assert sizes == recorded
    _assert_equal(got, _expected(state))
    assert plan.planned == 0


def test_a_strict_replay_of_another_source_raises_plan_diverged():
    plan = SyncPlan()
    _send(plan, _source(_model(layers=3)))
    for other in (_model(layers=2), _model(layers=4), _model(layers=3, dtype=torch.bfloat16)):
        with pytest.raises(PlanDiverged):
            _send_strict(plan, _source(other))
    with pytest.raises(PlanDiverged, match="no recorded sync"):
        _send_strict(SyncPlan(), _source(_model()))


def test_the_recorded_plans_digest_survives_the_announcements_json():
    """The sender digests its recipes; the engine digests the announcements it parsed from JSON."""
    plan = SyncPlan()
    _send(plan, _source(_model()))
    entries = [
        replay.Entry(
            r.announcement.names, r.announcement.dtypes, r.announcement.shapes, r.announcement.segments
        )
        for r in plan.recorded(("key",))
    ]
    parsed = []
    for r in plan.recorded(("key",)):
        body = json.loads(r.announcement.body(group_name="g", bucket_seq=0))
        parsed.append(replay.Entry(body["names"], body["dtypes"], body["shapes"], body.get("segments")))
    assert replay.plan_digest(parsed) == replay.plan_digest(entries)
    assert replay.plan_digest(parsed[:-1]) != replay.plan_digest(entries)


def test_the_recorder_keeps_only_complete_ordered_updates():
    rec = replay.Recorder()
    a, b = replay.Entry(["x"], ["float32"], [[2]], None), replay.Entry(["y"], ["float32"], [[3]], [1])
    rec.begin()
    rec.add("g", 4, b)
    rec.add("g", 3, a)  # arrival order does not matter; bucket_seq does
    rec.end()
    digest = replay.plan_digest([a, b])
    assert (
        rec.plan("g", digest) == [a, b] and rec.plan("g", "other") is None and rec.plan("h", digest) is None
    )
    rec.begin()
    rec.add("g", 0, a)
    rec.add("g", 2, b)  # a gap: not the whole update
    rec.end()
    assert rec.plan("g", digest) is None and rec.last("g") is None
    for broken in ("unordered", "failed"):
        rec.begin()
        rec.add("g", 0, a)
        if broken == "unordered":
            rec.add("g", None, b)
        else:
            rec.add("g", 1, b)
            rec.fail("g")
        rec.end()
        assert rec.last("g") is None, broken
