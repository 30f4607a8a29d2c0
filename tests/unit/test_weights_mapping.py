"""Mapping tables and layout transforms on random tensors, and the offline megatron-core sharding."""

from __future__ import annotations

import pytest
import torch

from tidal.model_config import ModelConfig
from tidal.weights_sync.families import mapping_for, padded_vocab_size
from tidal.weights_sync.mapping import canonical_name, fuse_qkv, grouped_expert_name, unfuse_qkv
from tidal.weights_sync.megatron_io import Mesh, global_to_local, local_to_global, split_for_mesh
from tidal.weights_sync.sharding import StageLayout, local_experts, merge, split

QWEN3 = ModelConfig(
    family="qwen3", vocab_size=100, hidden_size=64, num_attention_heads=4, num_key_value_heads=2
)


def test_fused_qkv_matches_megatron_per_group_head_order():
    model = ModelConfig(hidden_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=2)
    # each row holds its head id so the expected order can be written down: q0 q1 k0 v0 | q2 q3 k1 v1
    q = torch.tensor([[h] * 8 for h in (0, 0, 1, 1, 2, 2, 3, 3)], dtype=torch.float32)
    k = torch.tensor([[10 + h] * 8 for h in (0, 0, 1, 1)], dtype=torch.float32)
    v = torch.tensor([[20 + h] * 8 for h in (0, 0, 1, 1)], dtype=torch.float32)
    fused = fuse_qkv(q, k, v, model)
    assert fused[:, 0].tolist() == [0, 0, 1, 1, 10, 10, 20, 20, 2, 2, 3, 3, 11, 11, 21, 21]
    for a, b in zip(unfuse_qkv(fused, model), (q, k, v), strict=True):
        assert torch.equal(a, b)


def test_fused_qkv_rejects_wrong_head_counts():
    with pytest.raises(ValueError, match="kv_heads=2"):
        fuse_qkv(
            torch.zeros(8, 4), torch.zeros(6, 4), torch.zeros(4, 4), QWEN3.model_copy(update={"head_dim": 2})
        )


@pytest.mark.parametrize("shard", ["replicated", "column", "row", "column_glu"])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_split_merge_round_trip(shard, size):
    full = torch.randn(16, 8)
    parts = split(full, shard, size)
    assert len(parts) == size
    assert torch.equal(merge(parts, shard), full)


def test_column_glu_shard_holds_its_gate_and_up_rows():
    gate, up = torch.arange(8.0).view(4, 2), 100 + torch.arange(8.0).view(4, 2)
    shards = split(torch.cat([gate, up]), "column_glu", 2)
    assert torch.equal(shards[1], torch.cat([gate[2:], up[2:]]))


def test_split_rejects_uneven_dimension():
    with pytest.raises(ValueError, match="does not split evenly over 3"):
        split(torch.zeros(4, 4), "column", 3)


def test_stage_layout_chunk_major_offsets():
    layout = StageLayout(num_layers=8, pp=2, vpp=2)
    assert [layout.offset(p, v) for v in range(2) for p in range(2)] == [0, 2, 4, 6]
    assert layout.locate(5) == (0, 1, 1)  # stage 2 = chunk 1 of pp rank 0
    with pytest.raises(ValueError, match="not divisible by pp\\*vpp=3"):
        StageLayout(num_layers=4, pp=3)


def test_expert_ids_local_global_round_trip():
    layout = StageLayout(num_layers=4, pp=2)
    name = "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"
    pp_rank, chunk, ep_rank, local = global_to_local(name, layout, ep=2, num_experts=8)
    assert (pp_rank, chunk, ep_rank, local) == (
        1,
        0,
        1,
        "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight",
    )
    assert local_to_global(local, layout, pp_rank, chunk, ep_rank, num_experts=8, ep=2) == name
    assert list(local_experts(8, 4, 3)) == [6, 7]


def test_te_and_grouped_names_fold_into_local_spec_names():
    assert canonical_name("module.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") == (
        "decoder.layers.0.input_layernorm.weight"
    )
    assert canonical_name("decoder.layers.1.mlp.experts.linear_fc2.weight3") == (
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"
    )
    assert grouped_expert_name("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight") == (
        "decoder.layers.1.mlp.experts.linear_fc2.weight3"
    )


def test_vocab_padding_and_trimming():
    assert padded_vocab_size(100, tp=2) == 256
    mapping = mapping_for(QWEN3, padded_vocab_size=128)
    emb = torch.randn(100, 64)
    (name, padded), *_ = [
        (n, t)
        for n, t in mapping.to_megatron(_hf_state(QWEN3) | {"model.embed_tokens.weight": emb})
        if n.startswith("embedding")
    ]
    assert padded.shape == (128, 64) and torch.equal(padded[:100], emb) and not padded[100:].any()
    assert torch.equal(mapping.to_hf(name, padded)[0][1], emb)


def test_unknown_names_fail_naming_the_mapping_file():
    mapping = mapping_for(QWEN3)
    with pytest.raises(KeyError, match="mapping_qwen3.py"):
        mapping.rule_for("decoder.layers.0.self_attention.linear_bogus.weight")
    with pytest.raises(KeyError, match="no rule"):
        list(mapping.to_megatron({"model.extra.weight": torch.zeros(1)}))


def test_tied_embeddings_drop_the_output_layer():
    tied = QWEN3.model_copy(update={"tie_word_embeddings": True})
    state = {k: v for k, v in _hf_state(tied).items() if k != "lm_head.weight"}
    names = [n for n, _ in mapping_for(tied).to_megatron(state)]
    assert "output_layer.weight" not in names
    keys = {
        k for k, _, _ in split_for_mesh(mapping_for(tied).to_megatron(state), mapping_for(tied), Mesh(pp=2))
    }
    assert "pp1_chunk0/tp0" in keys


def _hf_state(model: ModelConfig) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return dict(AutoModelForCausalLM.from_config(model.to_hf_config()).state_dict())
