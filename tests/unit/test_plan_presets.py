"""Every preset loads, plans to a legal mesh that fits, and describes the published model."""

from pathlib import Path

import pytest

from tidal.cli import main as cli_main
from tidal.config import RunConfig
from tidal.configio import load_config
from tidal.memory_model import total_params

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PRESETS = sorted(p for p in CONFIGS.glob("*.yaml") if p.name != "tiny.yaml")
TINY = sorted((CONFIGS / "tiny").glob("*.yaml"))

# Published total sizes (model cards), written with the significant digits they are published with.
PUBLISHED_TOTAL = {
    "deepseek_v4_flash": "284B",
    "deepseek_v4_pro": "1.6T",
    "kimi_k2_6": "1T",
    "glm_5_1": "744B",
    "qwen3_5_35b_a3b": "35B",
}
# The trainer meshes: (world, tp, pp, cp, ep, etp)
MESHES = {
    "deepseek_v4_flash": (128, 1, 4, 4, 8, 1),
    "deepseek_v4_pro": (512, 1, 8, 4, 16, 1),
    "kimi_k2_6": (256, 1, 8, 8, 8, 1),
    "glm_5_1": (256, 1, 8, 8, 8, 1),
    "qwen3_5_35b_a3b": (8, 1, 1, 8, 8, 1),
}


def test_there_is_a_preset_and_a_tiny_variant_for_each_seed_model():
    assert {p.stem for p in PRESETS} == set(PUBLISHED_TOTAL)
    assert {p.stem for p in TINY} == set(PUBLISHED_TOTAL)


@pytest.mark.parametrize("path", PRESETS + TINY, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_plan_prints_a_legal_mesh_and_a_memory_estimate(path, capsys):
    assert cli_main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ngpu / pp = tp * cp * dp = etp * ep * edp" in out
    assert "layers per stage" in out and "experts per rank" in out
    assert "verdict: fits" in out


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_mesh_algorithm_and_engine(path):
    cfg = load_config(RunConfig, path)
    world, tp, pp, cp, ep, etp = MESHES[path.stem]
    mesh = cfg.trainer.mesh
    assert cfg.trainer.nproc * cfg.trainer.nnodes == world
    assert (mesh.tp, mesh.pp, mesh.cp, mesh.ep, mesh.etp) == (tp, pp, cp, ep, etp)
    assert cfg.trainer.optimizer.kind == "fsdp2"
    loss = cfg.trainer.loss
    assert (loss.clip_ratio_low, loss.clip_ratio_high, loss.clip_ratio_c) == (0.2, 0.28, 10.0)
    assert loss.agg == "token-mean" and loss.tis != "off"
    assert cfg.rollout.engine.type == "sglang"


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_size_rounds_to_the_published_size(path):
    published = PUBLISHED_TOTAL[path.stem]
    scale = {"B": 1e9, "T": 1e12}[published[-1]]
    digits = len(published[:-1].replace(".", ""))
    total = total_params(load_config(RunConfig, path).model)[0] / scale
    assert float(f"{total:.{digits}g}") == float(published[:-1]), (total, published)


@pytest.mark.parametrize("path", PRESETS + TINY, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_tidal_config_prints_the_preset(path, capsys):
    assert cli_main(["config", str(path)]) == 0
    assert f"family: {load_config(RunConfig, path).model.family}" in capsys.readouterr().out


def test_tiny_variant_keeps_the_preset_layer_kinds():
    for tiny in TINY:
        small = load_config(RunConfig, tiny).model
        big = load_config(RunConfig, CONFIGS / tiny.name).model
        assert small.family == big.family
        kinds = lambda m: {m.attention_kind(i) for i in range(m.num_hidden_layers)}  # noqa: E731
        assert kinds(small) == kinds(big), tiny.stem
        assert (small.first_k_dense_replace > 0) == (big.first_k_dense_replace > 0)
        assert (small.num_hash_layers > 0) == (big.num_hash_layers > 0)
        assert small.hidden_size <= 128 and small.num_experts <= 16


# The published config.json of DeepSeek-V4 Flash and Pro (deepseek-ai/DeepSeek-V4-{Flash,Pro}), less the
# quantization block: loading it must give the preset's architecture field for field.
V4_COMMON = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hc_eps": 1e-06,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 512,
    "hidden_act": "silu",
    "index_head_dim": 128,
    "index_n_heads": 64,
    "initializer_range": 0.02,
    "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4",
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_experts_per_tok": 6,
    "num_hash_layers": 3,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 128,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 129280,
    "compress_rope_theta": 160000,
}
V4_HF = {
    "deepseek_v4_flash": V4_COMMON
    | {
        "expert_dtype": "fp4",
        "hidden_size": 4096,
        "index_topk": 512,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "num_attention_heads": 64,
        "num_hidden_layers": 43,
        "o_groups": 8,
        "q_lora_rank": 1024,
        "routed_scaling_factor": 1.5,
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    },
    "deepseek_v4_pro": V4_COMMON
    | {
        "hidden_size": 7168,
        "index_topk": 1024,
        "moe_intermediate_size": 3072,
        "n_routed_experts": 384,
        "num_attention_heads": 128,
        "num_hidden_layers": 61,
        "o_groups": 16,
        "q_lora_rank": 1536,
        "routed_scaling_factor": 2.5,
        "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0],
    },
}


@pytest.mark.parametrize("name", sorted(V4_HF))
def test_published_deepseek_v4_config_loads_as_the_preset(name):
    from tidal.model_config import ModelConfig

    preset = load_config(RunConfig, CONFIGS / f"{name}.yaml").model
    assert ModelConfig.from_hf_dict(V4_HF[name]) == preset


# Multimodal checkpoints nest the text model's config: Qwen3.5 (model_type qwen3_5_moe) and Kimi K2.6
# (kimi_k25 around a kimi_k2 text_config). The fields are those of the public config.json copies.
WRAPPED_HF = {
    "qwen3_5_35b_a3b": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_moe_text",
            "num_hidden_layers": 40,
            "full_attention_interval": 4,
            "hidden_size": 2048,
            "vocab_size": 248320,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "attn_output_gate": True,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "rms_norm_eps": 1e-6,
            "mtp_num_hidden_layers": 1,
            "max_position_embeddings": 262144,
            "rope_parameters": {
                "rope_theta": 10000000,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
                "partial_rotary_factor": 0.25,
            },
        },
    },
    "kimi_k2_6": {
        "model_type": "kimi_k25",
        "text_config": {
            "model_type": "kimi_k2",
            "vocab_size": 163840,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "num_attention_heads": 64,
            "num_key_value_heads": 64,
            "n_shared_experts": 1,
            "n_routed_experts": 384,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.827,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "norm_topk_prob": True,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-5,
            "rope_theta": 50000.0,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "n_group": 1,
            "topk_group": 1,
        },
    },
}


@pytest.mark.parametrize("name", sorted(WRAPPED_HF))
def test_nested_text_config_loads_as_the_preset(name):
    from tidal.model_config import ModelConfig

    preset = load_config(RunConfig, CONFIGS / f"{name}.yaml").model
    assert ModelConfig.from_hf_dict(WRAPPED_HF[name]) == preset
