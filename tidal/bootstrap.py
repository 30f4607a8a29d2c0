"""The job's starting point: a randomly initialised Hugging Face model directory with the task's tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from tidal.model_config import ModelConfig, has_hf_weights
from tidal.weights_sync.hf_io import copy_side_files


def init_hf_model(model: ModelConfig, tokenizer_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """Write transformers' default initialisation of ``model`` (seeded) plus the tokenizer to ``out_dir``.

    Idempotent: an existing directory with weights is kept, so a resumed job starts from the same model.
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    if has_hf_weights(out):
        return out
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(model.to_hf_config(), dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out), safe_serialization=True)
    # the tokenizer may come from a model's own directory (task.tokenizer=/models/Qwen3-8B): not its weights,
    # its config or its generation defaults
    copy_side_files(tokenizer_dir, out, skip=("config.json", "generation_config.json"))
    return out
