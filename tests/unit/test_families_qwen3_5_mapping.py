"""Qwen3.5's two fused layouts in the weight mapping, checked row by row on labelled tensors.

The whole checkpoint's round trip (bitwise) and the logits of the megatron-core model built from it are in
tests/unit/test_families_cpu_models.py (CPU) and tests/gpu/test_gpu_qwen3_5.py (flash-linear-attention).
"""

from __future__ import annotations

import pytest
import torch
import yaml

from tidal.model_config import ModelConfig
from tidal.weights_sync.families import mapping_for
from tidal.weights_sync.mapping_qwen3_5 import fuse_gated_qkv, unfuse_gated_qkv

TINY = "configs/tiny/qwen3_5_35b_a3b.yaml"


def tiny_model() -> ModelConfig:
    with open(TINY) as f:
        return ModelConfig(**yaml.safe_load(f)["model"])


def test_gdn_in_proj_stacks_qkv_z_beta_alpha_and_back():
    model = tiny_model()
    mapping = mapping_for(model)
    qk = model.linear_num_key_heads * model.linear_key_head_dim
    v = model.linear_num_value_heads * model.linear_value_head_dim
    rows = {"qkv": 2 * qk + v, "z": v, "b": model.linear_num_value_heads, "a": model.linear_num_value_heads}
    hf = {
        f"model.layers.1.linear_attn.in_proj_{part}.weight": torch.full((n, model.hidden_size), float(i))
        for i, (part, n) in enumerate(rows.items())
    }
    (name, fused), *_ = mapping.to_megatron(hf)
    assert name == "decoder.layers.1.self_attention.in_proj.weight"
    assert fused[:, 0].tolist() == [float(i) for i, n in enumerate(rows.values()) for _ in range(n)]
    back = dict(mapping.to_hf(name, fused))
    assert all(torch.equal(back[n], t) for n, t in hf.items())
    with pytest.raises(ValueError, match="Gated DeltaNet's q/k/v, z, beta, alpha sizes"):
        list(mapping.to_megatron({**hf, "model.layers.1.linear_attn.in_proj_z.weight": torch.zeros(3, 64)}))


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
