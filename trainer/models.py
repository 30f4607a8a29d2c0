"""megatron-core models from tidal's ModelConfig: TransformerConfig, layer specs, seeded initialisation.

Each family is a declarative table of TransformerConfig fields (``_FAMILY_FIELDS``). The model class is
``GPTModel`` (see docs/trainer.md, "Decisions"); layer specs come from megatron's Transformer Engine spec
when TE is importable and from its local spec otherwise, with :class:`PackedCoreAttention` as the core
attention of the local spec (packed THD sequences and context parallel on CPU).

Initialisation is mesh independent: every parameter's FULL tensor is drawn from a generator seeded by
(seed, the parameter's global name) and each rank keeps its own shard, so any mesh holds the same model
as world size 1. Global names undo pipeline layer offsets and expert-parallel numbering; shards follow
megatron's partition_dim (contiguous), except gated MLP ``linear_fc1`` whose shard is ``[gate_r; up_r]``.
"""

from __future__ import annotations

import copy
import functools
import math
import re
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tidal.model_config import ModelConfig
from tidal.trainer.mesh import MeshConfig

INIT_STD = 0.02
MLA_LATENT_NORM_EPS = 1e-6


def _common_fields(m: ModelConfig) -> dict[str, Any]:
    return dict(
        num_layers=m.num_hidden_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_key_value_heads,
        kv_channels=m.head_dim,
        ffn_hidden_size=m.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=m.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        rotary_interleaved=False,
        apply_rope_fusion=False,
        bias_activation_fusion=True,  # megatron's MLP then calls tidal.trainer.pointwise.bias_swiglu_impl
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        init_method_std=INIT_STD,
    )


def _moe_fields(m: ModelConfig) -> dict[str, Any]:
    return dict(
        num_moe_experts=m.num_experts,
        moe_router_topk=m.num_experts_per_tok,
        moe_ffn_hidden_size=m.moe_intermediate_size,
        moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none",
        moe_grouped_gemm=False,
        moe_router_dtype="fp32",
    )


def _qwen3(m: ModelConfig) -> dict[str, Any]:
    return dict(qk_layernorm=True)


def _qwen3_moe(m: ModelConfig) -> dict[str, Any]:
    # norm_topk_prob: softmax over the top-k logits (renormalised); otherwise softmax over all experts.
    return dict(qk_layernorm=True, **_moe_fields(m), moe_router_pre_softmax=not m.norm_topk_prob)


def _deepseek_v3(m: ModelConfig) -> dict[str, Any]:
    return dict(
        **_moe_fields(m),
        multi_latent_attention=True,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim,
        qk_pos_emb_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_type="rope",
        rotary_base=m.rope_theta,
        qk_layernorm=True,  # MLA's q_a / kv_a layernorms
        moe_layer_freq=[0] * m.first_k_dense_replace + [1] * (m.num_hidden_layers - m.first_k_dense_replace),
        moe_shared_expert_intermediate_size=(m.n_shared_experts * m.moe_intermediate_size) or None,
        moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=m.routed_scaling_factor,  # HF: top-k weights * routed_scaling_factor
        # aux-loss-free balancing: routing adds a per-expert bias (HF: e_score_correction_bias), which
        # megatron moves by the update rate after each optimizer step towards equal expert loads
        moe_router_enable_expert_bias=True,
    )


_FAMILY_FIELDS: dict[str, Callable[[ModelConfig], dict[str, Any]]] = {
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v3": _deepseek_v3,
}


def te_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_config(
    model: ModelConfig,
    mesh: MeshConfig,
    *,
    bf16: bool = False,
    deterministic: bool = False,
    moe_dispatcher: str = "alltoall",
    pipeline_dtype: torch.dtype | None = None,
    training: bool = True,
    expert_bias_update_rate: float = 1e-3,
):
    """megatron-core's TransformerConfig (MLATransformerConfig for MLA) for ``model`` on ``mesh``.

    ``training=False`` (conversion, export, inference) allows meshes whose forward pass is exact but whose
    gradients megatron-core computes wrongly without Transformer Engine (MLA with tp > 1).
    ``expert_bias_update_rate``: how far the router's expert bias moves per optimizer step (families with
    an expert bias: deepseek_v3).
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    model = model.resolved()
    if model.vocab_size % mesh.tp:
        raise ValueError(
            f"model.vocab_size={model.vocab_size} is not divisible by tp={mesh.tp}: tidal does not pad the "
            "vocabulary (padding would change the softmax); choose a tp that divides it"
        )
    if model.family == "deepseek_v3" and not model.q_lora_rank:
        raise ValueError(
            "model.q_lora_rank must be set for family deepseek_v3: megatron-core's local MLA spec needs the "
            "query low-rank projection (DeepSeek-V3, Kimi K2 and GLM all have one)"
        )
    if training and model.family == "deepseek_v3" and mesh.tp > 1 and not te_available():
        raise ValueError(
            "model.family=deepseek_v3 with tp>1 needs Transformer Engine: megatron-core 0.19's local MLA path "
            "(column-parallel down-projections) does not sum the rotary key's gradient over TP, so gradients "
            "come out wrong (measured ~1e-3 relative on CPU); use tp=1 with ep/pp/cp/dp, or a GPU with TE"
        )
    from tidal.trainer import families

    if families.handles(model.family):  # hybrid / experimental-attention families: trainer/families/
        fields = _common_fields(model) | families.fields(model, mesh, training)
    else:
        fields = _common_fields(model) | _FAMILY_FIELDS[model.family](model)
    sequence_parallel = mesh.sequence_parallel
    if sequence_parallel is None:
        sequence_parallel = mesh.tp > 1 and model.is_moe
    dtype = torch.bfloat16 if bf16 else torch.float32
    fields.update(
        tensor_model_parallel_size=mesh.tp,
        pipeline_model_parallel_size=mesh.pp,
        virtual_pipeline_model_parallel_size=mesh.vpp if mesh.vpp > 1 else None,
        context_parallel_size=mesh.cp,
        expert_model_parallel_size=mesh.ep,
        expert_tensor_parallel_size=mesh.etp,
        sequence_parallel=sequence_parallel and mesh.tp > 1,
        params_dtype=dtype,
        pipeline_dtype=pipeline_dtype or dtype,
        bf16=bf16,
        deterministic_mode=deterministic,
        calculate_per_token_loss=True,
        use_cpu_initialization=True,
        perform_initialization=False,  # init_weights() draws the mesh-independent initial model
    )
    if model.is_moe:
        fields["moe_token_dispatcher_type"] = moe_dispatcher
    if fields.get("moe_router_enable_expert_bias"):
        fields["moe_router_bias_update_rate"] = expert_bias_update_rate
    from tidal.trainer import cpu_support

    if cpu_support.enabled():
        # gloo matches point-to-point messages by (peer, tag) in posting order; megatron's batched p2p
        # posts both directions untagged, so with pp=2 (prev == next) an activation can meet a gradient's
        # receive. The unbatched path sends the two directions over two different groups.
        fields["batch_p2p_comm"] = False
    cls = MLATransformerConfig if fields.get("multi_latent_attention") else TransformerConfig
    tconfig = cls(**fields)
    tconfig.tidal_family = model.family  # read by layer_spec / build_model for trainer/families/
    return tconfig


class _RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, one compiled kernel forward and backward where ``trainer.kernels.pointwise`` says."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from tidal.trainer import pointwise

        return pointwise.rms_norm(x, self.weight, self.eps, super().forward)


class RMSNorm(_RMSNorm):
    """torch's RMSNorm with megatron's sequence-parallel marking (the local spec's norm refuses SP).

    Under sequence parallelism each TP rank normalises a different slice of the sequence, so the weight's
    gradient is partial; the ``sequence_parallel`` attribute makes megatron all-reduce it over TP.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


class QKRMSNorm(_RMSNorm):
    """Per-head query/key RMSNorm (after the sequence all-gather; megatron all-reduces it by name)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)


class LatentRMSNorm(_RMSNorm):
    """MLA's norm of the compressed query / key-value latent, which every TP rank holds in full.

    With sequence parallelism the latent is scattered over the sequence: each rank's gradient is partial and
    megatron must sum it over TP. Without, every rank computes the same full gradient (the up-projections
    all-reduce their input gradient); megatron's by-name rule would still sum ``q_layernorm`` (doubling it),
    so the weight asks for an average instead, which leaves identical values unchanged.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        # transformers' MLA (DeepSeek-V3, Kimi, GLM-5) builds these norms with eps 1e-6, not rms_norm_eps
        super().__init__(hidden_size, eps=MLA_LATENT_NORM_EPS, dtype=config.params_dtype)
        if config.sequence_parallel:
            self.weight.sequence_parallel = True
        else:
            self.weight.average_gradients_across_tp_domain = True


def _local_layer_spec(spec, kernels=None):
    """A copy of a local layer spec with tidal's core attention, experts and sequence-parallel-aware norms.

    ``kernels`` (:class:`~tidal.trainer.config.KernelConfig`, default ``auto`` everywhere) picks the core
    attention's kernel and the MoE experts module (docs/trainer.md, "Kernels").
    """
    from megatron.core.transformer.identity_op import IdentityOp

    from tidal.trainer.attention import core_attention_with_kernel
    from tidal.trainer.config import KernelConfig

    kernels = kernels or KernelConfig()
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = core_attention_with_kernel(kernels.attention)
    _use_grouped_experts(spec, kernels.experts)
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(spec.submodules, name) is not IdentityOp:
            setattr(spec.submodules, name, RMSNorm)
    attention = spec.submodules.self_attention.submodules
    mla = hasattr(attention, "kv_layernorm")
    for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):
        if getattr(attention, name, IdentityOp) is not IdentityOp:
            setattr(attention, name, LatentRMSNorm if mla else QKRMSNorm)
    return spec


def _use_grouped_experts(spec, kernel: str) -> None:
    """Swap megatron's SequentialMLP experts for :class:`GroupedExperts` (same parameters) in a layer spec."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from tidal.trainer.experts import GroupedExperts

    submodules = getattr(spec.submodules.mlp, "keywords", {}).get("submodules")  # partial(MoELayer, ...)
    experts = getattr(submodules, "experts", None)
    if (
        kernel == "sequential"
        or not isinstance(experts, functools.partial)
        or experts.func is not SequentialMLP
    ):
        return
    submodules.experts = functools.partial(GroupedExperts, *experts.args, **experts.keywords, kernel=kernel)


def layer_spec(tconfig, use_te: bool, vp_stage: int | None = None, kernels=None):
    """The decoder block spec of this rank's pipeline stage."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from tidal.trainer import families

    own = families.block_spec(tconfig, vp_stage)
    if own is not None:
        return own
    block = get_gpt_decoder_block_spec(
        tconfig, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
    )
    if not use_te:
        block.layer_specs = [_local_layer_spec(s, kernels) for s in block.layer_specs]
        block.layer_norm = RMSNorm
    return block


def build_model(
    model: ModelConfig,
    tconfig,
    seed: int = 0,
    use_te: bool | None = None,
    kernels=None,
) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), initialised from ``seed``.

    ``kernels``: :class:`~tidal.trainer.config.KernelConfig` (default: ``auto`` for every hot spot); kept
    on each chunk as ``tidal_kernels`` for the train step.

    Needs megatron's parallel state (:func:`tidal.trainer.parallel.init_parallel`).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    from tidal.trainer import families, finalize, moe_permute, pointwise, rope, wgrad
    from tidal.trainer.config import KernelConfig

    model = model.resolved()
    if use_te is None:
        use_te = te_available()
    rope.install()
    pointwise.install((kernels or KernelConfig()).pointwise)
    finalize.install()
    if tconfig.num_moe_experts:
        moe_permute.install((kernels or KernelConfig()).moe_permute, tconfig)
    if wgrad.wanted((kernels or KernelConfig()).wgrad, _device(), tconfig.params_dtype):
        wgrad.install()
        tconfig.gradient_accumulation_fusion = True  # read by each linear layer as it is built
    vpp = tconfig.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for stage in range(vpp):
        vp_stage = stage if vpp > 1 else None
        gpt = GPTModel(
            config=tconfig,
            transformer_layer_spec=layer_spec(tconfig, use_te, vp_stage, kernels),
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=model.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(model.rope_theta),
            rotary_percent=model.partial_rotary_factor,
            vp_stage=vp_stage,
        )
        gpt.to(_device())
        gpt.tidal_kernels = kernels
        chunks.append(gpt)
    init_weights(chunks, tconfig, seed)
    families.init_extra(chunks, tconfig, seed)
    families.install_kernels(chunks, tconfig, kernels or KernelConfig())
    return chunks


def _device() -> torch.device:
    from tidal.trainer import cpu_support

    if torch.cuda.is_available() and not cpu_support.enabled():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------- mesh-independent initialisation

_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")
_LOCAL_EXPERT = re.compile(r"^(.*\.experts\.)local_experts\.(\d+)(\..*)$")


def global_param_name(local_name: str, layer_offset: int, expert_offset: int) -> str:
    """The name a parameter has in the world-size-1 model (pipeline and expert numbering undone).

    >>> global_param_name("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", 2, 4)
    'decoder.layers.2.mlp.experts.5.linear_fc1.weight'
    """
    name = local_name
    if name.startswith("module."):
        name = name[len("module.") :]
    match = _LAYER.match(name)
    if match:
        name = f"{match.group(1)}{int(match.group(2)) + layer_offset}{match.group(3)}"
    match = _LOCAL_EXPERT.match(name)
    if match:
        name = f"{match.group(1)}{int(match.group(2)) + expert_offset}{match.group(3)}"
    return name


def _is_expert_param(param: torch.nn.Parameter) -> bool:
    return not getattr(param, "allreduce", True)


def _shard_info(param: torch.nn.Parameter) -> tuple[int | None, int, int]:
    """(partition dim or None, shard count, this rank's shard index)."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return None, 1, 0
    if _is_expert_param(param):
        return (
            param.partition_dim,
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
        )
    return param.partition_dim, ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _initial_value(name: str, shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor | None:
    """The full initial tensor of a parameter, or None for parameters built with their final value."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf != "weight" or len(shape) < 2:
        return None  # norms (ones), biases (zeros), expert biases: megatron's deterministic defaults
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return torch.randn(shape, generator=generator) * std


def _local_shard(full: torch.Tensor, dim: int | None, shards: int, index: int, gated: bool) -> torch.Tensor:
    if dim is None or shards == 1:
        return full
    if gated:  # megatron keeps [gate_r; up_r] on rank r of a fused gated fc1
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(shards, dim=dim)[index], up.chunk(shards, dim=dim)[index]], dim=dim)
    return full.chunk(shards, dim=dim)[index]


def _param_std(name: str, tconfig) -> float:
    # megatron's scaled init for the projections that write into the residual stream
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return tconfig.init_method_std / math.sqrt(2.0 * tconfig.num_layers)
    return tconfig.init_method_std


@torch.no_grad()
def init_weights(chunks: list[torch.nn.Module], tconfig, seed: int) -> None:
    """Draw every parameter's full tensor from (seed, global name) and keep this rank's shard."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    ep_rank = ps.get_expert_model_parallel_rank()
    vpp = len(chunks)
    for stage, chunk in enumerate(chunks):
        layer_offset = get_transformer_layer_offset(tconfig, vp_stage=stage if vpp > 1 else None)
        num_local = (tconfig.num_moe_experts or 0) // max(1, ps.get_expert_model_parallel_world_size())
        for local_name, param in chunk.named_parameters():
            name = global_param_name(local_name, layer_offset, ep_rank * num_local)
            if name == "output_layer.weight" and tconfig_shares_embeddings(chunk):
                name = "embedding.word_embeddings.weight"
            dim, shards, index = _shard_info(param)
            full_shape = list(param.shape)
            if dim is not None:
                full_shape[dim] *= shards
            full = _initial_value(name, tuple(full_shape), seed, _param_std(name, tconfig))
            if full is None:
                continue
            gated = tconfig.gated_linear_unit and name.endswith("linear_fc1.weight")
            param.copy_(_local_shard(full, dim, shards, index, gated).to(param.dtype))


def tconfig_shares_embeddings(chunk: torch.nn.Module) -> bool:
    return bool(getattr(chunk, "share_embeddings_and_output_weights", False))


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
