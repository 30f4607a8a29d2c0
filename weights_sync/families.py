"""The mapping of each model family (one module per family: ``mapping_<family>.py``)."""

from __future__ import annotations

import importlib

from tidal.model_config import ModelConfig
from tidal.weights_sync.mapping import WeightMapping

# families whose mapping module is not named after the family
MODULES = {"qwen3_5_moe": "mapping_qwen3_5", "glm_moe_dsa": "mapping_glm5"}


def mapping_for(model: ModelConfig, padded_vocab_size: int | None = None) -> WeightMapping:
    name = MODULES.get(model.family, f"mapping_{model.family}")
    module = importlib.import_module(f"tidal.weights_sync.{name}")
    # a family with its own fusions provides a WeightMapping subclass as MAPPING
    cls = getattr(module, "MAPPING", WeightMapping)
    return cls(module.RULES, model, padded_vocab_size)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """megatron-core's padding: the vocab rounded up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
