"""Megatron's fused QKV sent whole (grouped_qkv): the sender's stream fuses q/k/v back into a view of the
trainer's tensor, and the engine takes it apart into exactly the q, k and v that the per-name path loads."""

from __future__ import annotations

import pytest
import torch

from tidal.model_config import ModelConfig
from tidal.rollout.embedded.model import NamedTensorLoader, WeightLoadError, build_model
from tidal.rollout.embedded.testing import TINY_QWEN3
from tidal.weights_sync import bucket, grouped_qkv
from tidal.weights_sync.families import mapping_for
from tidal.weights_sync.mapping import unfuse_qkv

MODEL = ModelConfig(**TINY_QWEN3)  # 4 query heads, 2 key/value heads of 16: 2 groups of 2 queries
QKV = "decoder.layers.1.self_attention.linear_qkv.weight"
PREFIX = "model.layers.1.self_attn"


def _qkv() -> torch.Tensor:
    rows = (MODEL.num_attention_heads + 2 * MODEL.num_key_value_heads) * MODEL.head_dim
    return torch.randn(rows, MODEL.hidden_size, generator=torch.Generator().manual_seed(0))


def test_the_stream_fuses_q_k_v_into_one_view_of_the_trainers_tensor():
    qkv = _qkv()
    norm = torch.ones(MODEL.hidden_size)
    items = [("model.norm.weight", norm), *mapping_for(MODEL).to_hf(QKV, qkv, packable=True)]
    assert [type(t) for _, t in items[1:]] == [bucket.GroupedRows] * 3
    out = list(grouped_qkv.fuse(items))
    assert [n for n, _ in out] == ["model.norm.weight", f"{PREFIX}.qkv_proj.weight"]
    fused = out[1][1]
    # [groups, query heads per group + k + v, head_dim, hidden], the trainer's memory itself: no copy
    assert list(fused.shape) == [2, 4, 16, MODEL.hidden_size] and fused.is_contiguous()
    assert fused.data_ptr() == qkv.data_ptr() and torch.equal(fused.reshape(qkv.shape), qkv)
    assert out[0][1] is norm


def test_taking_a_fused_qkv_apart_gives_hugging_faces_q_k_v():
    qkv = _qkv()
    ((_, fused),) = grouped_qkv.fuse(mapping_for(MODEL).to_hf(QKV, qkv, packable=True))
    want = unfuse_qkv(qkv, MODEL)
    assert grouped_qkv.part_shapes(fused.shape) == tuple(list(t.shape) for t in want)
    got = [torch.empty(t.shape) for t in want]
    for g, src in zip(got, grouped_qkv.split(fused), strict=True):
        g.view(src.shape).copy_(src)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert grouped_qkv.parts(f"{PREFIX}.qkv_proj.weight") == tuple(f"{PREFIX}.{p}_proj.weight" for p in "qkv")
    assert grouped_qkv.parts(f"{PREFIX}.q_proj.weight") is None


def test_anything_but_a_complete_contiguous_triple_passes_unchanged():
    qkv = _qkv()
    q, k, v = mapping_for(MODEL).to_hf(QKV, qkv, packable=True)
    copied = [(n, bucket.GroupedRows(t.grouped.clone())) for n, t in (q, k, v)]  # no longer one matrix
    for items in ([q, k], [k, v, q], copied, [q, ("x.k_proj.weight", k[1]), v]):
        out = list(grouped_qkv.fuse(items))
        assert [n for n, _ in out] == [n for n, _ in items]
        assert all(a is b for (_, a), (_, b) in zip(out, items, strict=True))


def test_the_engine_loads_a_fused_qkv_as_it_loads_q_k_v_by_name():
    qkv = _qkv()
    ((name, fused),) = grouped_qkv.fuse(mapping_for(MODEL).to_hf(QKV, qkv, packable=True))
    by_name = NamedTensorLoader(build_model(MODEL, seed=1, device="cpu", dtype="float32"))
    whole = NamedTensorLoader(build_model(MODEL, seed=1, device="cpu", dtype="float32"))
    by_name.load(list(zip([f"{PREFIX}.{p}_proj.weight" for p in "qkv"], unfuse_qkv(qkv, MODEL), strict=True)))
    whole.load([(name, fused)])
    for p in "qkv":
        target = f"{PREFIX}.{p}_proj.weight"
        assert torch.equal(whole.read(target), by_name.read(target))
    # received in place: straight into the engine's fused matrix, whose rows lie in megatron's grouped order
    in_place = NamedTensorLoader(build_model(MODEL, seed=1, device="cpu", dtype="float32"))
    target = in_place.target(name, list(fused.shape), fused.dtype)
    assert target.data_ptr() == in_place.lm.model.layers[1].self_attn.qkv_weight.data_ptr()
    target.copy_(fused)
    in_place.unscramble([name])  # nothing to copy apart
    assert not in_place.landings
    # attention that is not fused takes it into a landing tensor, then copies its rows into q/k/v
    landed = NamedTensorLoader(build_model(MODEL, seed=1, device="cpu", dtype="float32", fuse=False))
    landed.target(name, list(fused.shape), fused.dtype).copy_(fused)
    landed.unscramble([name])
    for loader in (in_place, landed):
        assert all(
            torch.equal(loader.read(f"{PREFIX}.{p}_proj.weight"), by_name.read(f"{PREFIX}.{p}_proj.weight"))
            for p in "qkv"
        )
    with pytest.raises(WeightLoadError, match="qkv_proj.weight"):
        whole.check([(name, fused.reshape(2, 64, -1))])
    with pytest.raises(WeightLoadError, match="shape mismatch"):
        whole.check([(name, torch.empty(2, 5, 16, MODEL.hidden_size))])
