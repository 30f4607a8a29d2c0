"""Configuration of the trainer: mesh, optimizer, algorithm."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tidal.broker.config import check_curve_pair
from tidal.trainer.mesh import MeshConfig


class OptimizerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["dist_opt", "fsdp2"] = "dist_opt"
    lr: float = Field(3e-5, gt=0)
    min_lr: float = Field(0.0, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = Field(1.0, ge=0)


class LossConfig(BaseModel):
    """The RL / SFT objective; docs/algorithms.md gives each term's formula and origin."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["grpo", "sft"] = "grpo"
    norm_adv_by_std: bool = True
    adv_epsilon: float = Field(1e-6, gt=0, description="added to the group reward std before dividing")
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.2, ge=0)
    clip_ratio_c: float | None = Field(None, gt=1, description="dual clip; None: off")
    agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_clamp: float | None = Field(
        10.0, gt=0, description="clamp each token's KL estimate to +-this; None: off"
    )
    entropy_coef: float = Field(0.0, ge=0)
    recompute_proximal_logprobs: bool = False
    tis: Literal["off", "token", "sequence", "geometric"] = "off"
    tis_cap: float = Field(2.0, gt=0)
    icepop: tuple[float, float] | None = Field(
        None, description="mask tokens whose IS ratio is outside [low, high]"
    )
    offpolicy_max_staleness: int | None = Field(
        None, ge=0, description="mask sequences whose oldest token is more than this many versions old"
    )
    offpolicy_max_kl: float | None = Field(
        None, gt=0, description="mask sequences whose mean k3 mismatch KL exceeds this"
    )
    offpolicy_mask_negative_only: bool = Field(
        False, description="off-policy masks drop only negative-advantage sequences (DeepSeek-V3.2)"
    )
    mask_truncated: bool = Field(False, description="DAPO overlong filtering: no loss on truncated responses")

    @model_validator(mode="after")
    def _check_icepop(self) -> LossConfig:
        if self.icepop is not None:
            low, high = self.icepop
            if not 0 <= low < high:
                raise ValueError(f"icepop=({low}, {high}) must satisfy 0 <= low < high, e.g. (0.5, 5.0)")
        return self


class KernelConfig(BaseModel):
    """Which implementation runs the trainer's hot spots; ``auto`` picks the fast one the device supports.

    Every fast path has a reference beside it (the value that names it), so the two can be compared on the
    same machine; docs/trainer.md ("Kernels") describes each.
    """

    model_config = ConfigDict(extra="forbid")

    attention: Literal["auto", "flash_varlen", "sdpa"] = Field(
        "auto",
        description="core attention of packed (THD) sequences: flash_varlen = torch's varlen flash kernel "
        "(CUDA, bf16/fp16; context parallel included); sdpa = one SDPA call per group of equal-length "
        "sequences (any device, the reference); auto = flash_varlen where it can run, sdpa elsewhere",
    )
    experts: Literal["auto", "grouped_mm", "loop", "sequential"] = Field(
        "auto",
        description="MoE experts: grouped_mm = one torch._grouped_mm per projection (CUDA sm90+, bf16); "
        "loop = the same module computing expert by expert (any device); sequential = megatron-core's "
        "SequentialMLP; auto = grouped_mm where it can run, loop elsewhere. Parameter names and layouts "
        "are those of SequentialMLP in every case",
    )
    moe_permute: Literal["auto", "gather", "megatron"] = Field(
        "auto",
        description="MoE token permutation (megatron's dispatchers): gather = each token's k routed rows "
        "summed by a gather and a sum instead of an atomic scatter-add (permute backward, unpermute "
        "forward), for models that drop no token; megatron = its index_add_/scatter_add_; auto = gather on "
        "CUDA",
    )
    logprobs: Literal["auto", "compiled", "fused", "reference"] = Field(
        "auto",
        description="per-token logprobs/entropy from (vocab-parallel) logits: fused = row chunks in fp32, "
        "gradient recomputed from the saved logits (no full fp32 copy of the logits); compiled = the same "
        "chunks, each chunk's statistics and gradient one kernel through torch.compile (the fp32 values never "
        "reach memory); reference = the plain fp32 formula; auto = compiled on CUDA for chunks of at least "
        "4M logits, fused elsewhere",
    )
    pointwise: Literal["auto", "compiled", "eager"] = Field(
        "auto",
        description="the layer's elementwise chains (SwiGLU, rotary embedding): compiled = one kernel each "
        "through torch.compile; eager = megatron-core's separate operations; auto = compiled on CUDA for "
        "tensors of at least 4M elements, eager elsewhere",
    )
    gated_delta_rule: Literal["auto", "fla", "torch"] = Field(
        "auto",
        description="Gated DeltaNet layers (Qwen3.5): fla = flash-linear-attention's chunked Triton kernel; "
        "torch = megatron-core's torch-native chunked rule, sequence by sequence (slow, the reference); "
        "auto = fla, unless fla refuses its backward on this device (Hopper with Triton 3.4 to 3.7.0 and no "
        "TileLang), then torch",
    )
    logprobs_chunk_tokens: int = Field(
        1024, ge=1, description="fused logprobs: rows of logits converted to fp32 at a time"
    )
    adam: Literal["auto", "fused", "foreach"] = Field(
        "auto",
        description="the torch Adam inside megatron's optimizer (no Apex/TE): fused = torch's fused CUDA "
        "kernel; foreach = torch's default multi-tensor path; auto = fused when every parameter is on CUDA",
    )
    grad_scale: Literal["auto", "fused", "megatron"] = Field(
        "auto",
        description="the per-token normalisation and the clip of the gradients before Adam: fused = norm on "
        "the device, normalisation x clip coefficient handed to torch's fused Adam as its grad_scale (no host "
        "sync, no pass over the gradients; needs the fused Adam, the foreach helpers and bf16/fp32); "
        "megatron = megatron-core's multiply of the gradient buffer, host-side norm and clip; auto = fused "
        "where it can run",
    )
    wgrad: Literal["auto", "accumulate", "megatron"] = Field(
        "auto",
        description="the weight-gradient products of megatron's linear layers: accumulate = one matmul that "
        "adds into the fp32 main_grad (megatron's gradient_accumulation_fusion, without Apex: torch.addmm "
        "with an fp32 output dtype, CUDA bf16/fp16); megatron = a bf16 product, then main_grad += it; auto = "
        "accumulate on CUDA with bf16/fp16 parameters",
    )
    multi_tensor: Literal["foreach", "megatron"] = Field(
        "foreach",
        description="gradient norm / scale / copy helpers of megatron's optimizer without Apex: foreach = "
        "torch._foreach_* on the device, no host sync, and the distributed optimizer's per-step copies "
        "between master shards and model buffers planned once and run as one multi-tensor copy; megatron = "
        "megatron-core's local fallbacks (one host sync per parameter tensor for the gradient norm) and its "
        "per-parameter copy loops",
    )


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nproc: int = Field(1, ge=1, description="trainer processes per host (torchrun --nproc-per-node)")
    nnodes: int = Field(1, ge=1, description="trainer hosts")
    mesh: MeshConfig = MeshConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    loss: LossConfig = LossConfig()
    steps: int = Field(100, ge=1)
    minibatches_per_batch: int = Field(1, ge=1)
    micro_batch_tokens: int = Field(4096, ge=1, description="token budget of a packed micro-batch")
    bf16: bool = False
    deterministic: bool = False
    checkpoint_every: int = Field(20, ge=0, description="0: only at the end")
    seed: int = 0
    moe_dispatcher: Literal["alltoall", "allgather"] = Field(
        "alltoall", description="megatron-core's MoE token dispatcher"
    )
    expert_bias_update_rate: float = Field(
        1e-3,
        ge=0,
        description="aux-loss-free balancing (deepseek_v3): the router's per-expert bias moves this much "
        "per optimizer step towards equal expert loads (DeepSeek-V3's value); 0 freezes it",
    )
    kernels: KernelConfig = KernelConfig()
    batch_timeout_s: float = Field(
        600.0, gt=0, description="how long to wait for the broker's next batch before giving up"
    )
    ask_ahead: Literal["starved", "never"] = Field(
        "starved",
        description="while the trainer waits for its next batch (starved), its feed asks the broker for the "
        "batch after it before copying and decoding that one, so that the broker's reply overlaps the "
        "work (docs/protocol.md); never: one request a batch. The CPU default job sets never: on its two "
        "shared cores the fetch's work competes with the training steps (GRPO phase 4% slower with it)",
    )
    broker_wait_s: float = Field(
        600.0,
        ge=0,
        description="how long to wait at start for a broker that does not answer yet (started after the "
        "trainer, or restarting), asking again and logging it every 30 s; 0: fail at once",
    )
    curve_secret_key_file: str | None = Field(
        None,
        description="the trainer's ZeroMQ CURVE secret certificate (.key_secret) for a broker with "
        "broker.curve.enabled; None: no CURVE",
    )
    curve_server_key_file: str | None = Field(None, description="the broker's public certificate (.key)")

    @model_validator(mode="after")
    def _check_curve(self) -> TrainerConfig:
        check_curve_pair(self.curve_secret_key_file, self.curve_server_key_file, "trainer")
        return self


def check_fsdp2_mesh(kind: str, pp: int) -> None:
    """Megatron-FSDP in megatron-core 0.19 lays its device mesh out as (dp x cp, ep, tp) over the whole world
    (``mcore_fsdp_adapter._get_dp_tp_mesh``), so a pipeline dimension does not fit.

    Checked when the trainer builds its optimizer, not by the config model: the seed models' planning presets
    (configs/*.yaml) describe fsdp2 meshes with pp > 1, which the planner still evaluates."""
    if kind == "fsdp2" and pp > 1:
        raise ValueError(
            f"trainer.optimizer.kind=fsdp2 with trainer.mesh.pp={pp}: megatron-core 0.19's Megatron-FSDP "
            "builds its mesh from dp x cp, ep and tp only and fails with pipeline parallelism; use "
            "trainer.mesh.pp=1 with fsdp2, or trainer.optimizer.kind=dist_opt with pp > 1"
        )
