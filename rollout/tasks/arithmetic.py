"""Synthetic addition with fixed-width operands (``07+45=`` -> ``52``) for the default job and tests.

Data is generated locally, deterministic by seed; eval pairs never appear in train. When the train set
asks for more rows than there are distinct non-eval pairs (2 digits: 9,500 after 500 eval), it cycles
through them, reshuffled each pass, so every pair is seen before any repeats.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tidal.broker.types import PromptRow
from tidal.rollout.tasks.base import Task

DATA_SOURCE = "arithmetic"
_ENUMERATE_LIMIT = 1 << 22  # operand-pair spaces up to this size are permuted outright


def _pair_indices(digits: int, num_train: int, num_eval: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    total = 10 ** (2 * digits)
    if num_eval >= total:
        raise ValueError(
            f"task.num_eval={num_eval} leaves no training pairs: {digits}-digit addition has only "
            f"{total} distinct problems; lower task.num_eval or raise task.digits"
        )
    rng = np.random.default_rng(seed)
    if total <= _ENUMERATE_LIMIT:
        perm = rng.permutation(total)
        eval_idx, rest = perm[:num_eval], perm[num_eval:]
        passes = -(-num_train // rest.size)
        train_idx = np.concatenate([rng.permutation(rest) for _ in range(passes)])[:num_train]
        return train_idx, eval_idx
    eval_set: set[int] = set()
    while len(eval_set) < num_eval:
        eval_set.update(int(i) for i in rng.integers(0, total, num_eval - len(eval_set)))
    eval_idx = np.array(sorted(eval_set), dtype=np.int64)
    rng.shuffle(eval_idx)
    train: list[int] = []
    while len(train) < num_train:
        train.extend(int(i) for i in rng.integers(0, total, num_train - len(train)) if int(i) not in eval_set)
    return np.array(train, dtype=np.int64), eval_idx


def problem(a: int, b: int, digits: int) -> tuple[str, str]:
    """(prompt, answer) of ``a + b`` with zero-padded operands."""
    return f"{a:0{digits}d}+{b:0{digits}d}=", str(a + b)


def make_records(
    digits: int, num_train: int, num_eval: int, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """verl records (train, eval) of fixed-width addition."""
    space = 10**digits
    out = []
    for split, indices in zip(
        ("train", "eval"), _pair_indices(digits, num_train, num_eval, seed), strict=True
    ):
        records = []
        for i, pair in enumerate(indices.tolist()):
            a, b = divmod(pair, space)
            prompt, answer = problem(a, b, digits)
            records.append(
                {
                    "data_source": DATA_SOURCE,
                    "prompt": prompt,
                    "ability": "arithmetic",
                    "reward_model": {"style": "rule", "ground_truth": answer},
                    "extra_info": {"split": split, "index": i, "a": a, "b": b},
                }
            )
        out.append(records)
    return out[0], out[1]


def sft_records(train_records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Warm-up rows: the prompt and its answer (``{"prompt", "response"}``, verl's SFT columns)."""
    return [
        {"prompt": r["prompt"], "response": r["reward_model"]["ground_truth"], "extra_info": r["extra_info"]}
        for r in train_records
    ]


class ArithmeticTask(Task):
    """Binary exact-match reward on the decoded answer."""

    name = "arithmetic"
    default_reward = "tidal.rollout.rewards:exact_match"

    def prompt_ids(self, row: PromptRow) -> list[int]:
        if not isinstance(row.prompt, str):
            raise ValueError(
                f"arithmetic row {row.index}: prompt must be a string like '07+45=', got {row.prompt!r}"
            )
        return super().prompt_ids(row)
