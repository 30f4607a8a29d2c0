"""GSM8K-style math on the user's verl rows, scored with math-verify.

``gsm8k_record`` turns an original GSM8K row (``question``, ``answer`` ending in ``#### 72``) into a verl
row the way verl's preprocessing does: the instruction asks for the final answer after ``####``.
"""

from __future__ import annotations

from typing import Any

from tidal.rollout.tasks.base import Task

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_record(question: str, answer: str, index: int, split: str = "train") -> dict[str, Any]:
    if "####" not in answer:
        raise ValueError(f"GSM8K row {index}: the answer has no '#### <number>' line: {answer[-80:]!r}")
    ground_truth = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


class Gsm8kTask(Task):
    name = "gsm8k"
    default_reward = "tidal.rollout.rewards:math_verify_score"


class CustomTask(Task):
    """verl rows scored by the user's ``task.reward``."""

    name = "custom"
