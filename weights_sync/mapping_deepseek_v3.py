"""DeepSeek-V3 style: multi-latent attention, leading dense layers, routed + shared experts.

megatron-core's MLA keeps the HF row layouts: ``linear_kv_down_proj`` rows are [kv_lora_rank, rope dims]
like ``kv_a_proj_with_mqa``, and ``linear_q_up_proj`` / ``linear_kv_up_proj`` rows are per head
[nope, rope] / [nope, v] like ``q_b_proj`` / ``kv_b_proj``; so every MLA tensor is a plain copy. In the
local spec the down projections are column-parallel (their outputs are gathered before the norm).
"""

from __future__ import annotations

from tidal.weights_sync.mapping import COMMON_RULES, DENSE_MLP_RULES, ROUTED_EXPERT_RULES, Rule


def _attn(megatron: str, hf: str, shard: str = "replicated") -> Rule:
    return Rule(
        f"decoder.layers.{{layer}}.self_attention.{megatron}.weight",
        (f"model.layers.{{layer}}.self_attn.{hf}.weight",),
        shard=shard,  # type: ignore[arg-type]
    )


MLA_RULES: tuple[Rule, ...] = (
    _attn("linear_q_proj", "q_proj", "column"),  # q_lora_rank = None
    _attn("linear_q_down_proj", "q_a_proj", "column"),
    _attn("q_layernorm", "q_a_layernorm"),
    _attn("linear_q_up_proj", "q_b_proj", "column"),
    _attn("linear_kv_down_proj", "kv_a_proj_with_mqa", "column"),
    _attn("kv_layernorm", "kv_a_layernorm"),
    _attn("linear_kv_up_proj", "kv_b_proj", "column"),
)

SHARED_EXPERT_RULES: tuple[Rule, ...] = (
    Rule(
        "decoder.layers.{layer}.mlp.router.expert_bias",
        ("model.layers.{layer}.mlp.gate.e_score_correction_bias",),
    ),
    Rule(
        "decoder.layers.{layer}.mlp.shared_experts.linear_fc1.weight",
        (
            "model.layers.{layer}.mlp.shared_experts.gate_proj.weight",
            "model.layers.{layer}.mlp.shared_experts.up_proj.weight",
        ),
        "glu",
        "column_glu",
    ),
    Rule(
        "decoder.layers.{layer}.mlp.shared_experts.linear_fc2.weight",
        ("model.layers.{layer}.mlp.shared_experts.down_proj.weight",),
        shard="row",
    ),
)

RULES: tuple[Rule, ...] = (
    COMMON_RULES + MLA_RULES + DENSE_MLP_RULES + ROUTED_EXPERT_RULES + SHARED_EXPERT_RULES
)
