"""Check the trainer's mesh and estimate the memory of each GPU.

usage: tidal plan CONFIG.yaml [key=value ...] [--gpus N] [--gpu-mem 141GB] [--reserve 6GB]
                  [--suggest 5] [--measured RUN_DIR]

--gpus      world size to plan for (default: trainer.nproc * trainer.nnodes)
--gpu-mem   memory of one GPU (GB and GiB both mean 2^30 bytes, as vendors' "141GB" H200 does)
--reserve   kept free for the CUDA context, NCCL buffers and allocator fragmentation
--suggest   how many of the nearest legal meshes that fit to list when the configured one does not
--measured  a run directory (peak_memory/rank<N>.json) or file; measured peaks next to the estimate

Exit status: 0 the mesh is legal and fits (with or without full recompute), 1 it is legal but does not
fit, 2 the config or the mesh is illegal (each broken rule is named).
docs/planner.md explains the accounting and the memory model.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from itertools import product

from pydantic import BaseModel, ConfigDict, Field

from tidal.config import RunConfig
from tidal.errors import ConfigError
from tidal.memory_measured import compare_stage, measured_stages
from tidal.memory_model import (
    Device,
    Estimate,
    GiB,
    LayerCount,
    OptimizerKind,
    estimate,
    layer_count,
    parallelism,
    total_params,
)
from tidal.model_config import ModelConfig
from tidal.trainer.mesh import MeshConfig, mesh_errors

# megatron-core keeps tensor parallelism inside a node; no seed model shards further
MAX_TP = 8


class PlanOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpus: int | None = Field(None, ge=1, description="world size; None: trainer.nproc * trainer.nnodes")
    gpu_mem_gib: float = Field(141.0, gt=0, description="memory of one GPU (H200)")
    reserve_gib: float = Field(6.0, ge=0, description="CUDA context, NCCL buffers, fragmentation")
    suggest: int = Field(5, ge=0, description="nearest fitting meshes listed when the mesh does not fit")
    measured: str | None = Field(
        None, description="a run directory or peak-memory file, compared with the estimate"
    )

    @property
    def budget(self) -> float:
        return (self.gpu_mem_gib - self.reserve_gib) * GiB


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(t|tb|tib|g|gb|gib|m|mb|mib)?\s*$", re.IGNORECASE)
_UNIT_GIB = {"t": 1024, "tb": 1024, "tib": 1024, "g": 1, "gb": 1, "gib": 1, "m": 1 / 1024, "mb": 1 / 1024}


def parse_gib(text: str, flag: str) -> float:
    """'141GB' -> 141.0; units T/G/M with or without B/iB, all binary; a bare number is GiB."""
    match = _SIZE.match(text or "")
    if not match:
        raise ConfigError(f"{flag} {text!r} is not a size; write e.g. 141GB, 80GiB or 96000MB")
    unit = (match.group(2) or "g").lower()
    return float(match.group(1)) * _UNIT_GIB.get(unit, 1 / 1024)


def parse_options(args: list[str]) -> PlanOptions:
    parser = argparse.ArgumentParser(prog="tidal plan", add_help=False, exit_on_error=False)
    parser.add_argument("--gpus", type=int)
    parser.add_argument("--gpu-mem", default="141GB")
    parser.add_argument("--reserve", default="6GB")
    parser.add_argument("--suggest", type=int, default=5)
    parser.add_argument("--measured")
    try:
        ns, unknown = parser.parse_known_args(args)
    except argparse.ArgumentError as exc:
        raise ConfigError(f"plan: {exc}") from None
    if unknown:
        raise ConfigError(f"plan: unknown arguments {unknown}; see `tidal plan --help`")
    if ns.gpus is not None and ns.gpus < 1:
        raise ConfigError(f"plan: --gpus {ns.gpus} must be >= 1")
    return PlanOptions(
        gpus=ns.gpus,
        gpu_mem_gib=parse_gib(ns.gpu_mem, "--gpu-mem"),
        reserve_gib=parse_gib(ns.reserve, "--reserve"),
        suggest=max(ns.suggest, 0),
        measured=ns.measured,
    )


# --------------------------------------------------------------------------------------------------
# rules


def family_errors(model: ModelConfig, mesh: MeshConfig, tokens: int) -> list[str]:
    """Rules beyond megatron-core's accounting: the model family's and the sequence's."""
    errors: list[str] = []
    if model.family == "deepseek_v4" and mesh.tp > 1:
        errors.append(
            f"mesh: tp={mesh.tp} but model.family=deepseek_v4 does not shard over TP (one shared KV head, "
            "grouped output projection); use tp=1 and shard with cp, ep and pp"
        )
    if model.family == "qwen3_5_moe" and mesh.tp > 1:
        errors.append(
            f"mesh: tp={mesh.tp} but tidal trains model.family=qwen3_5_moe with tp=1 only (its weight mapping "
            "does not yet split Gated DeltaNet's fused in_proj over TP); shard with ep, cp and pp"
        )
    if mesh.cp > 1 and tokens % (2 * mesh.cp):
        errors.append(
            f"mesh: trainer.micro_batch_tokens={tokens} is not divisible by 2*cp={2 * mesh.cp} "
            "(context parallel splits each sequence into 2*cp chunks)"
        )
    sequence_parallel = mesh.sequence_parallel if mesh.sequence_parallel is not None else model.is_moe
    if mesh.tp > 1 and sequence_parallel and (tokens // mesh.cp) % mesh.tp:
        errors.append(
            f"mesh: the {tokens // mesh.cp} tokens of a CP rank are not divisible by tp={mesh.tp} "
            "(sequence parallel splits them over TP)"
        )
    return errors


def plan_errors(model: ModelConfig, mesh: MeshConfig, world: int, tokens: int) -> list[str]:
    return mesh_errors(mesh, world, model) + family_errors(model, mesh, tokens)


def auto_layout(num_layers: int, pp: int, vpp: int = 1) -> tuple[int | None, int | None] | None:
    """(first_stage_layers, last_stage_layers) for pp stages: even if possible, else a lighter last stage."""
    if num_layers % (pp * vpp) == 0:
        return None, None
    if pp == 1:
        return None
    per_rank = math.ceil(num_layers / pp / vpp) * vpp
    last = num_layers - per_rank * (pp - 1)
    if last > 0 and last % vpp == 0:
        return None, last
    return None


# --------------------------------------------------------------------------------------------------
# evaluation and search


@dataclass(frozen=True)
class Workload:
    """What is trained, independent of the mesh: the model, its per-layer counts, the micro-batch."""

    model: ModelConfig
    tokens: int
    bf16: bool
    counts: tuple[LayerCount, ...]
    device: Device = "cuda"

    @classmethod
    def of(cls, model: ModelConfig, tokens: int, bf16: bool = True, device: Device = "cuda") -> Workload:
        counts = tuple(layer_count(model, i, device) for i in range(model.num_hidden_layers))
        return cls(model, tokens, bf16, counts, device)


@dataclass
class Evaluated:
    mesh: MeshConfig
    world: int
    estimate: Estimate

    def fits(self, budget: float) -> str:
        """'yes' without recompute, 'recompute' only with full recompute, 'no' otherwise."""
        if self.estimate.peak.total <= budget:
            return "yes"
        if self.estimate.peak_recompute.total_recompute <= budget:
            return "recompute"
        return "no"


def evaluate(work: Workload, mesh: MeshConfig, world: int, optimizer: OptimizerKind) -> Evaluated:
    p = parallelism(mesh, world, work.model.num_hidden_layers)
    return Evaluated(
        mesh,
        world,
        estimate(work.model, p, optimizer, work.tokens, list(work.counts), work.bf16, work.device),
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_meshes(model: ModelConfig, world: int, base: MeshConfig, tokens: int):
    """Every legal mesh for ``world`` GPUs (vpp 1, layers split by :func:`auto_layout`)."""
    divisors = _divisors(world)
    tps = [d for d in divisors if d <= MAX_TP]
    cps = [d for d in divisors if d & (d - 1) == 0]
    eps = [d for d in divisors if model.is_moe and model.num_experts % d == 0] or [1]
    for tp, pp, cp, ep in product(tps, divisors, cps, eps):
        if pp > model.num_hidden_layers or world % (tp * cp * pp) or world % (ep * pp):
            continue
        layout = auto_layout(model.num_hidden_layers, pp)
        if layout is None:
            continue
        for etp in sorted({1, tp}):
            mesh = base.model_copy(
                update={
                    "tp": tp,
                    "pp": pp,
                    "cp": cp,
                    "ep": ep,
                    "etp": etp,
                    "vpp": 1,
                    "sequence_parallel": None,
                    "first_stage_layers": layout[0],
                    "last_stage_layers": layout[1],
                }
            )
            if not plan_errors(model, mesh, world, tokens):
                yield mesh


def mesh_distance(a: MeshConfig, b: MeshConfig) -> float:
    """How far apart two meshes are: the sum of |log2| ratios of their degrees."""
    return sum(abs(math.log2(getattr(a, k) / getattr(b, k))) for k in ("tp", "pp", "cp", "ep", "etp", "vpp"))


def nearest_fitting(
    work: Workload, world: int, base: MeshConfig, optimizer: OptimizerKind, budget: float, limit: int
) -> list[Evaluated]:
    found = []
    for mesh in candidate_meshes(work.model, world, base, work.tokens):
        ev = evaluate(work, mesh, world, optimizer)
        if ev.fits(budget) != "no":
            found.append((mesh_distance(mesh, base), ev.estimate.peak_recompute.total_recompute, ev))
    found.sort(key=lambda item: (item[0], item[1]))
    return [ev for _, _, ev in found[:limit]]


def dist_opt_needs(work: Workload, world: int, base: MeshConfig, budget: float) -> Evaluated | None:
    """The smallest PP x EP (same tp, cp, etp) at which dist_opt fits, if any."""
    best = None
    for mesh in candidate_meshes(work.model, world, base, work.tokens):
        if (mesh.tp, mesh.cp, mesh.etp) != (base.tp, base.cp, base.etp):
            continue
        ev = evaluate(work, mesh, world, "dist_opt")
        if ev.fits(budget) == "no":
            continue
        key = (mesh.pp * mesh.ep, mesh_distance(mesh, base))
        if best is None or key < best[0]:
            best = (key, ev)
    return best[1] if best else None


# --------------------------------------------------------------------------------------------------
# report


def _size(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB else f"{nbytes / (1 << 20):.1f} MiB"


def _unit(est: Estimate) -> tuple[str, float]:
    """GiB, or MiB for models too small to show in GiB."""
    return ("GiB", GiB) if est.peak.total >= GiB else ("MiB", 1 << 20)


def _billions(n: float) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _ranges(layers: tuple[int, ...]) -> str:
    if not layers:
        return "-"
    spans, start, prev = [], layers[0], layers[0]
    for i in layers[1:] + (None,):
        if i is not None and i == prev + 1:
            prev = i
            continue
        spans.append(f"{start}-{prev}" if prev > start else f"{start}")
        if i is not None:
            start = prev = i
    return ",".join(spans)


def describe_mesh(mesh: MeshConfig) -> str:
    text = f"tp={mesh.tp} pp={mesh.pp} cp={mesh.cp} ep={mesh.ep} etp={mesh.etp} vpp={mesh.vpp}"
    for key in ("first_stage_layers", "last_stage_layers"):
        if getattr(mesh, key) is not None:
            text += f" {key}={getattr(mesh, key)}"
    return text


def accounting_lines(model: ModelConfig, ev: Evaluated) -> list[str]:
    p = parallelism(ev.mesh, ev.world, model.num_hidden_layers)
    lines = [
        f"  ngpu / pp = tp * cp * dp = etp * ep * edp:  {p.world} / {p.pp} = {p.world // p.pp}"
        f" = {p.tp} * {p.cp} * {p.dp} = {p.etp} * {p.ep} * {p.edp}",
        "  layers per stage: "
        + "  ".join(f"[{r}] {len(ls)} ({_ranges(ls)})" for r, ls in enumerate(p.stage_layers)),
    ]
    if model.is_moe:
        lines.append(
            f"  experts per rank: {model.num_experts // p.ep} of {model.num_experts} (ep={p.ep}), each "
            f"3 x {model.hidden_size} x {model.moe_intermediate_size} split over etp={p.etp}; "
            f"top-{model.num_experts_per_tok}"
        )
    return lines


MEMORY_COLUMNS = (
    "stage",
    "layers",
    "params",
    "weights",
    "grads",
    "optim",
    "in-flight",
    "act",
    "act(rc)",
    "logits",
    "total",
    "total(rc)",
)


def memory_lines(est: Estimate, budget: float) -> list[str]:
    unit, scale = _unit(est)
    lines = [
        f"  memory per GPU ({unit}), optimizer {est.optimizer}, {'bf16' if est.bf16 else 'fp32'}, "
        f"{est.tokens} tokens per micro-batch; act: activations of the in-flight micro-batches, "
        "(rc): with full recompute",
        "  " + "".join(f"{name:>10}" for name in MEMORY_COLUMNS),
    ]
    for s in est.stages:
        sizes = (s.weights, s.grads, s.optimizer)
        tail = (s.activations, s.activations_recompute, s.logits, s.total, s.total_recompute)
        cells = [str(s.stage), str(len(s.layers)), _billions(s.dense_params + s.expert_params)]
        cells += (
            [f"{x / scale:.1f}" for x in sizes] + [f"x{s.in_flight:g}"] + [f"{x / scale:.1f}" for x in tail]
        )
        lines.append("  " + "".join(f"{cell:>10}" for cell in cells))
    lines.append(
        f"  peak: {est.peak.total / scale:.1f} {unit} (stage {est.peak.stage}) without recompute, "
        f"{est.peak_recompute.total_recompute / scale:.1f} {unit} (stage {est.peak_recompute.stage}) with "
        f"full recompute; budget {_size(budget)}"
    )
    return lines


VERDICT = {
    "yes": "fits without recompute",
    "recompute": "fits only with full activation recompute",
    "no": "DOES NOT FIT, even with full activation recompute",
}


def report(cfg: RunConfig, model: ModelConfig, world: int, opts: PlanOptions) -> tuple[int, list[str]]:
    mesh, tokens = cfg.trainer.mesh, cfg.trainer.micro_batch_tokens
    optimizer: OptimizerKind = cfg.trainer.optimizer.kind
    total, active = total_params(model)
    out = [
        f"model: {model.family}, {model.num_hidden_layers} layers, hidden {model.hidden_size}, "
        f"{model.num_attention_heads} heads"
        + (f", {model.num_experts} experts top-{model.num_experts_per_tok}" if model.is_moe else "")
        + f", vocab {model.vocab_size}: {_billions(total)} parameters, {_billions(active)} active",
        f"mesh on {world} GPUs: {describe_mesh(mesh)}",
    ]
    errors = plan_errors(model, mesh, world, tokens)
    if errors:
        return 2, out + ["ILLEGAL MESH:"] + [f"  {e}" for e in errors]
    work = Workload.of(model, tokens, cfg.trainer.bf16, cfg.device)
    ev = evaluate(work, mesh, world, optimizer)
    out += accounting_lines(model, ev)
    out += memory_lines(ev.estimate, opts.budget)
    verdict = ev.fits(opts.budget)
    out.append(
        f"verdict: {VERDICT[verdict]} ({opts.gpu_mem_gib:g} GiB GPUs, {opts.reserve_gib:g} GiB reserved)"
    )
    if optimizer == "fsdp2":
        out += _dist_opt_lines(work, world, mesh, opts.budget)
    if opts.measured:
        out += _measured_lines(ev.estimate, opts.measured, recompute=verdict == "recompute")
    if verdict == "no":
        out.append(f"nearest legal meshes that fit on {world} GPUs ({optimizer}):")
        found = nearest_fitting(work, world, mesh, optimizer, opts.budget, opts.suggest)
        for alt in found:
            e = alt.estimate
            out.append(
                f"  {describe_mesh(alt.mesh)}: {_size(e.peak.total)}, "
                f"{_size(e.peak_recompute.total_recompute)} with full recompute -> {VERDICT[alt.fits(opts.budget)]}"
            )
        if not found:
            out.append("  none: add GPUs, shorten trainer.micro_batch_tokens or use larger GPUs")
        return 1, out
    return 0, out


def _dist_opt_lines(work: Workload, world: int, mesh: MeshConfig, budget: float) -> list[str]:
    ev = evaluate(work, mesh, world, "dist_opt")
    fit = ev.fits(budget)
    line = (
        f"dist_opt at this mesh: {_size(ev.estimate.peak.total)}, "
        f"{_size(ev.estimate.peak_recompute.total_recompute)} with full recompute -> {VERDICT[fit]}"
    )
    if fit != "no":
        return [line]
    needed = dist_opt_needs(work, world, mesh, budget)
    if needed is None:
        return [line, f"  dist_opt fits at no PP x EP on {world} GPUs with tp={mesh.tp} cp={mesh.cp}"]
    m = needed.mesh
    return [
        line,
        f"  dist_opt needs a larger PP x EP: pp={m.pp} x ep={m.ep} (= {m.pp * m.ep}, now {mesh.pp * mesh.ep}), "
        f"{_size(needed.estimate.peak_recompute.total_recompute)} with full recompute",
    ]


def _measured_lines(est: Estimate, path: str, recompute: bool) -> list[str]:
    try:
        measured = measured_stages(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"plan: --measured {path}: {exc}") from None
    lines = [f"estimate vs measured peak ({path}, {'full recompute' if recompute else 'no recompute'}):"]
    for stage in est.stages:
        if stage.stage not in measured:
            continue
        row = compare_stage(stage, measured[stage.stage], recompute)
        line = (
            f"  stage {stage.stage}: estimated {_size(row['estimate'])}, measured {_size(row['measured'])}, "
            f"error {row['error']:+.1%}"
        )
        if "static_error" in row:
            line += (
                f" (static {_size(row['static_estimate'])} vs {_size(row['static_measured'])}, "
                f"dynamic {_size(row['dynamic_estimate'])} vs {_size(row['dynamic_measured'])})"
            )
        lines.append(line)
    return lines


def main(config: RunConfig, args: list[str]) -> int:
    opts = parse_options(args)
    world = opts.gpus or config.trainer.nproc * config.trainer.nnodes
    model = config.model.resolved()
    status, lines = report(config, model, world, opts)
    print("\n".join(lines))
    return status
