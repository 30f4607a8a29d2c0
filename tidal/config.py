"""The run's configuration: composes each component's own config model."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tidal.broker.config import BrokerConfig
from tidal.model_config import ModelConfig
from tidal.rollout.config import RolloutConfig, TaskConfig
from tidal.trainer.config import TrainerConfig
from tidal.trainer.mesh import mesh_errors
from tidal.weights_sync.config import WeightSyncConfig


class WarmupConfig(BaseModel):
    """The supervised warm-up that ``tidal run`` gives the model before RL (``tidal sft``)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool | None = Field(
        None,
        description="None: warm up when there are demonstrations (warmup.data, or the task's own: arithmetic "
        "writes them); false: GRPO starts from the initial model (model.path, e.g. an instruct checkpoint)",
    )
    data: str | None = Field(
        None,
        description="demonstrations for the warm-up: {prompt, response} rows, JSONL or parquet; None: the "
        "task's own",
    )
    steps: int = Field(250, ge=1)
    lr: float = Field(1e-3, gt=0)
    schedule: Literal["constant", "cosine", "linear"] = Field(
        "cosine", description="anneal to zero, so that RL gains are not continued-SFT gains"
    )
    warmup_steps: int = Field(10, ge=0)
    batch_size: int | None = Field(
        None,
        ge=1,
        description="sequences per warm-up step, a multiple of broker.group_size; None: the RL batch",
    )


class GpuConfig(BaseModel):
    """Which GPUs ``tidal run`` gives each process when ``device: cuda`` (indices among the visible GPUs)."""

    model_config = ConfigDict(extra="forbid")

    trainer: list[int] | None = Field(
        None, description="one GPU per trainer rank; None: GPUs 0 .. trainer.nproc - 1"
    )
    engines: list[int] | None = Field(
        None,
        description="GPUs of the rollout nodes, node i on engines[i % len(engines)]; None: the GPUs the "
        "trainer does not use, or, when it uses them all, the trainer's first GPU (colocated: weights by "
        "CUDA IPC, engines asleep while the trainer steps)",
    )


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "tidal"
    run_dir: str = Field("runs/tiny", description="everything the run writes goes here")
    seed: int = 0
    device: Literal["cpu", "cuda"] = "cpu"
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    broker: BrokerConfig = BrokerConfig()
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    weights_sync: WeightSyncConfig = WeightSyncConfig()
    warmup: WarmupConfig = WarmupConfig()
    gpus: GpuConfig = GpuConfig()

    def journal_dir(self) -> Path:
        """Where the broker journals: ``broker.journal.dir``, else ``<run_dir>/journal``."""
        return Path(self.broker.journal.dir or Path(self.run_dir) / "journal")

    @model_validator(mode="after")
    def _check_warmup_batch(self) -> RunConfig:
        size = self.warmup.batch_size
        if size is not None and size % self.broker.group_size:
            raise ValueError(
                f"warmup.batch_size={size} must be a multiple of broker.group_size={self.broker.group_size}"
            )
        return self

    @model_validator(mode="after")
    def _check_group_size(self) -> RunConfig:
        if self.trainer.loss.kind == "grpo" and self.broker.group_size < 2:
            raise ValueError(
                f"broker.group_size={self.broker.group_size} must be >= 2 with trainer.loss.kind=grpo: a "
                "sample's advantage is its reward against its group's mean, which a group of one always "
                "equals, so every advantage would be 0 and nothing would be learned"
            )
        return self

    @model_validator(mode="after")
    def _check_mesh(self) -> RunConfig:
        errors = mesh_errors(
            self.trainer.mesh, self.trainer.nproc * self.trainer.nnodes, self.model.resolved()
        )
        if errors:
            raise ValueError("; ".join(errors))
        return self
