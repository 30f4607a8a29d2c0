"""Sampling parameters (SGLang's names and defaults) and batched next-token sampling with logprobs.

The returned logprob of a sampled token is ``log_softmax(logits / temperature)`` (plain ``log_softmax``
when greedy), before top-k / top-p truncation: the distribution an RL trainer recomputes from the same
logits and temperature.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# SGLang treats temperatures below this as greedy (top_k = 1).
GREEDY_EPS = 1e-6
_SUPPORTED = {
    "max_new_tokens",
    "stop_token_ids",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "ignore_eos",
    "sampling_seed",
    "n",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stop",
    "min_new_tokens",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
}
# parameters accepted only at their neutral value (SGLang features the embedded engine does not implement)
_NEUTRAL: dict[str, Any] = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "logit_bias": {},
    "stop": None,
}


class SamplingError(ValueError):
    pass


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None, vocab_size: int) -> SamplingParams:
        raw = dict(raw or {})
        unknown = sorted(set(raw) - _SUPPORTED)
        if unknown:
            raise SamplingError(
                f"sampling_params: unsupported key(s) {unknown} for the embedded engine; "
                f"supported: {sorted(_SUPPORTED)}"
            )
        for key, neutral in _NEUTRAL.items():
            if key in raw and raw[key] not in (neutral, None):
                raise SamplingError(
                    f"sampling_params.{key}={raw[key]!r} is not supported by the embedded engine "
                    f"(only {neutral!r})"
                )
        p = cls()
        if raw.get("max_new_tokens") is not None:
            p.max_new_tokens = _int(raw, "max_new_tokens", minimum=0)
        if raw.get("temperature") is not None:
            p.temperature = _float(raw, "temperature")
            if p.temperature < 0:
                raise SamplingError(f"sampling_params.temperature={p.temperature} must be >= 0")
        if raw.get("top_p") is not None:
            p.top_p = _float(raw, "top_p")
            if not 0 < p.top_p <= 1:
                raise SamplingError(f"sampling_params.top_p={p.top_p} must be in (0, 1]")
        if raw.get("top_k") is not None:
            p.top_k = _int(raw, "top_k", minimum=None)
            if p.top_k == 0 or p.top_k < -1:
                raise SamplingError(f"sampling_params.top_k={p.top_k} must be -1 (off) or >= 1")
            if p.top_k >= vocab_size:
                p.top_k = -1
        if raw.get("stop_token_ids") is not None:
            ids = raw["stop_token_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise SamplingError(f"sampling_params.stop_token_ids={ids!r} must be a list of integers")
            p.stop_token_ids = ids
        if raw.get("ignore_eos") is not None:
            p.ignore_eos = bool(raw["ignore_eos"])
        if raw.get("sampling_seed") is not None:
            p.sampling_seed = _int(raw, "sampling_seed", minimum=None)
        if raw.get("n") is not None:
            p.n = _int(raw, "n", minimum=1)
        return p


def _int(raw: dict[str, Any], key: str, minimum: int | None) -> int:
    v = raw[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise SamplingError(f"sampling_params.{key}={v!r} must be an integer")
    if minimum is not None and v < minimum:
        raise SamplingError(f"sampling_params.{key}={v} must be >= {minimum}")
    return v


def _float(raw: dict[str, Any], key: str) -> float:
    v = raw[key]
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise SamplingError(f"sampling_params.{key}={v!r} must be a number")
    return float(v)


def _truncate(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero the probabilities outside top-k / the top-p nucleus of one row (keeps at least one token)."""
    if top_k > 0:
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs < kth, 0.0, probs)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop = (cum - sorted_probs) > top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens and their logprobs for a ``[rows, vocab]`` float32 logits batch."""
    logits = logits.float()
    if all(p.greedy for p in params):
        logprobs = torch.log_softmax(logits, dim=-1)  # what dividing by temperature 1 gives, one op less
    else:
        temps = torch.tensor(
            [1.0 if p.greedy else p.temperature for p in params], device=logits.device, dtype=logits.dtype
        )
        logprobs = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        probs = logprobs[sampled_rows].exp()
        plain = all(params[i].top_k <= 0 and params[i].top_p >= 1.0 for i in sampled_rows)
        if not plain:
            probs = torch.stack(
                [_truncate(probs[j], params[i].top_k, params[i].top_p) for j, i in enumerate(sampled_rows)]
            )
        unseeded = [j for j, i in enumerate(sampled_rows) if generators[i] is None]
        if len(unseeded) == len(params):  # every row sampled without a seed: one draw, no scatter
            tokens = torch.multinomial(probs, 1).squeeze(1)
        elif unseeded:
            picks = torch.multinomial(probs[unseeded], 1).squeeze(1)
            rows = torch.tensor([sampled_rows[j] for j in unseeded], device=logits.device)
            tokens[rows] = picks  # one scatter on the device (no host read of the picks)
        for j, i in enumerate(sampled_rows):
            if generators[i] is not None:
                tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i]).item()
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return tokens, chosen
