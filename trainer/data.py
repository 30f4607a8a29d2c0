"""SFT data: verl-format rows from parquet or JSONL, tokenised into packable items, batched by step.

Row layouts (verl's SFT data sets):

- single turn: a prompt and a response column, found by dotted keys: ``prompt`` / ``response`` (verl's
  defaults, and what ``tidal``'s arithmetic task writes), or ``extra_info.question`` /
  ``extra_info.answer`` for verl's GSM8K parquet;
- multi-turn: a ``messages`` column of chat messages; the final assistant message is trained on, the
  conversation before it is the prompt (earlier assistant turns are context, not trained on).

Tokenisation follows the rollout tasks so that SFT trains what RL later samples: a string prompt is
tokenised as is (with the tokenizer's special tokens), a list of messages through the chat template with a
generation prompt; the response is its tokens plus EOS. Batches are a pure function of
``(seed, step)``, so a resumed run continues with exactly the next batch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from tidal.broker.types import Sample
from tidal.trainer.packing import SequenceItem


class SFTDataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(..., description="a .parquet or .jsonl file of verl-format rows")
    prompt_key: str = Field("prompt", description="dotted path of the prompt, e.g. extra_info.question")
    response_key: str = Field("response", description="dotted path of the response, e.g. extra_info.answer")
    messages_key: str | None = Field(None, description="dotted path of a chat; set to use multi-turn rows")
    max_length: int | None = Field(None, ge=2, description="prompt + response tokens; None: no limit")
    truncation: Literal["error", "right"] = Field(
        "error", description="over max_length: fail, or cut the response"
    )
    batch_size: int = Field(32, ge=1, description="sequences per optimizer step")
    shuffle: bool = True
    seed: int = 0


@dataclass
class SFTRow:
    index: int
    prompt: Any  # a string or a list of chat messages
    response: str


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Raw rows of a parquet or JSONL file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"SFT data file {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        records = []
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}: line {lineno} is not JSON ({exc})") from None
        return records
    raise ValueError(f"SFT data file {path}: unknown format {path.suffix!r}; use .parquet or .jsonl")


def _lookup(record: dict[str, Any], dotted: str, index: int) -> Any:
    node: Any = record
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(f"SFT row {index} has no {dotted!r} (missing {part!r}); columns: {sorted(record)}")
        node = node[part]
    return node


def rows_from_records(records: Sequence[dict[str, Any]], config: SFTDataConfig) -> list[SFTRow]:
    rows = []
    for i, rec in enumerate(records):
        if config.messages_key is not None:
            messages = _lookup(rec, config.messages_key, i)
            if not messages or not isinstance(messages[-1], dict) or messages[-1].get("role") != "assistant":
                raise ValueError(f"SFT row {i}: {config.messages_key!r} must end with an assistant message")
            rows.append(SFTRow(i, list(messages[:-1]), str(messages[-1]["content"])))
        else:
            response = _lookup(rec, config.response_key, i)
            if not isinstance(response, str):
                raise ValueError(
                    f"SFT row {i}: {config.response_key!r} must be a string, got {type(response).__name__}"
                )
            rows.append(SFTRow(i, _lookup(rec, config.prompt_key, i), response))
    if not rows:
        raise ValueError(f"SFT data {config.path} has no rows")
    return rows


def encode_prompt(tokenizer: Any, prompt: Any, index: int = -1) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, Sequence) and all(isinstance(m, dict) for m in prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"SFT row {index} holds chat messages but the tokenizer has no chat template")
        return list(
            tokenizer.apply_chat_template(
                list(prompt), add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    raise ValueError(
        f"SFT row {index}: prompt must be a string or chat messages, got {type(prompt).__name__}"
    )


def encode_response(tokenizer: Any, response: str) -> list[int]:
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token; SFT responses must end with one")
    return [*tokenizer(response, add_special_tokens=False)["input_ids"], int(tokenizer.eos_token_id)]


def tokenize_row(row: SFTRow, tokenizer: Any, config: SFTDataConfig) -> SequenceItem:
    prompt = encode_prompt(tokenizer, row.prompt, row.index)
    response = encode_response(tokenizer, row.response)
    if config.max_length is not None and len(prompt) + len(response) > config.max_length:
        if config.truncation == "error" or len(prompt) >= config.max_length:
            raise ValueError(
                f"SFT row {row.index} has {len(prompt)} prompt + {len(response)} response tokens, over "
                f"max_length={config.max_length}; raise max_length or set truncation=right"
            )
        response = response[: config.max_length - len(prompt)]
    r = len(response)
    sample = Sample(
        prompt_ids=np.asarray(prompt, dtype=np.int32),
        response_ids=np.asarray(response, dtype=np.int32),
        logprobs=np.zeros(r, dtype=np.float32),
        versions=np.zeros(r, dtype=np.int32),
        reward=0.0,
        finish_reason="stop",
    )
    return SequenceItem(sample)


class SFTDataset:
    """Tokenised SFT items with step-addressed batches (drop-last within each epoch)."""

    def __init__(self, config: SFTDataConfig, tokenizer: Any):
        self.config = config
        rows = rows_from_records(read_records(config.path), config)
        self.items = [tokenize_row(r, tokenizer, config) for r in rows]
        if len(self.items) < config.batch_size:
            raise ValueError(
                f"SFT data {config.path} has {len(self.items)} rows, fewer than batch_size={config.batch_size}"
            )

    @property
    def steps_per_epoch(self) -> int:
        return len(self.items) // self.config.batch_size

    def batch(self, step: int) -> list[SequenceItem]:
        """The batch of optimizer step ``step`` (0-based); epochs reshuffle with ``(seed, epoch)``."""
        epoch, k = divmod(step, self.steps_per_epoch)
        n = len(self.items)
        order = (
            np.random.default_rng([self.config.seed, epoch]).permutation(n)
            if self.config.shuffle
            else np.arange(n)
        )
        bs = self.config.batch_size
        return [self.items[int(i)] for i in order[k * bs : (k + 1) * bs]]
