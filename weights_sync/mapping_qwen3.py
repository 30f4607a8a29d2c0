"""Qwen3 dense: grouped-query attention with QK norm, SwiGLU MLP."""

from __future__ import annotations

from tidal.weights_sync.mapping import COMMON_RULES, DENSE_MLP_RULES, GQA_ATTENTION_RULES, Rule

RULES: tuple[Rule, ...] = COMMON_RULES + GQA_ATTENTION_RULES + DENSE_MLP_RULES
