"""The model architecture, described once and shared by trainer, engine and weight sync.

Field names follow Hugging Face's config.json so that a real checkpoint's config loads as is and a tiny
model built from YAML exports as a normal Hugging Face directory. ``family`` selects the
megatron-core builder, the embedded engine's model class and the weight mapping.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Family = Literal["qwen3", "qwen3_moe", "deepseek_v3"]

# Hugging Face ``model_type`` for each family.
HF_MODEL_TYPE: dict[str, str] = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3"}


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    family: Family = "qwen3"
    path: str | None = Field(None, description="Hugging Face model directory; when set, its config.json wins")
    vocab_size: int = Field(512, gt=0)
    hidden_size: int = Field(128, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    head_dim: int = Field(32, gt=0)
    intermediate_size: int = Field(256, gt=0, description="dense MLP width")
    max_position_embeddings: int = Field(2048, gt=0)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    # MoE (qwen3_moe, deepseek_v3)
    num_experts: int = Field(0, ge=0, description="routed experts; 0 for dense")
    num_experts_per_tok: int = Field(0, ge=0)
    moe_intermediate_size: int = Field(0, ge=0)
    norm_topk_prob: bool = True
    n_shared_experts: int = Field(0, ge=0)
    first_k_dense_replace: int = Field(0, ge=0, description="leading dense layers (deepseek_v3)")
    # MLA (deepseek_v3)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"model.num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )
        if self.family in ("qwen3_moe", "deepseek_v3"):
            if self.num_experts <= 0 or not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"model.family={self.family} needs 0 < num_experts_per_tok <= num_experts, got "
                    f"num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError(
                    f"model.moe_intermediate_size={self.moe_intermediate_size} must be > 0 for MoE"
                )
        if self.family == "deepseek_v3" and (self.kv_lora_rank <= 0 or self.qk_rope_head_dim <= 0):
            raise ValueError("model.family=deepseek_v3 needs kv_lora_rank > 0 and qk_rope_head_dim > 0 (MLA)")
        return self

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def resolved(self) -> ModelConfig:
        """This config with the fields of ``path``'s config.json applied, if a path is given."""
        if not self.path:
            return self
        hf = json.loads((Path(self.path) / "config.json").read_text())
        return ModelConfig.from_hf_dict(hf, path=self.path)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], path: str | None = None) -> ModelConfig:
        family = {v: k for k, v in HF_MODEL_TYPE.items()}.get(hf.get("model_type", ""))
        if family is None:
            raise ValueError(
                f"model.path={path}: model_type={hf.get('model_type')!r} is not supported "
                f"(supported: {sorted(HF_MODEL_TYPE.values())})"
            )
        known = set(cls.model_fields) - {"family", "path"}
        fields = {k: v for k, v in hf.items() if k in known and v is not None}
        if family == "qwen3_moe":
            fields["num_experts"] = hf.get("num_experts", 0)
        if family == "deepseek_v3":
            fields["num_experts"] = hf.get("n_routed_experts", 0)
            fields.setdefault("head_dim", hf.get("qk_nope_head_dim", 0) + hf.get("qk_rope_head_dim", 0))
        return cls(family=family, path=path, **fields)

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face config.json for this architecture."""
        d: dict[str, Any] = {
            "model_type": HF_MODEL_TYPE[self.family],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "torch_dtype": "float32",
        }
        if self.family == "qwen3_moe":
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                output_router_logits=False,
            )
        if self.family == "deepseek_v3":
            d.update(
                n_routed_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                n_shared_experts=self.n_shared_experts,
                first_k_dense_replace=self.first_k_dense_replace,
                norm_topk_prob=self.norm_topk_prob,
                q_lora_rank=self.q_lora_rank,
                kv_lora_rank=self.kv_lora_rank,
                qk_nope_head_dim=self.qk_nope_head_dim,
                qk_rope_head_dim=self.qk_rope_head_dim,
                v_head_dim=self.v_head_dim,
                n_group=1,
                topk_group=1,
                routed_scaling_factor=1.0,
                scoring_func="sigmoid",
                topk_method="noaux_tc",
                rope_scaling=None,
            )
        return d

    def to_hf_config(self):
        """The transformers ``PretrainedConfig`` for this architecture."""
        from transformers import AutoConfig

        d = self.to_hf_dict()
        return AutoConfig.for_model(d.pop("model_type"), **d)
