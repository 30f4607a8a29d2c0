"""The mapping of each model family (one module per family: ``mapping_<family>.py``)."""

from __future__ import annotations

import importlib

from tidal.model_config import ModelConfig
from tidal.weights_sync.mapping import WeightMapping


def mapping_for(model: ModelConfig, padded_vocab_size: int | None = None) -> WeightMapping:
    module = importlib.import_module(f"tidal.weights_sync.mapping_{model.family}")
    return WeightMapping(module.RULES, model, padded_vocab_size)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """megatron-core's padding: the vocab rounded up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
