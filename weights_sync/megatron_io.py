"""megatron-core checkpoints for a given mesh, written and read without starting the mesh.

Layout of a converted directory (``tidal convert --to megatron``)::

    meta.json                                  format, mesh, padded vocab, the HF config
    pp{p}_chunk{v}/tp{t}.safetensors           dense tensors of tensor-parallel rank t
    pp{p}_chunk{v}/ep{e}_etp{t}.safetensors    expert tensors of expert-parallel rank e, expert-TP rank t

Names inside the files are the module's own (local layer ids of the chunk, local expert ids), so a
rank loads its files with ``module.load_state_dict``. One file per tp or (ep, etp) coordinate keeps the
format independent of how megatron-core orders global ranks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tidal.model_config import ModelConfig
from tidal.weights_sync import hf_io
from tidal.weights_sync.families import mapping_for
from tidal.weights_sync.mapping import WeightMapping, canonical_name
from tidal.weights_sync.sharding import StageLayout, local_experts, merge, split

FORMAT = "tidal-megatron-v1"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class Mesh:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1


def global_to_local(name: str, layout: StageLayout, ep: int, num_experts: int) -> tuple[int, int, int, str]:
    """(pp_rank, chunk, ep_rank, local name) of a full megatron-core tensor name."""
    m = _LAYER.match(name)
    if m is None:
        if name.startswith("embedding."):
            return 0, 0, 0, name
        return layout.pp - 1, layout.vpp - 1, 0, name
    pp_rank, chunk, local = layout.locate(int(m[1]))
    name = f"decoder.layers.{local}." + name[m.end() :]
    ep_rank = 0
    e = _EXPERT.search(name)
    if e is not None:
        ep_rank, local_expert = divmod(int(e[1]), num_experts // ep)
        name = name[: e.start()] + f".local_experts.{local_expert}." + name[e.end() :]
    return pp_rank, chunk, ep_rank, name


def local_to_global(
    name: str, layout: StageLayout, pp_rank: int, chunk: int, ep_rank: int, num_experts: int, ep: int
) -> str:
    """Full (global-id, canonical) name of a tensor held by a chunk of a rank."""
    name = canonical_name(name)
    m = _LAYER.match(name)
    if m is None:
        return name
    name = f"decoder.layers.{int(m[1]) + layout.offset(pp_rank, chunk)}." + name[m.end() :]
    e = _EXPERT.search(name)
    if e is not None:
        first = local_experts(num_experts, ep, ep_rank).start
        name = name[: e.start()] + f".local_experts.{int(e[1]) + first}." + name[e.end() :]
    return name


def split_for_mesh(
    full: Iterable[tuple[str, torch.Tensor]], mapping: WeightMapping, mesh: Mesh
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(file key "pp{p}_chunk{v}/tp{t}" or ".../ep{e}_etp{t}", local name, shard) of full tensors."""
    model = mapping.model
    layout = StageLayout(model.num_hidden_layers, mesh.pp, mesh.vpp)
    for name, tensor in full:
        rule = mapping.rule_for(name).rule
        pp_rank, chunk, ep_rank, local = global_to_local(name, layout, mesh.ep, model.num_experts)
        stage = f"pp{pp_rank}_chunk{chunk}"
        if rule.expert:
            for t, shard in enumerate(split(tensor, rule.shard, mesh.etp)):
                yield f"{stage}/ep{ep_rank}_etp{t}", local, shard
        else:
            for t, shard in enumerate(split(tensor, rule.shard, mesh.tp)):
                yield f"{stage}/tp{t}", local, shard
        if model.tie_word_embeddings and name == "embedding.word_embeddings.weight" and mesh.pp > 1:
            # with pipeline stages the last one keeps its own copy of the tied embedding as output layer
            last = f"pp{mesh.pp - 1}_chunk{mesh.vpp - 1}"
            for t, shard in enumerate(split(tensor, rule.shard, mesh.tp)):
                yield f"{last}/tp{t}", "output_layer.weight", shard


def save_megatron(
    directory: str | Path,
    hf_tensors: dict[str, torch.Tensor],
    model: ModelConfig,
    mesh: Mesh,
    padded_vocab: int,
    hf_config: dict | None = None,
) -> None:
    """Shard ``hf_tensors`` for ``mesh``; ``hf_config`` (the source config.json) is kept for the way back."""
    mapping = mapping_for(model, padded_vocab)
    files: dict[str, dict[str, torch.Tensor]] = {}
    for key, name, shard in split_for_mesh(mapping.to_megatron(hf_tensors), mapping, mesh):
        files.setdefault(key, {})[name] = shard.contiguous()
    d = Path(directory)
    for key, tensors in files.items():
        (d / key).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(d / f"{key}.safetensors"))
    meta = {
        "format": FORMAT,
        "mesh": mesh.__dict__,
        "padded_vocab_size": padded_vocab,
        "hf_config": hf_config or model.to_hf_dict(),
    }
    (d / "meta.json").write_text(json.dumps(meta, indent=1))


def read_meta(directory: str | Path) -> tuple[ModelConfig, Mesh, int, dict]:
    path = Path(directory) / "meta.json"
    if not path.exists():
        raise FileNotFoundError(f"{directory}: no meta.json; not a checkpoint written by `tidal convert`")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    model = hf_io.config_from_hf_dict(meta["hf_config"])
    return model, Mesh(**meta["mesh"]), meta["padded_vocab_size"], meta["hf_config"]


def load_megatron_as_hf(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Gather every shard of a converted directory back into Hugging Face tensors (and config.json)."""
    model, mesh, padded_vocab, hf_config = read_meta(directory)
    mapping = mapping_for(model, padded_vocab)
    layout = StageLayout(model.num_hidden_layers, mesh.pp, mesh.vpp)
    d = Path(directory)
    shards: dict[str, list[torch.Tensor | None]] = {}
    for p in range(mesh.pp):
        for v in range(mesh.vpp):
            stage = d / f"pp{p}_chunk{v}"
            for t in range(mesh.tp):
                for name, tensor in _load(stage / f"tp{t}.safetensors").items():
                    full = local_to_global(name, layout, p, v, 0, model.num_experts, mesh.ep)
                    if model.tie_word_embeddings and full == "output_layer.weight":
                        continue
                    shards.setdefault(full, [None] * mesh.tp)[t] = tensor
            first = layout.offset(p, v)
            has_experts = model.is_moe and first + layout.per_chunk > model.first_k_dense_replace
            for e in range(mesh.ep if has_experts else 0):
                for t in range(mesh.etp):
                    for name, tensor in _load(stage / f"ep{e}_etp{t}.safetensors").items():
                        full = local_to_global(name, layout, p, v, e, model.num_experts, mesh.ep)
                        shards.setdefault(full, [None] * mesh.etp)[t] = tensor
    out: dict[str, torch.Tensor] = {}
    for name, parts in shards.items():
        if any(s is None for s in parts):
            raise ValueError(f"{directory}: tensor {name} is missing shards")
        full = merge(parts, mapping.rule_for(name).rule.shard)  # type: ignore[arg-type]
        out.update(mapping.to_hf(name, full))
    return out, hf_config


def _load(path: Path) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the converted checkpoint is incomplete")
    return load_file(str(path))


def load_into_chunks(chunks: list[torch.nn.Module], directory: str | Path) -> int:
    """Load this rank's files of a converted directory into its model chunks (the mesh must match).

    Returns the number of tensors loaded; every parameter of the chunks must be in the files.
    """
    from megatron.core import parallel_state as ps

    from tidal.weights_sync.gather import named_tensors, unwrap

    _, mesh, _, _ = read_meta(directory)
    running = Mesh(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        vpp=len(chunks),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
    )
    if running != mesh:
        raise ValueError(
            f"{directory} was converted for {mesh} but the trainer runs {running}: convert again"
        )
    d = Path(directory) / f"pp{ps.get_pipeline_model_parallel_rank()}_chunk"
    loaded = 0
    for v, chunk in enumerate(chunks):
        files = [d.with_name(d.name + f"{v}") / f"tp{ps.get_tensor_model_parallel_rank()}.safetensors"]
        files.append(
            files[0].with_name(
                f"ep{ps.get_expert_model_parallel_rank()}_etp{ps.get_expert_tensor_parallel_rank()}.safetensors"
            )
        )
        state: dict[str, torch.Tensor] = {}
        for f in files:
            if f.exists():
                state.update(load_file(str(f)))
        for name, tensor, is_param in named_tensors(unwrap(chunk)):
            key = canonical_name(name)
            if key not in state:
                if is_param:
                    raise KeyError(f"{directory}: no tensor for {name} in {[str(f) for f in files]}")
                continue
            if state[key].shape != tensor.shape:
                raise ValueError(
                    f"{name}: file shape {list(state[key].shape)} != parameter {list(tensor.shape)}"
                )
            with torch.no_grad():
                tensor.copy_(state[key])
            loaded += 1
    return loaded
