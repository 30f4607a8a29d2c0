"""The frozen reference model for the KL penalty: the policy's architecture and mesh, the initial weights.

Built from the same seed as the policy and, when the run starts from a Hugging Face checkpoint, loaded from
that checkpoint, so it is the policy as it was before the first update (also after a resume: the reference
is never checkpointed, it is rebuilt from its source). It is never wrapped for data parallelism, holds no
gradients and no optimizer state, and only runs forward passes without grad, in training mode like the policy's (so that at step 0 its
logprobs equal the policy's bit for bit)
(:func:`tidal.trainer.step.forward_logprobs`).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from tidal.model_config import ModelConfig
from tidal.trainer import models


def build_reference(
    model: ModelConfig, tconfig, *, seed: int, init_hf: str | Path | None = None
) -> list[torch.nn.Module]:
    """This rank's chunks of the reference model (collective when ``init_hf`` is given)."""
    # its own config object: the step sets per-model hooks (no_sync, grad finalisation) on the policy's
    config = copy.copy(tconfig)
    chunks = models.build_model(model, config, seed=seed)
    if init_hf is not None:
        load_hf(chunks, model, init_hf)
    for chunk in chunks:
        chunk.requires_grad_(False)
    return chunks


def load_hf(chunks: list[torch.nn.Module], model: ModelConfig, directory: str | Path) -> None:
    """Load a Hugging Face checkpoint into unwrapped model chunks (collective)."""
    from tidal.trainer.runner import hf_dir
    from tidal.weights_sync.families import mapping_for
    from tidal.weights_sync.gather import Groups, load_hf_into_chunks
    from tidal.weights_sync.hf_io import load_tensors

    tensors = load_tensors(hf_dir(directory))
    load_hf_into_chunks(
        [models.unwrap(c) for c in chunks], tensors, mapping_for(model), Groups.from_megatron()
    )
