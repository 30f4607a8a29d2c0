"""Model families whose megatron-core build needs more than a table of TransformerConfig fields.

``trainer/models.py`` dispatches here for the families named in :data:`FAMILIES`: their config fields,
their own decoder block spec (hybrid or experimental attention layers), the parameters the generic
seeded initialiser does not cover, and the refusal of what cannot run (with the reason and what to do).
"""

from __future__ import annotations

import importlib
from typing import Any

from tidal.model_config import ModelConfig

# family -> module in this package
FAMILIES = {"qwen3_5_moe": "qwen3_5", "glm_moe_dsa": "glm5"}

# families that megatron-core 0.19 has no modules for
UNSUPPORTED = {
    "deepseek_v4": (
        "megatron-core 0.19 has no modules for DeepSeek-V4's hyper-connections (hc_mult residual streams), "
        "compressed sparse attention (CSA/HCA with the ratio-4 indexer), grouped low-rank output projection "
        "or hash-routed leading layers; `tidal plan` works for it, training does not"
    )
}


def module_for(family: str):
    if family in UNSUPPORTED:
        raise ValueError(f"model.family={family} cannot be trained: {UNSUPPORTED[family]}")
    return importlib.import_module(f"tidal.trainer.families.{FAMILIES[family]}")


def handles(family: str) -> bool:
    return family in FAMILIES or family in UNSUPPORTED


def fields(model: ModelConfig, mesh, training: bool) -> dict[str, Any]:
    module = module_for(model.family)
    module.check_trainable(model, mesh, training)
    return module.fields(model)


def block_spec(tconfig, vp_stage: int | None):
    """The family's decoder block spec, or None when megatron's GPT spec serves it."""
    family = getattr(tconfig, "tidal_family", None)
    if family not in FAMILIES:
        return None
    return module_for(family).block_spec(tconfig, vp_stage)


def init_extra(chunks, tconfig, seed: int) -> None:
    family = getattr(tconfig, "tidal_family", None)
    if family in FAMILIES:
        init = getattr(module_for(family), "init_extra", None)
        if init is not None:
            init(chunks, tconfig, seed)


def install_kernels(chunks, tconfig, kernels) -> None:
    """The family's own kernel choices (``trainer.kernels``) on the built chunks."""
    family = getattr(tconfig, "tidal_family", None)
    if family in FAMILIES:
        install = getattr(module_for(family), "install_kernels", None)
        if install is not None:
            install(chunks, kernels)
