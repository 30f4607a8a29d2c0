"""Qwen3-MoE: Qwen3 attention, every layer a routed-expert MLP (no shared experts)."""

from __future__ import annotations

from tidal.weights_sync.mapping import COMMON_RULES, GQA_ATTENTION_RULES, ROUTED_EXPERT_RULES, Rule

RULES: tuple[Rule, ...] = COMMON_RULES + GQA_ATTENTION_RULES + ROUTED_EXPERT_RULES
