"""The job's starting point: a randomly initialised Hugging Face model directory with the task's tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tidal.model_config import ModelConfig


def init_hf_model(model: ModelConfig, tokenizer_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """Write transformers' default initialisation of ``model`` (seeded) plus the tokenizer to ``out_dir``.

    Idempotent: an existing directory with weights is kept, so a resumed job starts from the same model.
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    if (out / "model.safetensors").exists() or (out / "model.safetensors.index.json").exists():
        return out
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(model.to_hf_config(), dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out), safe_serialization=True)
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)
    return out
