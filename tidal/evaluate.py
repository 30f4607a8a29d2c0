"""Held-out greedy accuracy of a Hugging Face model directory on a task's eval rows.

Used by the default job to compare the SFT checkpoint, the GRPO result and the SFT control. It runs
transformers' own greedy ``generate`` in-process, so the figure does not depend on tidal's engine.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.broker.types import PromptRow


@dataclass
class EvalResult:
    accuracy: float
    mean_reward: float
    n: int

    def as_dict(self) -> dict[str, float]:
        return {"accuracy": self.accuracy, "mean_reward": self.mean_reward, "n": self.n}


@torch.no_grad()
def greedy_responses(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int | None,
    pad_id: int,
    batch_size: int = 256,
) -> list[list[int]]:
    """Greedy continuations (left-padded batches), each cut after its first EOS."""
    out: list[list[int]] = []
    device = next(model.parameters()).device
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        gen = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
        )
        for row in gen[:, width:].tolist():
            if eos_id is not None and eos_id in row:
                row = row[: row.index(eos_id) + 1]
            out.append(row)
    return out


def evaluate_dir(
    model_dir: str | Path, task, rows: list[PromptRow], max_new_tokens: int, device: str = "cpu"
) -> EvalResult:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    tok = task.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    prompts = [task.prompt_ids(r) for r in rows]
    responses = greedy_responses(model, prompts, max_new_tokens, tok.eos_token_id, pad)

    async def score_all():
        return await asyncio.gather(*(task.score(r, resp) for r, resp in zip(rows, responses, strict=True)))

    scores = asyncio.run(score_all())
    rewards = [s.reward for s in scores]
    correct = [s.metrics.get("score", s.reward) > 0 for s in scores]
    n = len(rows)
    return EvalResult(accuracy=sum(correct) / max(n, 1), mean_reward=sum(rewards) / max(n, 1), n=n)
