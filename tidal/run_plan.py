"""What ``tidal run`` starts from and which phases it runs, decided before it writes anything.

- The initial model: ``model.path`` (your Hugging Face checkpoint, read where it lies), or without one a
  seeded initialisation of ``model.*`` that the launcher writes to ``<run_dir>/init_hf``.
- The supervised warm-up (``tidal sft`` from the initial model): with ``warmup.enabled`` unset, whenever
  there are demonstrations (``warmup.data``, or the task's own: the arithmetic task writes them with its
  data). GRPO starts from the warm-up's checkpoint, or without a warm-up from the initial model.
- The evaluation, on held-out rows (``task.eval_path``, or the task's own) where there are any: the model
  GRPO started from against GRPO's result, and the SFT control (continued SFT for GRPO's wall time) only
  after a warm-up, which it continues.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tidal.config import RunConfig
from tidal.errors import ConfigError
from tidal.model_config import has_hf_weights
from tidal.rollout.tasks import task_files


@dataclass(frozen=True)
class RunPlan:
    initial: Path  # the model the warm-up, or without one GRPO, starts from
    writes_initial: bool  # the launcher initialises it (no model.path)
    warmup: bool
    demonstrations: Path | None  # the warm-up's {prompt, response} rows
    eval_rows: Path | None  # held-out verl rows; None: no evaluation

    def start(self, sft_hf: Path) -> Path:
        """The Hugging Face directory GRPO starts from, given where the warm-up writes its checkpoint."""
        return sft_hf if self.warmup else self.initial

    @property
    def start_name(self) -> str:
        """The report's name for that model."""
        return "sft" if self.warmup else "initial"


def plan_run(config: RunConfig, run_dir: Path, init_hf: Path) -> RunPlan:
    """The plan for ``config`` in ``run_dir`` (``init_hf``: where the launcher would write an initial model);
    a ConfigError naming the setting when it cannot be carried out."""
    files = task_files(config, run_dir)
    path = config.model.path
    if path and not has_hf_weights(path):
        raise ConfigError(
            f"model.path={path}: no model.safetensors or model.safetensors.index.json there; tidal reads "
            "safetensors weights (transformers' save_pretrained writes them)"
        )
    if config.warmup.data and not Path(config.warmup.data).exists():
        raise ConfigError(f"warmup.data={config.warmup.data}: file does not exist")
    enabled = config.warmup.enabled
    if enabled and files.sft is None:
        why = (
            "the arithmetic task writes demonstrations only with the data it generates, and broker.data.path "
            "is set"
            if config.task.name == "arithmetic"
            else f"task.name={config.task.name} has no demonstrations of its own"
        )
        raise ConfigError(
            f"warmup.enabled=true: {why}; set "
            "warmup.data to {prompt, response} rows (JSONL or parquet), or warmup.enabled=false to start "
            "GRPO from the initial model"
        )
    return RunPlan(
        initial=Path(path) if path else init_hf,
        writes_initial=not path,
        warmup=files.sft is not None if enabled is None else enabled,
        demonstrations=files.sft,
        eval_rows=files.eval,
    )
