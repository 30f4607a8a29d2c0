"""Hugging Face checkpoint directories: safetensors files (sharded with an index) plus config.json."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tidal.model_config import ModelConfig

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".index.json")


def copy_side_files(
    source: str | Path, target: str | Path, skip: tuple[str, ...] = ("config.json",)
) -> list[str]:
    """Copy what a Hugging Face directory holds beside its weights (tokenizer files, chat template,
    generation config, remote code) from ``source`` into ``target``: every file but the weights and ``skip``.
    Returns the names copied."""
    copied = []
    for f in sorted(Path(source).iterdir()):
        if f.is_file() and f.name not in skip and not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(f, Path(target) / f.name)
            copied.append(f.name)
    return copied


def weight_files(directory: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    d = Path(directory)
    if (d / INDEX).exists():
        index = json.loads((d / INDEX).read_text())
        return {name: d / file for name, file in index["weight_map"].items()}
    if (d / SINGLE).exists():
        with safe_open(d / SINGLE, "pt") as f:
            return {name: d / SINGLE for name in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    raise FileNotFoundError(
        f"{d}: no {SINGLE} or {INDEX}; give a Hugging Face model directory saved with safetensors"
    )


def load_tensors(directory: str | Path, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint (or only ``names``), on CPU."""
    files = weight_files(directory)
    wanted = list(files) if names is None else list(names)
    missing = [n for n in wanted if n not in files]
    if missing:
        raise KeyError(f"{directory}: tensors {missing[:3]} are not in the checkpoint")
    by_file: dict[Path, list[str]] = {}
    for n in wanted:
        by_file.setdefault(files[n], []).append(n)
    out: dict[str, torch.Tensor] = {}
    for path, file_names in by_file.items():
        with safe_open(path, "pt") as f:
            for n in file_names:
                out[n] = f.get_tensor(n)
    return out


def load_config(directory: str | Path) -> ModelConfig:
    path = Path(directory) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{directory}: no config.json; give a Hugging Face model directory")
    return config_from_hf_dict(json.loads(path.read_text()), path=str(directory))


def raw_config(directory: str | Path) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


def config_from_hf_dict(hf: dict, path: str | None = None) -> ModelConfig:
    hf = dict(hf)
    # transformers 5 writes rope_theta inside rope_parameters and qwen3_moe's num_experts as num_local_experts
    rope = hf.get("rope_parameters") or {}
    hf.setdefault("rope_theta", rope.get("rope_theta"))
    if hf.get("model_type") == "qwen3_moe":
        hf.setdefault("num_experts", hf.get("num_local_experts"))
    return ModelConfig.from_hf_dict(hf, path=path)


def save(
    directory: str | Path,
    tensors: dict[str, torch.Tensor],
    config: ModelConfig | dict | None = None,
    max_shard_bytes: int = 4 << 30,
) -> None:
    """Write ``tensors`` (and ``config`` as config.json) as a Hugging Face directory, sharded by size."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    if len(shards) == 1:
        save_file(shards[0], str(d / SINGLE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(d / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (d / INDEX).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )
    if config is not None:
        hf = config.to_hf_dict() if isinstance(config, ModelConfig) else config
        (d / "config.json").write_text(json.dumps(hf, indent=1))
