"""The task interface: a prompt source, how a row becomes prompt token ids, and a reward function."""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tidal.broker.types import PromptRow
from tidal.rollout.config import TaskConfig
from tidal.rollout.rewards import (
    call_reward,
    is_async,
    load_reward_fn,
    overlong_penalty,
    score_in_worker,
)


@dataclass
class Score:
    reward: float  # what the trainer sees: the reward function's score plus any overlong penalty
    metrics: dict[str, float] = field(default_factory=dict)


class Task:
    """A task over verl rows; subclasses pick the reward and may generate their own data.

    ``tokenizer`` is a Hugging Face tokenizer. A row's ``prompt`` is either a plain string (tokenized as
    is, with the tokenizer's own special tokens) or a list of chat messages (rendered with the tokenizer's
    chat template and a generation prompt).
    """

    name: ClassVar[str]
    default_reward: ClassVar[str | None] = None  # import path of the task's own reward

    def __init__(self, config: TaskConfig, tokenizer: Any, max_new_tokens: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        spec = config.reward or self.default_reward
        if spec is None:
            raise ValueError(f"task {self.name!r} has no reward of its own; set task.reward=module:function")
        self.reward_spec = spec
        self.reward_fn = load_reward_fn(spec)
        overlong_penalty(0, max_new_tokens, config.overlong_buffer, 0.0)  # fails early on a bad buffer
        self._pool: ProcessPoolExecutor | None = None
        if config.reward_workers > 0 and not is_async(self.reward_fn):
            # spawn, not fork: the agent has ZeroMQ and HTTP threads that a fork would copy half-alive
            self._pool = ProcessPoolExecutor(
                config.reward_workers, mp_context=multiprocessing.get_context("spawn")
            )

    # --- token ids -------------------------------------------------------------------------------

    def prompt_ids(self, row: PromptRow) -> list[int]:
        return render_prompt(self.tokenizer, row)

    def response_ids(self, response: str) -> list[int]:
        """A reference response as token ids ending with EOS (for SFT rows)."""
        ids = list(self.tokenizer(response, add_special_tokens=False)["input_ids"])
        return [*ids, self.tokenizer.eos_token_id]

    @property
    def stop_token_ids(self) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return [] if eos is None else [int(eos)]

    def decode(self, response_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(response_ids), skip_special_tokens=True)

    # --- reward ----------------------------------------------------------------------------------

    async def score(self, row: PromptRow, response_ids: Sequence[int]) -> Score:
        """The reward of one response to ``row``: the reward function's score plus DAPO's overlong penalty."""
        kwargs = {
            "data_source": row.data_source,
            "solution_str": self.decode(response_ids),
            "ground_truth": row.ground_truth,
            "extra_info": row.extra_info,
        }
        if self._pool is not None:
            loop = asyncio.get_running_loop()
            value, metrics = await loop.run_in_executor(self._pool, score_in_worker, self.reward_spec, kwargs)
        else:
            value, metrics = await call_reward(self.reward_fn, **kwargs)
        penalty = overlong_penalty(
            len(response_ids), self.max_new_tokens, self.config.overlong_buffer, self.config.overlong_penalty
        )
        metrics = {**metrics, "score": value}
        if self.config.overlong_buffer:
            metrics["overlong_penalty"] = penalty
        return Score(reward=value + penalty, metrics=metrics)

    def close(self) -> None:
        if self._pool is not None:
            # wait: a pool shut down without waiting can leave its spawned workers orphaned
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def render_prompt(tokenizer: Any, row: PromptRow) -> list[int]:
    """A row's prompt as token ids: a plain string tokenized as is (with the tokenizer's own special tokens),
    a list of chat messages rendered with the tokenizer's chat template and a generation prompt."""
    prompt = row.prompt
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, Sequence) and all(isinstance(m, dict) for m in prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"row {row.index} ({row.data_source}) has chat messages but the tokenizer has no chat "
                "template; give plain-string prompts or a tokenizer with a chat template (task.tokenizer)"
            )
        ids = tokenizer.apply_chat_template(
            list(prompt), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)
    raise ValueError(
        f"row {row.index} ({row.data_source}): prompt must be a string or a list of chat messages "
        f"({{'role', 'content'}}), got {type(prompt).__name__}"
    )
