"""Full Hugging Face tensors out of a live megatron-core model (one pipeline stage's chunks).

Every rank of the stage runs the same iteration so that the collectives pair up: tensor-parallel
shards are all-gathered inside the TP group (expert tensors inside the expert-TP group), experts
inside the expert-parallel group, and each tensor leaves with global layer and expert ids. Layer
ids come from the modules' own ``layer_number``, so any pipeline or virtual-pipeline layout works.
Also the loading direction: ``load_hf_into_chunks`` gives each rank its shards of a HF checkpoint.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tidal.weights_sync.mapping import WeightMapping, canonical_name
from tidal.weights_sync.sharding import merge, split

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


@dataclass
class Groups:
    """The trainer's process groups that hold shards of one tensor (None: size 1)."""

    tp: dist.ProcessGroup | None = None
    ep: dist.ProcessGroup | None = None
    etp: dist.ProcessGroup | None = None

    @classmethod
    def from_megatron(cls) -> Groups:
        from megatron.core import parallel_state as ps

        return cls(
            tp=ps.get_tensor_model_parallel_group(),
            ep=ps.get_expert_model_parallel_group(),
            etp=ps.get_expert_tensor_parallel_group(),
        )


@dataclass
class GatherTimes:
    gather_s: float = 0.0
    convert_s: float = 0.0
    bytes: int = 0
    extra: dict[str, float] = field(default_factory=dict)


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_gather(t: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    if _size(group) == 1:
        return [t]
    t = t.detach().contiguous()
    out = [torch.empty_like(t) for _ in range(_size(group))]
    dist.all_gather(out, t, group=group)
    return out


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def _layer_offsets(model: torch.nn.Module) -> dict[int, int]:
    """Local layer index -> global layer id, from each TransformerLayer's 1-based ``layer_number``."""
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        return {}
    return {i: layer.layer_number - 1 for i, layer in enumerate(decoder.layers)}


def named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_parameter) for parameters and the buffers that are weights (e.g. expert_bias)."""
    yield from ((n, p, True) for n, p in model.named_parameters())
    yield from ((n, b, False) for n, b in model.named_buffers())


def _global_name(local: str, offsets: Mapping[int, int], expert_base: int) -> str:
    name = canonical_name(local)
    m = _LAYER.match(name)
    if m is not None:
        name = f"decoder.layers.{offsets[int(m[1])]}." + name[m.end() :]
    e = _EXPERT.search(name)
    if e is not None:
        name = name[: e.start()] + f".local_experts.{int(e[1]) + expert_base}." + name[e.end() :]
    return name


def iter_full_megatron(
    chunks: list[torch.nn.Module],
    mapping: WeightMapping,
    groups: Groups,
    times: GatherTimes | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(global megatron-core name, full tensor) of every weight of this rank's stage."""
    times = times or GatherTimes()
    ep_size = _size(groups.ep)
    tied = mapping.model.tie_word_embeddings
    for chunk in chunks:
        model = unwrap(chunk)
        offsets = _layer_offsets(model)
        num_local = mapping.model.num_experts // ep_size if mapping.model.is_moe else 0
        for local, tensor, is_param in named_tensors(model):
            name = _global_name(local, offsets, 0)
            match = mapping.match_megatron(name)
            if match is None:
                if tied and name == "output_layer.weight":
                    continue  # the last stage's copy of the tied embedding
                if is_param:
                    mapping.rule_for(name)  # raises, naming the mapping file
                continue
            t0 = time.perf_counter()
            rule = match.rule
            partitioned = getattr(tensor, "tensor_model_parallel", False)
            if partitioned:
                dim = getattr(tensor, "partition_dim", 0)
                if (rule.shard == "row") != (dim == 1):
                    raise ValueError(
                        f"{local}: megatron-core splits dim {dim} but the mapping says shard={rule.shard}"
                    )
            shard_kind = rule.shard if partitioned else "replicated"
            tp_group = groups.etp if rule.expert else groups.tp
            full = merge(_all_gather(tensor.data, tp_group), shard_kind)
            if rule.expert and ep_size > 1:
                per_rank = _all_gather(full, groups.ep)
            else:
                per_rank = [full]
            times.gather_s += time.perf_counter() - t0
            for r, t in enumerate(per_rank):
                yield (_global_name(local, offsets, r * num_local) if rule.expert else name), t


def iter_hf(
    chunks: list[torch.nn.Module],
    mapping: WeightMapping,
    groups: Groups,
    times: GatherTimes | None = None,
    dtype: torch.dtype | None = None,
    packable: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face (name, tensor) of this rank's stage, gathered and converted.

    ``packable``: tensors that would need a copy (q/k/v) leave as ``bucket.GroupedRows``, for the live
    sync's packer; checkpoints and comparisons take plain tensors (the default).
    """
    times = times if times is not None else GatherTimes()
    for name, full in iter_full_megatron(chunks, mapping, groups, times):
        t0 = time.perf_counter()
        out = mapping.to_hf(name, full, packable=packable)
        if dtype is not None:
            out = [(n, t.to(dtype)) for n, t in out]
        times.convert_s += time.perf_counter() - t0
        for n, t in out:
            times.bytes += t.numel() * t.element_size()
            yield n, t


def load_hf_into_chunks(
    chunks: list[torch.nn.Module], hf: Mapping[str, torch.Tensor], mapping: WeightMapping, groups: Groups
) -> set[str]:
    """Copy this rank's shards of a Hugging Face state dict into the model.

    Returns the global megatron-core names this rank loaded; across all ranks they must cover the
    checkpoint (at world size 1 a checkpoint tensor outside the set has no place in the model).
    """
    full = dict(mapping.to_megatron(hf))
    if mapping.model.tie_word_embeddings and "embedding.word_embeddings.weight" in full:
        full["output_layer.weight"] = full["embedding.word_embeddings.weight"]
    ep_size, ep_rank = _size(groups.ep), _rank(groups.ep)
    num_local = mapping.model.num_experts // ep_size if mapping.model.is_moe else 0
    loaded: set[str] = set()
    for chunk in chunks:
        model = unwrap(chunk)
        offsets = _layer_offsets(model)
        for local, tensor, is_param in named_tensors(model):
            name = _global_name(local, offsets, ep_rank * num_local)
            match = mapping.match_megatron(name)
            tied_output = mapping.model.tie_word_embeddings and name == "output_layer.weight"
            if match is None and not tied_output:
                if is_param:
                    mapping.rule_for(name)
                continue
            if name not in full:
                raise KeyError(f"{local} (global {name}) is not in the Hugging Face checkpoint")
            rule = mapping.rule_for("embedding.word_embeddings.weight" if tied_output else name).rule
            group = groups.etp if rule.expert else groups.tp
            kind = rule.shard if getattr(tensor, "tensor_model_parallel", False) else "replicated"
            shard = split(full[name], kind, _size(group))[_rank(group)]
            if shard.shape != tensor.shape:
                raise ValueError(
                    f"{local}: checkpoint shard {list(shard.shape)} != parameter {list(tensor.shape)}"
                )
            with torch.no_grad():
                tensor.copy_(shard)
            loaded.add(name)
    return loaded
