"""Qwen3.5 (``qwen3_5_moe``) as a megatron-core GPTModel: Gated DeltaNet and gated full attention, MoE.

Layer ``i`` mixes tokens with a Gated DeltaNet (megatron-core's ``GatedDeltaNet``, flash-linear-attention
kernels) unless ``(i + 1) % full_attention_interval == 0``, where it has softmax attention with a sigmoid
output gate, per-head zero-centred q/k norms and partial rotary embedding. Every layer's MLP is MoE:
routed experts (softmax, top-k renormalised) plus one shared expert scaled by a sigmoid gate.

The specs are megatron-core's local modules (tidal's packed core attention, the norms of ``norms.py``),
on CPU and GPU alike; megatron's experimental-variant spec helpers require Transformer Engine.
Multi-token-prediction layers are not built (RL does not train them; transformers drops them too).
"""

from __future__ import annotations

import copy
import zlib
from typing import Any

import torch

from tidal.model_config import ModelConfig
from tidal.trainer.families.norms import PlainRMSNorm, ZeroCenteredQKNorm, ZeroCenteredRMSNorm

# transformers' Qwen3.5 draws A from uniform(0.01, 16) and keeps log(A); dt_bias starts at one
A_INIT_RANGE = (0.01, 16.0)


def fields(m: ModelConfig) -> dict[str, Any]:
    """TransformerConfig fields of this family (on top of the common ones)."""
    from tidal.trainer.models import _moe_fields

    return dict(
        **_moe_fields(m),
        qk_layernorm=True,
        attention_output_gate=m.attn_output_gate,
        moe_router_pre_softmax=False,  # top-k of the logits, softmax over them == softmax, top-k, renormalise
        moe_shared_expert_intermediate_size=m.shared_expert_intermediate_size or None,
        moe_shared_expert_gate=m.shared_expert_intermediate_size > 0,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=m.full_attention_interval,
        linear_conv_kernel_dim=m.linear_conv_kernel_dim,
        linear_key_head_dim=m.linear_key_head_dim,
        linear_value_head_dim=m.linear_value_head_dim,
        linear_num_key_heads=m.linear_num_key_heads,
        linear_num_value_heads=m.linear_num_value_heads,
    )


def check_trainable(m: ModelConfig, mesh, training: bool) -> None:
    """Refuse, with the reason and what to do, what this family cannot run here."""
    from tidal.trainer import cpu_support

    if mesh.tp > 1:
        raise ValueError(
            f"model.family=qwen3_5_moe with tp={mesh.tp}: tidal's weight mapping does not yet split the Gated "
            "DeltaNet's fused in_proj (q, k, v, z, beta, alpha sections) over tensor parallelism; use tp=1 "
            "with ep/cp/pp/dp (the preset's mesh: EP8 x CP8)"
        )
    on_cpu = not torch.cuda.is_available() or cpu_support.enabled()
    if training and on_cpu:
        raise ValueError(
            "model.family=qwen3_5_moe cannot train on CPU: its Gated DeltaNet layers run "
            "flash-linear-attention's Triton kernels (chunked gated delta rule on packed sequences), which "
            "have no CPU path; run it on a CUDA GPU (device: cuda) with flash-linear-attention installed "
            "(pip install 'tidal-rl[gpu]' or the fla-core wheel)"
        )
    from megatron.core.ssm.gated_delta_net import common

    if not common.HAVE_FLA:
        raise ValueError(
            "model.family=qwen3_5_moe needs flash-linear-attention (import fla failed): megatron-core's "
            "GatedDeltaNet is built on its kernels; install it (pip install fla-core, or the gpu extra)"
        )


def block_spec(tconfig, vp_stage: int | None = None):
    """This pipeline stage's decoder block spec: GDN or gated attention per layer, MoE everywhere."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_linear_attention_pattern,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from tidal.trainer.models import _local_layer_spec

    attention_layer = _local_layer_spec(
        get_gpt_layer_local_spec(
            num_experts=tconfig.num_moe_experts,
            moe_grouped_gemm=False,
            qk_layernorm=True,
            normalization="RMSNorm",
        )
    )
    attention_layer.submodules.input_layernorm = ZeroCenteredRMSNorm
    attention_layer.submodules.pre_mlp_layernorm = ZeroCenteredRMSNorm
    attention = attention_layer.submodules.self_attention.submodules
    attention.q_layernorm = ZeroCenteredQKNorm
    attention.k_layernorm = ZeroCenteredQKNorm

    gdn_layer = copy.deepcopy(attention_layer)
    gdn_layer.submodules.self_attention = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=PlainRMSNorm, out_proj=RowParallelLinear
        ),
    )
    pattern = get_linear_attention_pattern(tconfig)  # 1: Gated DeltaNet, 0: full attention
    layers = [gdn_layer if kind == 1 else attention_layer for kind in pattern]
    offset = get_transformer_layer_offset(tconfig, vp_stage=vp_stage)
    count = get_num_layers_to_build(tconfig, vp_stage=vp_stage)
    return TransformerBlockSubmodules(
        layer_specs=layers[offset : offset + count], layer_norm=ZeroCenteredRMSNorm
    )


@torch.no_grad()
def init_extra(chunks: list[torch.nn.Module], tconfig, seed: int) -> None:
    """Seed the Gated DeltaNet's decay parameters (1-D, so the generic initialiser leaves them unset)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from tidal.trainer.models import global_param_name

    for stage, chunk in enumerate(chunks):
        offset = get_transformer_layer_offset(tconfig, vp_stage=stage if len(chunks) > 1 else None)
        for local_name, param in chunk.named_parameters():
            name = global_param_name(local_name, offset, 0)
            if name.endswith(".self_attention.dt_bias"):
                param.fill_(1.0)
            elif name.endswith(".self_attention.A_log"):
                generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
                a = torch.empty(param.shape, dtype=torch.float32).uniform_(*A_INIT_RANGE, generator=generator)
                param.copy_(torch.log(a).to(param.dtype))


def install_kernels(chunks, kernels) -> None:
    from tidal.trainer.families import gated_delta_rule

    gated_delta_rule.install(chunks, kernels.gated_delta_rule)
