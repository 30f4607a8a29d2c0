"""Qwen3.5's weight mapping on CPU: Hugging Face checkpoint <-> megatron-core names and layouts, bitwise.

No kernel runs here; the megatron-core model built from these tensors is compared with transformers in
tests/unit/test_families_cpu_models.py (CPU) and tests/gpu/test_gpu_qwen3_5.py (flash-linear-attention).
"""

from __future__ import annotations

import pytest
import torch
import yaml

from tidal.model_config import ModelConfig
from tidal.weights_sync import hf_io
from tidal.weights_sync.families import mapping_for
from tidal.weights_sync.mapping_qwen3_5 import fuse_gated_qkv, unfuse_gated_qkv
from tidal.weights_sync.tiny_models import save_random_hf

TINY = "configs/tiny/qwen3_5_35b_a3b.yaml"


def tiny_model() -> ModelConfig:
    with open(TINY) as f:
        return ModelConfig(**yaml.safe_load(f)["model"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = save_random_hf(tiny_model(), tmp_path_factory.mktemp("qwen3_5"), seed=0)
    return hf_io.load_config(directory), hf_io.load_tensors(directory)


def test_config_survives_the_hf_directory(checkpoint):
    model, _ = checkpoint
    # transformers writes the layer pattern as layer_types; the interval must come back from it
    assert model == tiny_model().model_copy(update={"path": model.path})


def test_checkpoint_round_trips_bitwise_through_megatron_names(checkpoint):
    model, hf = checkpoint
    mapping = mapping_for(model)
    megatron = dict(mapping.to_megatron(hf))
    back = {}
    for name, tensor in megatron.items():
        back.update(mapping.to_hf(name, tensor))
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name
    # the layers' kinds: three Gated DeltaNet layers, then one gated attention layer
    assert "decoder.layers.0.self_attention.in_proj.weight" in megatron
    assert "decoder.layers.3.self_attention.linear_qkv.weight" in megatron
    assert "decoder.layers.3.self_attention.in_proj.weight" not in megatron
    assert megatron["decoder.layers.0.mlp.shared_experts.gate_weight"].shape == (1, model.hidden_size)


def test_gdn_in_proj_stacks_qkv_z_beta_alpha(checkpoint):
    model, hf = checkpoint
    fused = dict(mapping_for(model).to_megatron(hf))["decoder.layers.1.self_attention.in_proj.weight"]
    parts = [hf[f"model.layers.1.linear_attn.in_proj_{p}.weight"] for p in ("qkv", "z", "b", "a")]
    assert torch.equal(fused, torch.cat(parts))
    qk = model.linear_num_key_heads * model.linear_key_head_dim
    v = model.linear_num_value_heads * model.linear_value_head_dim
    assert fused.shape[0] == 2 * qk + 2 * v + 2 * model.linear_num_value_heads


def test_gated_qkv_rows_are_grouped_query_gate_key_value():
    model = tiny_model()
    heads, groups, dim = model.num_attention_heads, model.num_key_value_heads, model.head_dim
    # each row holds its own label: head * 10 + (0 query, 1 gate) for q_proj, 100 + group for k, 200 + group for v
    q_proj = torch.tensor(
        [[h * 10 + part] for h in range(heads) for part in (0, 1) for _ in range(dim)]
    ).float()
    k = torch.tensor([[100 + g] for g in range(groups) for _ in range(dim)]).float()
    v = torch.tensor([[200 + g] for g in range(groups) for _ in range(dim)]).float()
    fused = fuse_gated_qkv(q_proj, k, v, model)
    per = heads // groups
    want = []
    for g in range(groups):
        group_heads = range(g * per, (g + 1) * per)
        want += [h * 10 for h in group_heads] + [h * 10 + 1 for h in group_heads] + [100 + g, 200 + g]
    assert fused[::dim, 0].tolist() == want
    assert all(torch.equal(a, b) for a, b in zip(unfuse_gated_qkv(fused, model), (q_proj, k, v), strict=True))


def test_mismatched_gated_qkv_rows_name_the_heads():
    model = tiny_model()
    with pytest.raises(ValueError, match="do not match heads=4, kv_heads=2, head_dim=16 with an output gate"):
        fuse_gated_qkv(torch.zeros(64, 8), torch.zeros(32, 8), torch.zeros(32, 8), model)
