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

Family = Literal["qwen3", "qwen3_moe", "deepseek_v3", "qwen3_5_moe", "glm_moe_dsa", "deepseek_v4"]

# Hugging Face ``model_type`` for each family.
HF_MODEL_TYPE: dict[str, str] = {
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "deepseek_v3": "deepseek_v3",
    # Qwen3.5's text model; checkpoints wrap it as model_type qwen3_5_moe with a text_config.
    "qwen3_5_moe": "qwen3_5_moe_text",
    "glm_moe_dsa": "glm_moe_dsa",
    "deepseek_v4": "deepseek_v4",
}
# Other ``model_type`` values that load as a family (Kimi K2.x is the DeepSeek-V3 architecture).
HF_MODEL_TYPE_ALIASES: dict[str, str] = {
    "qwen3_5_moe": "qwen3_5_moe",
    "kimi_k2": "deepseek_v3",
    "kimi_k25": "deepseek_v3",
}
MOE_FAMILIES = ("qwen3_moe", "deepseek_v3", "qwen3_5_moe", "glm_moe_dsa", "deepseek_v4")
MLA_FAMILIES = ("deepseek_v3", "glm_moe_dsa")


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
    routed_scaling_factor: float = Field(1.0, gt=0, description="scale of the routed experts' weights")
    num_nextn_predict_layers: int = Field(0, ge=0, description="multi-token-prediction layers (MTP)")
    # Qwen3.5 hybrid attention (qwen3_5_moe): Gated DeltaNet layers, every k-th layer full attention
    full_attention_interval: int = Field(1, ge=1, description="layer i is full attention when (i+1) % k == 0")
    linear_num_key_heads: int = Field(0, ge=0)
    linear_num_value_heads: int = Field(0, ge=0)
    linear_key_head_dim: int = Field(0, ge=0)
    linear_value_head_dim: int = Field(0, ge=0)
    linear_conv_kernel_dim: int = Field(4, ge=1)
    attn_output_gate: bool = Field(False, description="sigmoid gate on the attention output (qwen3_5_moe)")
    partial_rotary_factor: float = Field(1.0, gt=0, le=1)
    shared_expert_intermediate_size: int = Field(0, ge=0, description="qwen3_5_moe's shared expert width")
    # DeepSeek sparse attention indexer (glm_moe_dsa; deepseek_v4 on its ratio-4 layers)
    index_n_heads: int = Field(0, ge=0)
    index_head_dim: int = Field(0, ge=0)
    index_topk: int = Field(0, ge=0)
    # DeepSeek-V4: hyper-connections, compressed sparse attention, grouped output projection, hash routing
    o_groups: int = Field(0, ge=0)
    o_lora_rank: int = Field(0, ge=0)
    sliding_window: int = Field(0, ge=0)
    compress_ratios: list[int] = Field(
        default_factory=list,
        description="per layer: 0 sliding window only, 4 CSA, 128 HCA (MTP entries after)",
    )
    hc_mult: int = Field(0, ge=0, description="hyper-connection streams; 0: plain residual")
    num_hash_layers: int = Field(0, ge=0, description="leading layers routed by a token-id hash")

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"model.num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )
        if self.family in MOE_FAMILIES:
            if self.num_experts <= 0 or not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"model.family={self.family} needs 0 < num_experts_per_tok <= num_experts, got "
                    f"num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError(
                    f"model.moe_intermediate_size={self.moe_intermediate_size} must be > 0 for MoE"
                )
        if self.family in MLA_FAMILIES and (self.kv_lora_rank <= 0 or self.qk_rope_head_dim <= 0):
            raise ValueError(
                f"model.family={self.family} needs kv_lora_rank > 0 and qk_rope_head_dim > 0 (MLA)"
            )
        self._check_new_families()
        return self

    def _check_new_families(self) -> None:
        def need(condition: bool, what: str) -> None:
            if not condition:
                raise ValueError(f"model.family={self.family} needs {what}")

        if self.family == "qwen3_5_moe":
            need(
                min(self.linear_num_key_heads, self.linear_num_value_heads) > 0
                and min(self.linear_key_head_dim, self.linear_value_head_dim) > 0,
                "linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim > 0 "
                "(Gated DeltaNet layers)",
            )
            need(
                self.linear_num_value_heads % self.linear_num_key_heads == 0,
                f"linear_num_value_heads={self.linear_num_value_heads} to be a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}",
            )
        if self.family == "glm_moe_dsa":
            need(
                min(self.index_n_heads, self.index_head_dim, self.index_topk) > 0, "index_* > 0 (DSA indexer)"
            )
        if self.family == "deepseek_v4":
            need(self.q_lora_rank is not None and self.q_lora_rank > 0, "q_lora_rank > 0")
            need(
                self.o_groups > 0 and self.o_lora_rank > 0 and self.num_attention_heads % self.o_groups == 0,
                f"o_groups > 0 dividing num_attention_heads={self.num_attention_heads} and o_lora_rank > 0",
            )
            need(self.hc_mult > 0, "hc_mult > 0 (hyper-connections)")
            need(0 < self.qk_rope_head_dim <= self.head_dim, "0 < qk_rope_head_dim <= head_dim")
            need(
                len(self.compress_ratios) >= self.num_hidden_layers
                and set(self.compress_ratios) <= {0, 4, 128},
                f"compress_ratios with one entry per layer ({self.num_hidden_layers}), each 0, 4 or 128",
            )
            if 4 in self.compress_ratios[: self.num_hidden_layers]:
                need(
                    min(self.index_n_heads, self.index_head_dim, self.index_topk) > 0,
                    "index_* > 0 (CSA indexer)",
                )

    def attention_kind(self, layer: int) -> str:
        """The attention block of a layer: gqa, gated_gqa, gdn, mla, mla_dsa, or v4_r0 / v4_r4 / v4_r128."""
        if self.family == "qwen3_5_moe":
            return "gated_gqa" if (layer + 1) % self.full_attention_interval == 0 else "gdn"
        if self.family == "glm_moe_dsa":
            return "mla_dsa"
        if self.family == "deepseek_v4":
            return f"v4_r{self.compress_ratios[layer]}"
        return "mla" if self.family == "deepseek_v3" else "gqa"

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.first_k_dense_replace

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def resolved(self) -> ModelConfig:
        """This config with the fields of ``path``'s config.json applied, if a path is given."""
        if not self.path:
            return self
        path = Path(self.path) / "config.json"
        try:
            hf = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(
                f"model.path={self.path}: no config.json there; give a Hugging Face model directory"
            ) from None
        except (OSError, ValueError) as exc:
            raise ValueError(f"model.path={self.path}: {path} does not read as JSON ({exc})") from None
        return ModelConfig.from_hf_dict(hf, path=self.path)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], path: str | None = None) -> ModelConfig:
        families = {v: k for k, v in HF_MODEL_TYPE.items()} | HF_MODEL_TYPE_ALIASES
        family = families.get(hf.get("model_type", ""))
        if family is None:
            raise ValueError(
                f"model.path={path}: model_type={hf.get('model_type')!r} is not supported "
                f"(supported: {sorted(families)})"
            )
        if isinstance(hf.get("text_config"), dict):  # multimodal wrappers (Qwen3.5, Kimi K2.5/K2.6)
            hf = {**hf["text_config"], "tie_word_embeddings": hf.get("tie_word_embeddings", False)}
        known = set(cls.model_fields) - {"family", "path"}
        fields = {k: v for k, v in hf.items() if k in known and v is not None}
        # transformers 5 writes rope_theta inside rope_parameters and qwen3_moe's num_experts as num_local_experts
        rope = hf.get("rope_parameters") or {}
        if "rope_theta" not in fields and "rope_theta" in rope:
            fields["rope_theta"] = rope["rope_theta"]
        if family == "qwen3_moe":
            fields["num_experts"] = hf.get("num_experts", hf.get("num_local_experts", 0))
        if family in ("deepseek_v3", "glm_moe_dsa", "deepseek_v4"):
            fields["num_experts"] = hf.get("n_routed_experts", 0)
        # transformers writes MLA's rotary width as head_dim; ModelConfig's head_dim is nope + rope
        if family in MLA_FAMILIES:
            fields["head_dim"] = hf.get("qk_nope_head_dim", 0) + hf.get("qk_rope_head_dim", 0)
        if family == "qwen3_5_moe":
            fields["num_experts"] = hf.get("num_experts", 0)
            fields["num_nextn_predict_layers"] = hf.get("mtp_num_hidden_layers", 0)
            rope = hf.get("rope_parameters") or {}
            for key in ("rope_theta", "partial_rotary_factor"):
                if key in rope:
                    fields[key] = rope[key]
            # transformers saves the layer pattern as layer_types, not full_attention_interval
            layer_types = hf.get("layer_types")
            if "full_attention_interval" not in fields and layer_types and "full_attention" in layer_types:
                fields["full_attention_interval"] = layer_types.index("full_attention") + 1
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
        if self.family == "deepseek_v3":
            # transformers' MLA reads head_dim as the rotary width and has no grouped K/V heads
            d["head_dim"] = self.qk_rope_head_dim
            d["num_key_value_heads"] = self.num_attention_heads
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
                routed_scaling_factor=self.routed_scaling_factor,
                num_nextn_predict_layers=self.num_nextn_predict_layers,  # transformers' default is 1
                scoring_func="sigmoid",
                topk_method="noaux_tc",
                rope_scaling=None,
            )
        if self.family in ("qwen3_5_moe", "glm_moe_dsa", "deepseek_v4"):
            d.update(self._new_family_hf_fields())
        if self.family == "deepseek_v4":
            del d["intermediate_size"]  # transformers maps it onto moe_intermediate_size
        return d

    def _new_family_hf_fields(self) -> dict[str, Any]:
        moe = {
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
        }
        if self.family == "qwen3_5_moe":
            return moe | {
                "num_experts": self.num_experts,
                "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                "full_attention_interval": self.full_attention_interval,
                "linear_num_key_heads": self.linear_num_key_heads,
                "linear_num_value_heads": self.linear_num_value_heads,
                "linear_key_head_dim": self.linear_key_head_dim,
                "linear_value_head_dim": self.linear_value_head_dim,
                "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
                "attn_output_gate": self.attn_output_gate,
                "mtp_num_hidden_layers": self.num_nextn_predict_layers,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": self.rope_theta,
                    "partial_rotary_factor": self.partial_rotary_factor,
                },
            }
        shared = moe | {
            "n_routed_experts": self.num_experts,
            "n_shared_experts": self.n_shared_experts,
            "routed_scaling_factor": self.routed_scaling_factor,
            "q_lora_rank": self.q_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
        }
        if self.family == "glm_moe_dsa":
            return shared | {
                "first_k_dense_replace": self.first_k_dense_replace,
                "kv_lora_rank": self.kv_lora_rank,
                "qk_nope_head_dim": self.qk_nope_head_dim,
                "v_head_dim": self.v_head_dim,
                "n_group": 1,
                "topk_group": 1,
            }
        return shared | {
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window,
            "compress_ratios": list(self.compress_ratios),
            "hc_mult": self.hc_mult,
            "num_hash_layers": self.num_hash_layers,
            "scoring_func": "sqrtsoftplus",
        }

    def to_hf_config(self):
        """The transformers ``PretrainedConfig`` for this architecture."""
        from transformers import AutoConfig

        d = self.to_hf_dict()
        return AutoConfig.for_model(d.pop("model_type"), **d)


def has_hf_weights(directory: str | Path) -> bool:
    """Whether ``directory`` holds a Hugging Face model's safetensors weights (one file, or shards and index)."""
    d = Path(directory)
    return (d / "model.safetensors").exists() or (d / "model.safetensors.index.json").exists()
