"""Small random models of each family, saved as Hugging Face directories (tests and benchmarks)."""

from __future__ import annotations

from pathlib import Path

import torch

from tidal.model_config import ModelConfig

_SHAPES = dict(
    vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
)

TINY: dict[str, ModelConfig] = {
    "qwen3": ModelConfig(family="qwen3", head_dim=16, intermediate_size=96, **_SHAPES),
    "qwen3_moe": ModelConfig(
        family="qwen3_moe",
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        **_SHAPES,
    ),
    "deepseek_v3": ModelConfig(  # MLA: transformers repeats K/V by heads // kv_heads, so kv_heads = heads
        family="deepseek_v3",
        head_dim=24,
        intermediate_size=96,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        **(_SHAPES | {"num_key_value_heads": 4}),
    ),
}


def save_random_hf(model: ModelConfig, directory: str | Path, seed: int = 0) -> Path:
    """A randomly initialised transformers model of ``model``, saved with ``save_pretrained``.

    Every tensor (norms and biases too) is re-drawn so that a layout mistake cannot hide behind ones or
    zeros.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = model.to_hf_config()
    if model.family == "deepseek_v3":
        # transformers' DeepSeek-V3 takes head_dim as the rotary width (ModelConfig writes nope + rope)
        config.head_dim = model.qk_rope_head_dim
    hf = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.05)
        for name, b in hf.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.05)
    hf.save_pretrained(directory)
    return Path(directory)


def megatron_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) megatron-core tensor shapes of a dense qwen3 ``model`` (the benchmarks' stand-in state)."""
    h, hd = model.hidden_size, model.head_dim
    qkv_rows = hd * (model.num_attention_heads + 2 * model.num_key_value_heads)
    shapes = {
        "embedding.word_embeddings.weight": (model.vocab_size, h),
        "output_layer.weight": (model.vocab_size, h),
        "decoder.final_layernorm.weight": (h,),
    }
    for i in range(model.num_hidden_layers):
        p = f"decoder.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attention.linear_qkv.weight": (qkv_rows, h),
            p + "self_attention.q_layernorm.weight": (hd,),
            p + "self_attention.k_layernorm.weight": (hd,),
            p + "self_attention.linear_proj.weight": (h, hd * model.num_attention_heads),
            p + "pre_mlp_layernorm.weight": (h,),
            p + "mlp.linear_fc1.weight": (2 * model.intermediate_size, h),
            p + "mlp.linear_fc2.weight": (h, model.intermediate_size),
        }
    return shapes
