"""Declarative megatron-core <-> Hugging Face parameter mapping, shared by live sync and checkpoints.

A family is a table of ``Rule`` rows. Each row names one megatron-core tensor (its *full* form: the
tensor a model without tensor/expert parallelism holds, with global layer and expert ids), the Hugging
Face tensors it is made of, how they fuse (``fuse``) and how megatron-core splits the full tensor over
tensor-parallel ranks (``shard``). Names are patterns with ``{layer}`` and ``{expert}`` placeholders.

Sharding over ranks and pipeline stages lives in ``sharding.py``; this module only converts full
tensors between the two name spaces.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from tidal.model_config import ModelConfig
from tidal.weights_sync import bucket

# copy: one HF tensor, same layout. qkv: q/k/v -> megatron's per-group [q heads of group, k, v] rows.
# glu: gate/up -> rows [gate; up]. vocab: embedding or output rows, padded to the megatron vocab size.
Fuse = Literal["copy", "qkv", "glu", "vocab"]
# How megatron-core splits the full tensor over its tensor-parallel (or expert-tensor-parallel) group:
# replicated; column = dim 0; row = dim 1; column_glu = dim 0 of gate and of up separately.
Shard = Literal["replicated", "column", "row", "column_glu"]


@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: tuple[str, ...]
    fuse: Fuse = "copy"
    shard: Shard = "replicated"
    expert: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.fuse == "copy" and len(self.hf) != 1:
            raise ValueError(f"rule {self.megatron}: fuse=copy takes one HF tensor, got {self.hf}")
        if self.fuse == "qkv" and len(self.hf) != 3:
            raise ValueError(f"rule {self.megatron}: fuse=qkv takes q, k, v, got {self.hf}")
        if self.fuse == "glu" and len(self.hf) != 2:
            raise ValueError(f"rule {self.megatron}: fuse=glu takes gate, up, got {self.hf}")
        object.__setattr__(self, "expert", "{expert}" in self.megatron)


def _regex(pattern: str) -> re.Pattern[str]:
    out = re.escape(pattern)
    out = out.replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{expert\}", r"(?P<expert>\d+)")
    return re.compile(out + "$")


def _fill(pattern: str, ids: Mapping[str, int]) -> str:
    return pattern.format(**ids)


# Names that megatron-core's Transformer Engine spec uses for the same tensors as the local spec.
# Grouped experts (TEGroupedMLP) store ``linear_fc1.weight{e}`` instead of ``local_experts.{e}.linear_fc1.weight``.
_TE_ALIASES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(.*)\.self_attention\.linear_qkv\.layer_norm_weight$"), r"\1.input_layernorm.weight"),
    (re.compile(r"(.*)\.self_attention\.linear_q_proj\.layer_norm_weight$"), r"\1.input_layernorm.weight"),
    (
        re.compile(r"(.*)\.self_attention\.linear_q_down_proj\.layer_norm_weight$"),
        r"\1.input_layernorm.weight",
    ),
    (
        re.compile(r"(.*)\.self_attention\.linear_q_up_proj\.layer_norm_weight$"),
        r"\1.self_attention.q_layernorm.weight",
    ),
    (
        re.compile(r"(.*)\.self_attention\.linear_kv_up_proj\.layer_norm_weight$"),
        r"\1.self_attention.kv_layernorm.weight",
    ),
    (re.compile(r"(.*)\.mlp\.linear_fc1\.layer_norm_weight$"), r"\1.pre_mlp_layernorm.weight"),
    (
        re.compile(r"(.*)\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$"),
        r"\1.mlp.experts.local_experts.\3.\2.weight",
    ),
)


def canonical_name(name: str) -> str:
    """The local-spec name of a megatron-core tensor (TE fused-norm and grouped-expert names folded in)."""
    name = name.removeprefix("module.")
    for pattern, repl in _TE_ALIASES:
        if pattern.match(name):
            return pattern.sub(repl, name)
    return name


def grouped_expert_name(name: str) -> str:
    """``...local_experts.{e}.linear_fc1.weight`` -> ``...experts.linear_fc1.weight{e}`` (TEGroupedMLP)."""
    m = re.match(r"(.*)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", name)
    return f"{m[1]}.mlp.experts.{m[3]}.weight{m[2]}" if m else name


@dataclass
class Match:
    rule: Rule
    ids: dict[str, int]

    @property
    def megatron_name(self) -> str:
        return _fill(self.rule.megatron, self.ids)

    @functools.cached_property
    def hf_names(self) -> list[str]:
        return [_fill(p, self.ids) for p in self.rule.hf]


class WeightMapping:
    """One model family's rules bound to one architecture (head counts, vocab sizes, tying)."""

    def __init__(self, rules: Iterable[Rule], model: ModelConfig, padded_vocab_size: int | None = None):
        self.model = model
        self.padded_vocab_size = padded_vocab_size or model.vocab_size
        if self.padded_vocab_size < model.vocab_size:
            raise ValueError(
                f"padded_vocab_size={self.padded_vocab_size} is smaller than model.vocab_size={model.vocab_size}"
            )
        self.rules = [
            r for r in rules if not (model.tie_word_embeddings and r.megatron == "output_layer.weight")
        ]
        self._by_megatron = [(_regex(r.megatron), r) for r in self.rules]
        self._by_first_hf = [(_regex(r.hf[0]), r) for r in self.rules]
        self._hf_owner = [(_regex(p), r) for r in self.rules for p in r.hf]
        # a live sync looks up the same names at every sync: a regex scan over the rules each time
        # cost ~10 us a tensor
        self._matches: dict[str, Match | None] = {}

    # ---- name lookups -------------------------------------------------------------------------
    def match_megatron(self, name: str) -> Match | None:
        if name in self._matches:
            return self._matches[name]
        canonical, match = canonical_name(name), None
        for regex, rule in self._by_megatron:
            m = regex.match(canonical)
            if m:
                match = Match(rule, {k: int(v) for k, v in m.groupdict().items()})
                break
        self._matches[name] = match
        return match

    def rule_for(self, megatron_name: str) -> Match:
        match = self.match_megatron(megatron_name)
        if match is None:
            raise KeyError(
                f"megatron-core tensor {megatron_name!r} has no rule in the {self.model.family} mapping "
                f"(weights_sync/mapping_{self.model.family}.py): add one"
            )
        return match

    def is_hf_name(self, name: str) -> bool:
        return any(regex.match(name) for regex, _ in self._hf_owner)

    # ---- tensor conversion --------------------------------------------------------------------
    def to_hf(
        self, megatron_name: str, tensor: torch.Tensor, packable: bool = False
    ) -> list[tuple[str, torch.Tensor]]:
        """Full megatron-core tensor -> its Hugging Face tensors (views where the layout allows).

        ``packable``: q/k/v leave as ``bucket.GroupedRows`` instead of copies (for ``bucket.pack``,
        which then copies them once, into the bucket).
        """
        match = self.rule_for(megatron_name)
        names, fuse = match.hf_names, match.rule.fuse
        if fuse == "copy":
            return [(names[0], tensor)]
        if fuse == "vocab":
            return [(names[0], tensor[: self.model.vocab_size])]
        if fuse == "glu":
            gate, up = tensor.chunk(2, dim=0)
            return [(names[0], gate), (names[1], up)]
        if packable:
            q, k, v = (bucket.GroupedRows(t) for t in _qkv_groups(tensor, self.model))
        else:
            q, k, v = unfuse_qkv(tensor, self.model)
        return [(names[0], q), (names[1], k), (names[2], v)]

    def to_megatron(self, hf: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """Hugging Face state dict -> full megatron-core tensors. Every HF tensor must be used."""
        used: set[str] = set()
        for name in hf:
            for regex, rule in self._by_first_hf:
                m = regex.match(name)
                if not m:
                    continue
                match = Match(rule, {k: int(v) for k, v in m.groupdict().items()})
                parts = match.hf_names
                missing = [p for p in parts if p not in hf]
                if missing:
                    raise KeyError(f"{match.megatron_name} needs {missing}, absent from the checkpoint")
                used.update(parts)
                yield match.megatron_name, self._fuse(rule, [hf[p] for p in parts])
                break
        unused = sorted(set(hf) - used)
        if unused:
            raise KeyError(
                f"{len(unused)} Hugging Face tensors have no rule in the {self.model.family} mapping, "
                f"e.g. {unused[:3]}"
            )

    def _fuse(self, rule: Rule, parts: list[torch.Tensor]) -> torch.Tensor:
        if rule.fuse == "copy":
            return parts[0]
        if rule.fuse == "vocab":
            t = parts[0]
            if t.shape[0] != self.model.vocab_size:
                raise ValueError(
                    f"{rule.hf[0]}: {t.shape[0]} rows, expected model.vocab_size={self.model.vocab_size}"
                )
            pad = self.padded_vocab_size - t.shape[0]
            return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
        if rule.fuse == "glu":
            return torch.cat(parts, dim=0)
        return fuse_qkv(*parts, self.model)


def _qkv_dims(model: ModelConfig) -> tuple[int, int, int]:
    groups = model.num_key_value_heads
    return groups, model.num_attention_heads // groups, model.head_dim


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, model: ModelConfig) -> torch.Tensor:
    """q/k/v rows -> megatron-core's fused rows: for each query group, its q heads, then k, then v."""
    groups, per_group, head_dim = _qkv_dims(model)
    rest = q.shape[1:]
    expected = (groups * per_group * head_dim, groups * head_dim, groups * head_dim)
    if (q.shape[0], k.shape[0], v.shape[0]) != expected:
        raise ValueError(
            f"q/k/v rows {(q.shape[0], k.shape[0], v.shape[0])} do not match heads={groups * per_group}, "
            f"kv_heads={groups}, head_dim={head_dim} (expected {expected})"
        )
    fused = torch.cat(
        [
            q.reshape(groups, per_group * head_dim, *rest),
            k.reshape(groups, head_dim, *rest),
            v.reshape(groups, head_dim, *rest),
        ],
        dim=1,
    )
    return fused.reshape(-1, *rest)


def _qkv_groups(qkv: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views [groups, rows of the group, ...] of q, k and v in megatron's fused rows."""
    groups, per_group, head_dim = _qkv_dims(model)
    grouped = qkv.reshape(groups, (per_group + 2) * head_dim, *qkv.shape[1:])
    return grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)


def unfuse_qkv(qkv: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rest = qkv.shape[1:]
    q, k, v = _qkv_groups(qkv, model)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


# Rows every family shares: embeddings, final norm, output layer, the layer norms, attention output.
COMMON_RULES: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", "column"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), "vocab", "column"),
    Rule("decoder.layers.{layer}.input_layernorm.weight", ("model.layers.{layer}.input_layernorm.weight",)),
    Rule(
        "decoder.layers.{layer}.pre_mlp_layernorm.weight",
        ("model.layers.{layer}.post_attention_layernorm.weight",),
    ),
    Rule(
        "decoder.layers.{layer}.self_attention.linear_proj.weight",
        ("model.layers.{layer}.self_attn.o_proj.weight",),
        shard="row",
    ),
)

GQA_ATTENTION_RULES: tuple[Rule, ...] = (
    Rule(
        "decoder.layers.{layer}.self_attention.linear_qkv.weight",
        (
            "model.layers.{layer}.self_attn.q_proj.weight",
            "model.layers.{layer}.self_attn.k_proj.weight",
            "model.layers.{layer}.self_attn.v_proj.weight",
        ),
        "qkv",
        "column",
    ),
    Rule(
        "decoder.layers.{layer}.self_attention.q_layernorm.weight",
        ("model.layers.{layer}.self_attn.q_norm.weight",),
    ),
    Rule(
        "decoder.layers.{layer}.self_attention.k_layernorm.weight",
        ("model.layers.{layer}.self_attn.k_norm.weight",),
    ),
)

DENSE_MLP_RULES: tuple[Rule, ...] = (
    Rule(
        "decoder.layers.{layer}.mlp.linear_fc1.weight",
        ("model.layers.{layer}.mlp.gate_proj.weight", "model.layers.{layer}.mlp.up_proj.weight"),
        "glu",
        "column_glu",
    ),
    Rule(
        "decoder.layers.{layer}.mlp.linear_fc2.weight",
        ("model.layers.{layer}.mlp.down_proj.weight",),
        shard="row",
    ),
)

ROUTED_EXPERT_RULES: tuple[Rule, ...] = (
    Rule("decoder.layers.{layer}.mlp.router.weight", ("model.layers.{layer}.mlp.gate.weight",)),
    Rule(
        "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight",
        (
            "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
            "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
        ),
        "glu",
        "column_glu",
    ),
    Rule(
        "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc2.weight",
        ("model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",),
        shard="row",
    ),
)
