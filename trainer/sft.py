"""``tidal sft``: supervised fine-tuning (NLL on response tokens) with the same trainer, under torchrun.

    torchrun --nproc-per-node N -m tidal.cli sft [CONFIG.yaml] [key=value ...]
        [--data ROWS] [--init HF_DIR] [--out DIR] [--lr LR] [--steps N] [--wall-s SECONDS]

Rows are JSONL or parquet with ``prompt`` (a string or chat messages) and ``response`` (a string), verl's SFT
columns; by default the task's own SFT file (the arithmetic task writes one). Prompts are tokenized by the
task (its chat template), responses get EOS. Each step trains ``broker.batch_groups * broker.group_size``
sequences (the RL batch size), sampled without replacement per epoch (seeded). Stops after ``--steps``
(default ``trainer.steps``) or ``--wall-s`` seconds, then writes ``<out>/hf`` (a Hugging Face directory with
the tokenizer) and ``<out>/metrics.jsonl``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.distributed as dist

from tidal.config import RunConfig
from tidal.errors import ConfigError
from tidal.trainer.flags import parse_flags


@dataclass
class SftOptions:
    data: str | None = None
    init: str | None = None
    out: str | None = None
    lr: float | None = None
    steps: int | None = None
    wall_s: float | None = None


_TYPES = {"lr": float, "steps": int, "wall_s": float}


def parse_options(args: list[str]) -> SftOptions:
    return parse_flags(
        args,
        SftOptions(),
        "tidal sft",
        "--data ROWS, --init HF_DIR, --out DIR, --lr LR, --steps N, --wall-s SECONDS",
        _TYPES,
    )


def load_samples(config: RunConfig, data: str | Path | None):
    """The SFT rows as samples (prompt ids, response ids ending with EOS)."""
    from tidal.broker.types import PromptRow, Sample
    from tidal.rollout.tasks import build_task, task_files
    from tidal.rollout.tasks.data import read_records

    path = Path(data) if data else task_files(config).sft
    if path is None:
        raise ConfigError(f"tidal sft: task {config.task.name} has no SFT file of its own; pass --data ROWS")
    task = build_task(config)
    samples = []
    for index, record in enumerate(read_records(path)):
        if "response" not in record or "prompt" not in record:
            raise ConfigError(f"{path} row {index}: SFT rows need 'prompt' and 'response' columns")
        prompt = task.prompt_ids(PromptRow(index=index, data_source=str(path), prompt=record["prompt"]))
        response = task.response_ids(str(record["response"]))
        n = len(response)
        samples.append(
            Sample(
                prompt_ids=np.asarray(prompt, np.int32),
                response_ids=np.asarray(response, np.int32),
                logprobs=np.zeros(n, np.float32),
                versions=np.zeros(n, np.int32),
                reward=0.0,
                finish_reason="stop",
            )
        )
    if not samples:
        raise ConfigError(f"tidal sft: {path} has no rows")
    return samples


def main(config: RunConfig, args: list[str]) -> int:
    from tidal.trainer.metrics import MetricsWriter
    from tidal.trainer.packing import SequenceItem
    from tidal.trainer.runner import TrainerRank
    from tidal.trainer.synthetic import make_loss

    opts = parse_options(args)
    if opts.lr is not None:
        config = config.model_copy(
            update={
                "trainer": config.trainer.model_copy(
                    update={"optimizer": config.trainer.optimizer.model_copy(update={"lr": opts.lr})}
                )
            }
        )
    steps = opts.steps or config.trainer.steps
    out = Path(opts.out) if opts.out else Path(config.run_dir) / "sft"
    samples = load_samples(config, opts.data)
    batch = min(config.broker.batch_groups * config.broker.group_size, len(samples))
    loss_config = config.trainer.loss.model_copy(update={"kind": "sft"})
    # an SFT step has no proximal pass and no reference model, whatever the RL settings say
    config = config.model_copy(update={"trainer": config.trainer.model_copy(update={"loss": loss_config})})
    trainer = TrainerRank(config, total_steps=steps, init_hf=opts.init)
    writer = MetricsWriter(out, tensorboard=False) if trainer.rank == 0 else None
    rng = np.random.default_rng(config.trainer.seed)
    order: list[int] = []
    started = time.monotonic()
    try:
        for step in range(1, steps + 1):
            if len(order) < batch:
                order.extend(rng.permutation(len(samples)).tolist())
            chosen, order = order[:batch], order[batch:]
            plan = trainer.plan([SequenceItem(samples[i]) for i in chosen])
            result = trainer.step(plan, make_loss("sft", loss_config, plan.normalizer))
            if writer is not None:
                writer.write(
                    step,
                    {
                        **result.stats,
                        "loss": result.loss,
                        "grad_norm": result.grad_norm,
                        "throughput/tokens_per_s": result.tokens / max(result.seconds, 1e-9),
                    },
                )
            elapsed = time.monotonic() - started
            stop = [opts.wall_s is not None and elapsed >= opts.wall_s]
            dist.broadcast_object_list(stop, src=0)
            if stop[0]:
                break
        from tidal.rollout.tasks import task_files

        trainer.export_hf(out / "hf", tokenizer_from=task_files(config).tokenizer)
        return 0
    finally:
        if writer is not None:
            writer.close()
        trainer.close()
