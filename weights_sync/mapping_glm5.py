"""GLM-5 (``glm_moe_dsa``): DeepSeek-V3's layout (MLA, dense leading layers, routed + shared experts) plus
the DeepSeek sparse attention indexer of every layer.

megatron-core keeps the indexer inside the attention's core (``core_attention.indexer``) with the same
tensors as Hugging Face's ``self_attn.indexer``: ``wq_b`` (from the query latent), ``wk``, the key's
LayerNorm (weight and bias) and ``weights_proj`` (per-head weights). Every rank holds them in full.
"""

from __future__ import annotations

from tidal.weights_sync.mapping import Rule
from tidal.weights_sync.mapping_deepseek_v3 import RULES as DEEPSEEK_V3_RULES


def _indexer(megatron: str, hf: str) -> Rule:
    return Rule(
        f"decoder.layers.{{layer}}.self_attention.core_attention.indexer.{megatron}",
        (f"model.layers.{{layer}}.self_attn.indexer.{hf}",),
    )


INDEXER_RULES: tuple[Rule, ...] = (
    _indexer("linear_wq_b.weight", "wq_b.weight"),
    _indexer("linear_wk.weight", "wk.weight"),
    _indexer("k_norm.weight", "k_norm.weight"),
    _indexer("k_norm.bias", "k_norm.bias"),
    _indexer("linear_weights_proj.weight", "weights_proj.weight"),
)

RULES: tuple[Rule, ...] = DEEPSEEK_V3_RULES + INDEXER_RULES
