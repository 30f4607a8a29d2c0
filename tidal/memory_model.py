"""Per-GPU memory of the trainer: parameters, gradients, optimizer state and activations, per stage.

The model is counted layer by layer from :class:`ModelConfig` (so hybrid stacks, dense leading layers and
DeepSeek-V4's per-layer attention kinds are each counted as they are), then placed on the mesh:

- dense parameters (attention, norms, dense MLPs, shared experts, routers, embeddings) are split over TP;
- routed experts are split over EP (whole experts) and ETP (each expert's matrices);
- pipeline stages hold the layers that megatron-core's split gives them, the first the embedding, the last
  the output layer and the loss;
- optimizer state is sharded over the data-parallel ranks that hold the same weights: dp*cp for dense
  parameters, edp for experts.

Bytes per parameter (Adam; :data:`PARAM_BYTES`), for bf16 training with fp32 master weights:

=========  ===============  ================  ===========================================
optimizer  weights          gradients         optimizer state
=========  ===============  ================  ===========================================
dist_opt   2 (bf16)         4 (fp32 buffer)   12 / shard (fp32 master + 2 Adam moments)
fsdp2      4 / shard (fp32)  4 / shard (fp32)  8 / shard (2 Adam moments)
           + bf16 weights and fp32 gradients of 2 layers unsharded (current and prefetched)
=========  ===============  ================  ===========================================

and for fp32 training (``trainer.bf16: false``, the tiny CPU runs) 4-byte weights that are their own
master copy and 4-byte activations.

Activations are the tensors each module keeps for backward, per token, in bf16 (softmax statistics and
router logits in fp32), as megatron-core's local spec and tidal's packed core attention keep them (the
trainer's path without Transformer Engine; docs/planner.md lists them), with sequence parallel when
tp > 1, balanced routing, and the pipeline's in-flight micro-batches (1F1B: stage r holds pp - r;
interleaved: megatron's warm-up count) plus each one's stage output. MoE layers peak in their forward on the
stacked copy of their local experts' weights (GroupedExperts does not keep it: backward restacks) and on
three more routed copies of the hidden state (four with EP) that they do not keep. A stage before the
last holds the gradient received from the next one through a micro-batch's backward. Full recompute
keeps each layer's input and one recomputed layer's peak; on the last stage that peak and the loss's
do not overlap. On CUDA in bf16 the core attention is the varlen flash kernel (no K/V
repeat). The last stage also holds the loss's peak over one micro-batch's logits (the fused logprobs:
the logits and their gradient in the compute dtype, and two fp32 row chunks, over vocab/tp).

The estimate is checked against measured peak memory through :func:`compare_with_measured`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from tidal.model_config import ModelConfig
from tidal.trainer.mesh import MeshConfig, resolve_mesh

GiB = 1 << 30
BF16 = 2
FP32 = 4
OptimizerKind = Literal["dist_opt", "fsdp2"]
Device = Literal["cuda", "cpu"]
# layers whose unsharded parameters and gradients FSDP keeps at once (current + prefetched)
FSDP_UNSHARDED_LAYERS = 2


@dataclass(frozen=True)
class ParamBytes:
    """Bytes per parameter: held whole on each rank, sharded over the data-parallel group, unsharded per
    live FSDP layer; for weights, gradients and optimizer state."""

    weights: tuple[float, float, float]
    grads: tuple[float, float, float]
    optimizer: tuple[float, float, float]


# (optimizer, bf16) -> (whole, per shard, per unsharded layer) bytes per parameter
PARAM_BYTES: dict[tuple[str, bool], ParamBytes] = {
    # bf16 weights, fp32 main-grad buffer, sharded fp32 master weights + 2 Adam moments
    ("dist_opt", True): ParamBytes((BF16, 0, 0), (FP32, 0, 0), (0, 12, 0)),
    # fp32 weights are their own master copy: 2 Adam moments
    ("dist_opt", False): ParamBytes((FP32, 0, 0), (FP32, 0, 0), (0, 8, 0)),
    # sharded fp32 master weights, gradients and moments; bf16 weights and fp32 grads of live layers
    ("fsdp2", True): ParamBytes((0, FP32, BF16), (0, FP32, FP32), (0, 8, 0)),
    ("fsdp2", False): ParamBytes((0, FP32, FP32), (0, FP32, FP32), (0, 8, 0)),
}


@dataclass(frozen=True)
class LayerCount:
    """Parameters of one decoder layer, and bytes it keeps for backward per token in bf16 training."""

    dense_params: int  # split over TP
    expert_params: int  # routed experts; split over EP x ETP
    dense_act: float  # bytes per token, split over TP (sequence parallel)
    expert_act: float  # bytes per token in the routed experts, split over ETP
    # bytes per token live at the layer's forward peak on top of what it keeps (MoE: the dispatcher's
    # token copies and the experts' output), split over TP
    transient_act: float = 0.0


@dataclass(frozen=True)
class Parallelism:
    """A resolved mesh: every degree, and the layers of each pipeline rank."""

    world: int
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    etp: int
    edp: int
    vpp: int
    stage_layers: tuple[tuple[int, ...], ...]  # layer indices held by each pipeline rank


@dataclass
class StageMemory:
    stage: int
    layers: tuple[int, ...]
    dense_params: int  # on this GPU
    expert_params: int  # on this GPU
    weights: float  # bytes
    grads: float
    optimizer: float
    activations: float  # without recompute
    activations_recompute: float  # with full recompute
    logits: float
    in_flight: float  # micro-batches whose activations this stage holds at its peak

    @property
    def static(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.static + self.activations + self.logits

    @property
    def total_recompute(self) -> float:
        return self.static + self.activations_recompute + self.logits


@dataclass
class Estimate:
    optimizer: OptimizerKind
    tokens: int  # per micro-batch, before CP
    bf16: bool = True
    stages: list[StageMemory] = field(default_factory=list)

    @property
    def peak(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def peak_recompute(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total_recompute)


# --------------------------------------------------------------------------------------------------
# parameters


def _attention_params(m: ModelConfig, kind: str) -> int:
    h, nh = m.hidden_size, m.num_attention_heads
    if kind in ("gqa", "gated_gqa"):
        q_out = nh * m.head_dim * (2 if kind == "gated_gqa" else 1)
        kv = 2 * h * m.num_key_value_heads * m.head_dim
        return h * q_out + kv + nh * m.head_dim * h + 2 * m.head_dim  # + q_norm, k_norm
    if kind == "gdn":
        key_dim = m.linear_num_key_heads * m.linear_key_head_dim
        value_dim = m.linear_num_value_heads * m.linear_value_head_dim
        conv_dim = 2 * key_dim + value_dim
        nv = m.linear_num_value_heads
        in_proj = h * (conv_dim + value_dim + 2 * nv)  # qkv, z, b, a
        return (
            in_proj + conv_dim * m.linear_conv_kernel_dim + 2 * nv + m.linear_value_head_dim + value_dim * h
        )
    if kind in ("mla", "mla_dsa"):
        qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * nh * qk_head
        else:
            q = h * nh * qk_head
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        kv += m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim)
        params = q + kv + nh * m.v_head_dim * h
        if kind == "mla_dsa":
            params += _indexer_params(m) + h * m.index_head_dim + 2 * m.index_head_dim  # wk, k_norm
        return params
    if kind.startswith("v4_r"):
        return _v4_attention_params(m, int(kind.removeprefix("v4_r")))
    raise ValueError(f"unknown attention kind {kind!r}")


def _indexer_params(m: ModelConfig) -> int:
    """The DSA indexer's query projection (from the q latent) and per-head weights."""
    return (m.q_lora_rank or 0) * m.index_n_heads * m.index_head_dim + m.hidden_size * m.index_n_heads


def _v4_attention_params(m: ModelConfig, ratio: int) -> int:
    h, nh, d, q = m.hidden_size, m.num_attention_heads, m.head_dim, m.q_lora_rank or 0
    params = h * q + q + q * nh * d  # q down, q norm, q up
    params += h * d + d  # one shared KV head and its norm
    params += m.o_lora_rank * nh * d + h * m.o_groups * m.o_lora_rank  # grouped output projection
    params += nh  # attention sinks
    if ratio:
        width = (2 if ratio == 4 else 1) * d  # CSA compresses overlapping windows
        params += 2 * h * width + ratio * width + d  # kv and gate projections, positions, norm
    if ratio == 4:
        iw = 2 * m.index_head_dim
        params += 2 * h * iw + ratio * iw + m.index_head_dim + _indexer_params(m)
    return params


def _mlp_params(m: ModelConfig, layer: int) -> tuple[int, int]:
    """(dense, routed expert) parameters of a layer's MLP."""
    h = m.hidden_size
    if not m.is_moe_layer(layer):
        return 3 * h * m.intermediate_size, 0
    experts = m.num_experts * 3 * h * m.moe_intermediate_size
    router = m.num_experts * h
    if m.family == "qwen3_5_moe":
        return router + 3 * h * m.shared_expert_intermediate_size + h, experts  # + shared expert gate
    return router + m.n_shared_experts * 3 * h * m.moe_intermediate_size, experts


def _hyper_connection_params(m: ModelConfig) -> int:
    """DeepSeek-V4's mHC mixing, per sublayer: (m^2 + 2m) x (m * hidden) weights, biases and 3 scales."""
    n = m.hc_mult
    mix = n * n + 2 * n
    return mix * n * m.hidden_size + mix + 3


def layer_params(m: ModelConfig, layer: int) -> tuple[int, int]:
    """(dense, routed expert) parameters of decoder layer ``layer``."""
    dense, experts = _mlp_params(m, layer)
    dense += _attention_params(m, m.attention_kind(layer)) + 2 * m.hidden_size  # + the two norms
    if m.hc_mult:
        dense += 2 * _hyper_connection_params(m)
    return dense, experts


def embedding_params(m: ModelConfig) -> int:
    return m.vocab_size * m.hidden_size


def head_params(m: ModelConfig) -> int:
    """Final norm and output layer (and DeepSeek-V4's hyper-connection head)."""
    params = m.hidden_size + (0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size)
    if m.hc_mult:
        params += m.hc_mult * m.hc_mult * m.hidden_size + m.hc_mult + 1
    return params


def total_params(m: ModelConfig) -> tuple[int, int]:
    """(all parameters, parameters active per token) of the decoder, without MTP layers."""
    total = embedding_params(m) + head_params(m)
    active = total
    for layer in range(m.num_hidden_layers):
        dense, experts = layer_params(m, layer)
        total += dense + experts
        active += dense + (experts * m.num_experts_per_tok // m.num_experts if m.num_experts else 0)
    return total, active


# --------------------------------------------------------------------------------------------------
# activations (elements per token; bf16 unless counted twice for fp32)


def _norm_act(width: float, device: Device) -> float:
    """What an RMSNorm keeps: its input and fp32 1/rms; on CPU torch's composite rms_norm also keeps the
    normalised input (CUDA has a fused kernel). Its output is counted where the next op keeps it."""
    return width * (2 if device == "cpu" else 1) + 2


def _rope_act(m: ModelConfig, rope_dim: int) -> float:
    """megatron's unfused rotary embedding keeps its per-token cos and sin tables, for queries and keys."""
    return 4 * rope_dim


def _sdpa_act(heads: int, qk_dim: int, v_dim: int) -> float:
    """The packed core attention's reference path (trainer/attention.py, ``sdpa``: CPU, fp32): gathered
    q, k and v (k and v repeated to all heads for GQA) and the output, each a copy, and the fp32
    log-sum-exp."""
    return 2 * heads * (qk_dim + v_dim) + 2 * heads


def _flash_varlen_act(heads: int, kv_heads: int, head_dim: int) -> float:
    """The varlen flash kernel (``flash_varlen``: CUDA, bf16; GQA native, no K/V repeat, no copies): it
    keeps the rotated q and k, the output and the fp32 log-sum-exp (v is a view of linear_qkv's output)."""
    return (2 * heads + kv_heads) * head_dim + 2 * heads


def _attention_act(m: ModelConfig, kind: str, device: Device = "cuda", bf16: bool = True) -> float:
    """Elements per token kept by a layer's attention (from its input norm's output on)."""
    h, nh = m.hidden_size, m.num_attention_heads
    composite = device == "cpu"
    flash = device == "cuda" and bf16  # trainer.kernels.attention=auto
    if kind in ("gqa", "gated_gqa"):
        q, k = nh * m.head_dim, m.num_key_value_heads * m.head_dim
        q_out = q * (2 if kind == "gated_gqa" else 1)
        elems = h + q_out + 2 * k  # linear_qkv input, its output (the k-norm's input is a view of it)
        elems += _norm_act(q, device) + (k if composite else 0) + 2  # q-norm (on a copy), k-norm
        elems += _rope_act(m, int(m.head_dim * m.partial_rotary_factor))
        if flash:
            elems += _flash_varlen_act(nh, m.num_key_value_heads, m.head_dim) + q  # + linear_proj input
        else:
            elems += _sdpa_act(nh, m.head_dim, m.head_dim) + q
        return elems + (2 * q if kind == "gated_gqa" else 0)  # gate and gated output
    if kind == "gdn":
        key_dim = m.linear_num_key_heads * m.linear_key_head_dim
        value_dim = m.linear_num_value_heads * m.linear_value_head_dim
        conv_dim = 2 * key_dim + value_dim
        # linear input, q/k/v before and after the conv, z, a/b, core output, gated-norm output
        return h + 2 * conv_dim + value_dim + 2 * m.linear_num_value_heads + 2 * value_dim
    if kind in ("mla", "mla_dsa"):
        qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
        q_lora = m.q_lora_rank or 0
        elems = h  # the down-projections' input
        elems += _norm_act(q_lora, device) + q_lora  # q latent (the norm's input), q_up's input
        # kv latent with the rope key (the norm's input is a view of it), kv_up's input
        kv = m.kv_lora_rank
        elems += m.qk_rope_head_dim + _norm_act(kv, device) + kv
        elems += _rope_act(m, m.qk_rope_head_dim)
        elems += _sdpa_act(nh, qk_head, qk_head)  # megatron pads v to the q/k head width without TE
        elems += nh * m.v_head_dim  # linear_proj input
        if kind == "mla_dsa":
            elems += _indexer_act(m) + m.index_head_dim
        return elems
    ratio = int(kind.removeprefix("v4_r"))
    d, q = m.head_dim, m.q_lora_rank or 0
    lse = 2 * nh
    elems = h + 2 * q + 2 * nh * d + 2 * d + nh * d + m.o_groups * m.o_lora_rank + lse
    if ratio:
        elems += (2 if ratio == 4 else 1) * d * 2 / ratio  # compressed kv and gate, per token
    if ratio == 4:
        elems += _indexer_act(m)
    return elems


def _indexer_act(m: ModelConfig) -> float:
    """Indexer queries, head weights and the selected positions (int32)."""
    return m.index_n_heads * m.index_head_dim + m.index_n_heads + 2 * m.index_topk


def _grouped_experts_act(width: int) -> float:
    """tidal's GroupedExperts (trainer/experts.py; trainer.kernels.experts auto, loop or grouped_mm) per
    routed copy from fc1's output on: fc1's output (gate and up), silu(gate), their product (which the
    routing probability scales: the unscaled one is kept) and the scaled product (fc2's input)."""
    return 2 * width + width + width + width


def _swiglu_act(width: int) -> float:
    """megatron's unfused SwiGLU MLP from fc1's output on: fc1 output (gate and up), silu(gate), the up
    half plus glu_linear_offset (a copy), and fc2's input."""
    return 2 * width + width + width + width


def _mlp_act(m: ModelConfig, layer: int) -> tuple[float, float]:
    """(dense, routed expert) elements per token kept by a layer's MLP (from its norm's output on)."""
    h = m.hidden_size
    if not m.is_moe_layer(layer):
        return h + _swiglu_act(m.intermediate_size), 0.0
    shared_width = (
        m.shared_expert_intermediate_size
        if m.family == "qwen3_5_moe"
        else m.n_shared_experts * m.moe_intermediate_size
    )
    k = m.num_experts_per_tok
    # router input (a copy), fp32 scores and top-k probabilities, int64 top-k indices; the shared expert
    # reads the norm's output
    dense = h + 2 * m.num_experts + 2 * k + 4 * k + (_swiglu_act(shared_width) if shared_width else 0)
    # each routed copy: the expert's input (sorted by expert), its SwiGLU, its fp32 probability
    routed = k * (h + _grouped_experts_act(m.moe_intermediate_size) + 2)
    return dense, routed


def _moe_transient(m: ModelConfig, layer: int) -> float:
    """Elements per token a MoE layer's forward holds at its peak on top of what it keeps for backward:
    the permuted tokens (the all-to-all dispatcher's first copy, referenced until the layer returns),
    the experts' output and the copy sorted back to token order (on the CPU loop, the per-expert
    outputs before they are concatenated): three routed copies of the hidden state."""
    return 3 * m.num_experts_per_tok * m.hidden_size if m.is_moe_layer(layer) else 0.0


def layer_count(m: ModelConfig, layer: int, device: Device = "cuda", bf16: bool = True) -> LayerCount:
    dense_params, expert_params = layer_params(m, layer)
    mlp_dense, mlp_routed = _mlp_act(m, layer)
    norms = 2 * _norm_act(m.hidden_size, device)  # input and pre-MLP norms
    dense = norms + _attention_act(m, m.attention_kind(layer), device, bf16) + mlp_dense
    if m.hc_mult:
        dense += 2 * (2 * m.hc_mult * m.hidden_size + m.hidden_size)  # fp32 streams and the mixed input
    return LayerCount(
        dense_params, expert_params, dense * BF16, mlp_routed * BF16, _moe_transient(m, layer) * BF16
    )


def head_act(m: ModelConfig, device: Device = "cuda") -> float:
    """Elements per token the last stage keeps before the output layer: final norm, output layer input."""
    return _norm_act(m.hidden_size, device) + m.hidden_size


LOGPROB_CHUNK_TOKENS = 1024  # trainer.kernels.logprobs_chunk_tokens' default


def logits_peak_bytes(tokens: float, vocab_shard: int, bf16: bool) -> float:
    """Peak of the loss over the (vocab-sharded) logits with the fused logprobs (trainer/fused_logprobs.py,
    ``trainer.kernels.logprobs=auto``): the output layer's logits, kept for backward, and their gradient,
    both in the compute dtype, live together in backward; plus two fp32 row chunks at a time (a chunk's
    log-softmax and its exponential)."""
    elem = BF16 if bf16 else FP32
    return 2 * elem * vocab_shard * tokens + 2 * FP32 * vocab_shard * min(LOGPROB_CHUNK_TOKENS, tokens)


# --------------------------------------------------------------------------------------------------
# placement


def stage_layer_counts(mesh: MeshConfig, num_layers: int) -> list[int]:
    """Layers on each pipeline rank under megatron-core's split (mesh rules assumed checked)."""
    counts = [0] * mesh.pp
    rest, middle = num_layers, mesh.pp
    if mesh.first_stage_layers is not None:
        counts[0] = mesh.first_stage_layers
        rest, middle = rest - counts[0], middle - 1
    if mesh.last_stage_layers is not None:
        counts[-1] = mesh.last_stage_layers
        rest, middle = rest - counts[-1], middle - 1
    first = 1 if mesh.first_stage_layers is not None else 0
    last = mesh.pp - (1 if mesh.last_stage_layers is not None else 0)
    for rank in range(first, last):
        counts[rank] = rest // middle
    return counts


def stage_layers(mesh: MeshConfig, num_layers: int) -> list[tuple[int, ...]]:
    """Layer indices of each pipeline rank; with vpp, rank r holds chunks r, r + pp, ... in order."""
    counts = stage_layer_counts(mesh, num_layers)
    held: list[list[int]] = [[] for _ in range(mesh.pp)]
    next_layer = 0
    for _chunk in range(mesh.vpp):
        for rank in range(mesh.pp):
            size = counts[rank] // mesh.vpp
            held[rank].extend(range(next_layer, next_layer + size))
            next_layer += size
    return [tuple(layers) for layers in held]


def parallelism(mesh: MeshConfig, world: int, num_layers: int) -> Parallelism:
    layout = resolve_mesh(mesh, world)  # megatron-core's accounting, written once in trainer/mesh.py
    return Parallelism(**dataclasses.asdict(layout), stage_layers=tuple(stage_layers(mesh, num_layers)))


def in_flight_microbatches(p: Parallelism, rank: int) -> float:
    """Micro-batches of activations a pipeline rank holds at its peak, in units of all its layers."""
    if p.pp == 1:
        return 1.0
    if p.vpp == 1:
        return float(p.pp - rank)
    warmup_chunks = 2 * (p.pp - rank - 1) + (p.vpp - 1) * p.pp
    return (warmup_chunks + 1) / p.vpp


# --------------------------------------------------------------------------------------------------
# the estimate


def _layer_transient(m: ModelConfig, count: LayerCount, layer: int, p: Parallelism) -> float:
    """Bytes per local token (bf16) of a layer's transient forward peak: its count, split over TP, plus
    with EP > 1 and several local experts the all-to-all's output (one more routed copy: the dispatcher
    sorts it by expert into the copy the experts keep, and the layer references both until it returns)."""
    extra = 0.0
    if p.ep > 1 and m.is_moe_layer(layer) and m.num_experts // p.ep > 1:
        extra = m.num_experts_per_tok * m.hidden_size * BF16
    return (count.transient_act + extra) / p.tp


def estimate(
    model: ModelConfig,
    p: Parallelism,
    optimizer: OptimizerKind,
    tokens: int,
    counts: list[LayerCount] | None = None,
    bf16: bool = True,
    device: Device = "cuda",
) -> Estimate:
    """Memory of every pipeline stage for micro-batches of ``tokens`` tokens (split over CP).

    ``bf16=False`` is fp32 training (the tiny CPU runs): 4-byte weights and activations. ``device``: what
    runs it (on CPU torch's RMSNorm keeps more; see :func:`_norm_act`).
    """
    counts = counts or [layer_count(model, i, device, bf16) for i in range(model.num_hidden_layers)]
    local_tokens = tokens / p.cp
    act_scale = 1 if bf16 else FP32 / BF16
    per_param = PARAM_BYTES[(optimizer, bf16)]
    dense_shard, expert_shard = p.dp * p.cp, p.edp
    result = Estimate(optimizer=optimizer, tokens=tokens, bf16=bf16)
    for rank, layers in enumerate(p.stage_layers):
        dense = sum(counts[i].dense_params for i in layers)
        if rank == 0:
            dense += embedding_params(model)
        if rank == p.pp - 1:
            dense += head_params(model)
        dense_rank = dense / p.tp
        expert_rank = sum(counts[i].expert_params for i in layers) / (p.ep * p.etp)
        whole = dense_rank + expert_rank
        sharded = dense_rank / dense_shard + expert_rank / expert_shard
        live = 0.0
        if optimizer == "fsdp2":
            live = FSDP_UNSHARDED_LAYERS * max(
                (counts[i].dense_params / p.tp + counts[i].expert_params / (p.ep * p.etp) for i in layers),
                default=0.0,
            )

        def held(
            bytes_per_param: tuple[float, float, float], whole=whole, sharded=sharded, live=live
        ) -> float:
            return bytes_per_param[0] * whole + bytes_per_param[1] * sharded + bytes_per_param[2] * live

        # what each layer keeps for backward per micro-batch: its activations
        kept = [
            act_scale * (counts[i].dense_act / p.tp + counts[i].expert_act / p.etp) * local_tokens
            for i in layers
        ]
        # a layer's forward peak on top of that; MoE layers also hold the stacked copy of their local
        # experts' weights while they run (GroupedExperts restacks them in backward instead of keeping it)
        transient = [
            _layer_transient(model, counts[i], i, p) * act_scale * local_tokens
            + act_scale * BF16 * counts[i].expert_params / (p.ep * p.etp)
            for i in layers
        ]
        per_mb = sum(kept)
        hidden_state = model.hidden_size * BF16 * act_scale / p.tp * local_tokens
        inputs_only = len(layers) * hidden_state
        # a recomputed layer holds all it keeps plus its transient peak
        largest_layer = max((k + t for k, t in zip(kept, transient, strict=True)), default=0.0)
        last_transient = transient[-1] if transient else 0.0
        # megatron's schedule keeps each in-flight micro-batch's stage output until its gradient returns
        # (deallocate_pipeline_outputs is off): one hidden state per token, not otherwise kept; and the
        # backward of a micro-batch holds the gradient received from the next stage (p2p recv buffer)
        sent = hidden_state if rank < p.pp - 1 else 0.0
        received_grad = hidden_state if rank < p.pp - 1 else 0.0
        flight = in_flight_microbatches(p, rank)
        logits = 0.0
        if rank == p.pp - 1:
            # final norm and output layer input, then the loss's peak over the (vocab-sharded) logits
            logits = head_act(model, device) * BF16 * act_scale / p.tp * local_tokens
            logits += logits_peak_bytes(local_tokens, math.ceil(model.vocab_size / p.tp), bf16)
        # without recompute the peak is the end of the last warm-up forward: everything in flight is
        # kept, plus the larger of the last layer's transient peak and, after it, the received gradient
        # (the last stage: the loss's logits, counted apart)
        # With full recompute, backward recomputes one layer at a time on top of the checkpointed inputs;
        # on the last stage it reaches the last layer's checkpoint only after the loss and the output
        # layer have run their backward and freed the logits, so the two peaks do not add up
        if rank < p.pp - 1:
            forward_peak = max(last_transient, received_grad)
            recompute_peak = received_grad + largest_layer
        else:
            forward_peak = max(last_transient - logits, 0.0)
            recompute_peak = max(largest_layer - logits, 0.0)
        result.stages.append(
            StageMemory(
                stage=rank,
                layers=layers,
                dense_params=round(dense_rank),
                expert_params=round(expert_rank),
                weights=held(per_param.weights),
                grads=held(per_param.grads),
                optimizer=held(per_param.optimizer),
                activations=flight * (per_mb + sent) + forward_peak,
                activations_recompute=flight * (inputs_only + sent) + recompute_peak,
                logits=logits,
                in_flight=flight,
            )
        )
    return result
