"""GLM-5 (``glm_moe_dsa``) as a megatron-core GPTModel: MLA with DeepSeek sparse attention, MoE.

Every layer's attention is megatron-core's absorbed MLA with ``DSAttention`` as its core: a lightning
indexer (its own query/key projections, a LayerNorm on the key, per-head weights, interleaved RoPE) scores
the previous tokens and attention runs over the top ``index_topk`` of them. The first
``first_k_dense_replace`` layers have a dense MLP, the others routed experts (sigmoid scores plus a bias
for aux-loss-free balancing, top-k renormalised, scaled by ``routed_scaling_factor``) and a shared expert.

What megatron-core 0.19 does not give here (docs/presets.md): the multi-token-prediction layers are not
built (RL does not train them; transformers drops them too), the indexer is frozen (its top-k choice has
no gradient and its KL training loss is off), and tensor parallelism needs Transformer Engine (as for
DeepSeek-V3's MLA).

The specs are megatron-core's local modules: the DSA spec helper takes a backend, and Transformer
Engine's ``duplicated`` linear (every TP rank holds the indexer's projections) is replaced by
:class:`DuplicatedLinear`.
"""

from __future__ import annotations

from typing import Any

import torch

from tidal.model_config import ModelConfig

# transformers' GLM-5 builds the indexer key's LayerNorm with eps 1e-6, not rms_norm_eps
INDEXER_K_NORM_EPS = 1e-6


def fields(m: ModelConfig) -> dict[str, Any]:
    from tidal.trainer.models import _deepseek_v3

    return _deepseek_v3(m) | dict(
        moe_router_topk_scaling_factor=m.routed_scaling_factor,
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=m.index_n_heads,
        dsa_indexer_head_dim=m.index_head_dim,
        dsa_indexer_topk=m.index_topk,
        dsa_indexer_rotate_activation=False,  # GLM-5's indexer has no Hadamard rotation
        dsa_indexer_rope_interleaved=True,
        dsa_indexer_k_norm_epsilon=INDEXER_K_NORM_EPS,
        cp_comm_type="all_gather",  # the only context-parallel scheme DSAttention supports
    )


def check_trainable(m: ModelConfig, mesh, training: bool) -> None:
    from tidal.trainer.models import te_available

    if not m.q_lora_rank:
        raise ValueError(
            "model.q_lora_rank must be set for family glm_moe_dsa (the DSA indexer reads the query latent)"
        )
    if training and mesh.tp > 1 and not te_available():
        raise ValueError(
            f"model.family=glm_moe_dsa with tp={mesh.tp} needs Transformer Engine: megatron-core 0.19's local MLA "
            "path does not sum the rotary key's gradient over TP (as for deepseek_v3); use tp=1 with ep/pp/cp/dp "
            "(the preset's mesh: PP8 x EP8 x CP8)"
        )


class DuplicatedLinear(torch.nn.Module):
    """A linear layer that every tensor-parallel rank holds in full (Transformer Engine's
    ``parallel_mode="duplicated"``); returns ``(output, bias)`` like megatron's linear layers."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        bias: bool = False,
        skip_bias_add: bool = False,
        **unused,
    ):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype)) if bias else None
        self.skip_bias_add = skip_bias_add

    def forward(self, x: torch.Tensor):
        if self.skip_bias_add:
            return torch.nn.functional.linear(x, self.weight), self.bias
        return torch.nn.functional.linear(x, self.weight, self.bias), None


def block_spec(tconfig, vp_stage: int | None = None):
    """This pipeline stage's decoder block spec: absorbed MLA + DSA everywhere, dense then MoE MLPs."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsa_module_spec_for_backend,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from tidal.trainer.models import LatentRMSNorm, RMSNorm, _local_layer_spec

    class Backend(LocalSpecProvider):
        def linear(self):
            return DuplicatedLinear

    attention = get_dsa_module_spec_for_backend(tconfig, backend=Backend())
    # the local MLA spec's down projections (column-parallel, gathered before the latent norms)
    attention.submodules.linear_q_down_proj = ColumnParallelLinear
    attention.submodules.linear_kv_down_proj = ColumnParallelLinear
    attention.submodules.q_layernorm = attention.submodules.kv_layernorm = LatentRMSNorm
    layers = []
    for is_moe in tconfig.moe_layer_freq:
        layer = _local_layer_spec(
            get_gpt_layer_local_spec(
                num_experts=tconfig.num_moe_experts if is_moe else None,
                moe_grouped_gemm=False,
                qk_layernorm=True,
                multi_latent_attention=True,
                normalization="RMSNorm",
            )
        )
        layer.submodules.self_attention = attention
        layers.append(layer)
    offset = get_transformer_layer_offset(tconfig, vp_stage=vp_stage)
    count = get_num_layers_to_build(tconfig, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=layers[offset : offset + count], layer_norm=RMSNorm)
