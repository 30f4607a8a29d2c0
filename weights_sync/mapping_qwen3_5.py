"""Qwen3.5 (``qwen3_5_moe``): Gated DeltaNet and gated attention layers, routed + gated shared expert.

Two megatron-core tensors fuse Hugging Face tensors in their own way (``fuse`` values of this family):

- ``gated_qkv``: with ``attention_output_gate`` megatron's ``linear_qkv`` rows are, per query group, the
  group's query heads, then their gate heads, then the group's key and value head. Hugging Face's
  ``q_proj`` interleaves per head ``[query_h; gate_h]``.
- ``gdn_in_proj``: megatron's GatedDeltaNet ``in_proj`` rows are ``[q; k; v; z; beta; alpha]``, which is
  Hugging Face's ``in_proj_qkv`` (itself ``[q; k; v]``), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``
  stacked.

Every other tensor is a plain copy: the norm weights keep the checkpoint's convention (zero-centred,
except the Gated DeltaNet output norm) because tidal's Qwen3.5 norms compute with it
(``trainer/families/norms.py``). Tensor parallelism > 1 is refused by the trainer for this family.
"""

from __future__ import annotations

import torch

from tidal.weights_sync.mapping import (
    COMMON_RULES,
    ROUTED_EXPERT_RULES,
    Rule,
    WeightMapping,
)


def _layer(megatron: str, hf: str, shard: str = "replicated") -> Rule:
    return Rule(f"decoder.layers.{{layer}}.{megatron}", (f"model.layers.{{layer}}.{hf}",), shard=shard)  # type: ignore[arg-type]


GATED_ATTENTION_RULES: tuple[Rule, ...] = (
    Rule(
        "decoder.layers.{layer}.self_attention.linear_qkv.weight",
        (
            "model.layers.{layer}.self_attn.q_proj.weight",
            "model.layers.{layer}.self_attn.k_proj.weight",
            "model.layers.{layer}.self_attn.v_proj.weight",
        ),
        "gated_qkv",  # type: ignore[arg-type]
        "column",
    ),
    _layer("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
    _layer("self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
)

GATED_DELTANET_RULES: tuple[Rule, ...] = (
    Rule(
        "decoder.layers.{layer}.self_attention.in_proj.weight",
        (
            "model.layers.{layer}.linear_attn.in_proj_qkv.weight",
            "model.layers.{layer}.linear_attn.in_proj_z.weight",
            "model.layers.{layer}.linear_attn.in_proj_b.weight",
            "model.layers.{layer}.linear_attn.in_proj_a.weight",
        ),
        "gdn_in_proj",  # type: ignore[arg-type]
        "column",
    ),
    _layer("self_attention.conv1d.weight", "linear_attn.conv1d.weight", "column"),
    _layer("self_attention.dt_bias", "linear_attn.dt_bias", "column"),
    _layer("self_attention.A_log", "linear_attn.A_log", "column"),
    _layer("self_attention.out_norm.weight", "linear_attn.norm.weight"),
    _layer("self_attention.out_proj.weight", "linear_attn.out_proj.weight", "row"),
)

GATED_SHARED_EXPERT_RULES: tuple[Rule, ...] = (
    Rule(
        "decoder.layers.{layer}.mlp.shared_experts.linear_fc1.weight",
        (
            "model.layers.{layer}.mlp.shared_expert.gate_proj.weight",
            "model.layers.{layer}.mlp.shared_expert.up_proj.weight",
        ),
        "glu",
        "column_glu",
    ),
    _layer("mlp.shared_experts.linear_fc2.weight", "mlp.shared_expert.down_proj.weight", "row"),
    _layer("mlp.shared_experts.gate_weight", "mlp.shared_expert_gate.weight"),
)

RULES: tuple[Rule, ...] = (
    COMMON_RULES
    + GATED_ATTENTION_RULES
    + GATED_DELTANET_RULES
    + ROUTED_EXPERT_RULES
    + GATED_SHARED_EXPERT_RULES
)


class Qwen35Mapping(WeightMapping):
    """The generic mapping plus this family's two fusions."""

    def to_hf(self, megatron_name: str, tensor: torch.Tensor, packable: bool = False):
        match = self.rule_for(megatron_name)
        names, fuse = match.hf_names, match.rule.fuse
        if fuse == "gated_qkv":
            return list(zip(names, unfuse_gated_qkv(tensor, self.model), strict=True))
        if fuse == "gdn_in_proj":
            return list(zip(names, tensor.split(self._in_proj_rows(), dim=0), strict=True))
        return super().to_hf(megatron_name, tensor, packable)

    def _fuse(self, rule: Rule, parts: list[torch.Tensor]) -> torch.Tensor:
        if rule.fuse == "gated_qkv":
            return fuse_gated_qkv(*parts, self.model)
        if rule.fuse == "gdn_in_proj":
            rows = [p.shape[0] for p in parts]
            if rows != self._in_proj_rows():
                raise ValueError(
                    f"{rule.hf}: rows {rows} do not match the Gated DeltaNet's q/k/v, z, beta, alpha sizes "
                    f"{self._in_proj_rows()} (linear_* fields of the model config)"
                )
            return torch.cat(parts, dim=0)
        return super()._fuse(rule, parts)

    def _in_proj_rows(self) -> list[int]:
        m = self.model
        qk = m.linear_num_key_heads * m.linear_key_head_dim
        v = m.linear_num_value_heads * m.linear_value_head_dim
        return [2 * qk + v, v, m.linear_num_value_heads, m.linear_num_value_heads]


MAPPING = Qwen35Mapping


def _gated_dims(model) -> tuple[int, int, int]:
    groups = model.num_key_value_heads
    return groups, model.num_attention_heads // groups, model.head_dim


def fuse_gated_qkv(q_proj: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model) -> torch.Tensor:
    """HF ``q_proj`` (per head [query; gate]), ``k_proj``, ``v_proj`` -> megatron's gated ``linear_qkv``."""
    groups, per_group, head_dim = _gated_dims(model)
    rest = q_proj.shape[1:]
    expected = (2 * groups * per_group * head_dim, groups * head_dim, groups * head_dim)
    if (q_proj.shape[0], k.shape[0], v.shape[0]) != expected:
        raise ValueError(
            f"gated q/k/v rows {(q_proj.shape[0], k.shape[0], v.shape[0])} do not match heads="
            f"{groups * per_group}, kv_heads={groups}, head_dim={head_dim} with an output gate (expected {expected})"
        )
    by_head = q_proj.reshape(groups, per_group, 2, head_dim, *rest)
    fused = torch.cat(
        [
            by_head[:, :, 0].reshape(groups, per_group * head_dim, *rest),
            by_head[:, :, 1].reshape(groups, per_group * head_dim, *rest),
            k.reshape(groups, head_dim, *rest),
            v.reshape(groups, head_dim, *rest),
        ],
        dim=1,
    )
    return fused.reshape(-1, *rest)


def unfuse_gated_qkv(qkv: torch.Tensor, model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, per_group, head_dim = _gated_dims(model)
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (2 * per_group + 2) * head_dim, *rest)
    query, gate, k, v = grouped.split([per_group * head_dim, per_group * head_dim, head_dim, head_dim], dim=1)
    q_proj = torch.stack(
        [query.reshape(groups, per_group, head_dim, *rest), gate.reshape(groups, per_group, head_dim, *rest)],
        dim=2,
    )
    return q_proj.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)
