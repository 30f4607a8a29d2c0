"""The train loop's handle on weight sync: one per trainer rank, built from megatron's parallel state.

sync = TrainerWeightSync(config.weights_sync, config.model, chunks, engines)
...
report = sync.after_step(step, version)   # every ``every_steps`` steps; collective over all ranks
"""

from __future__ import annotations

import socket

import torch

from tidal.model_config import ModelConfig
from tidal.weights_sync.colocated import ColocatedSender, resolve_transport
from tidal.weights_sync.config import WeightSyncConfig
from tidal.weights_sync.engine_api import EngineEndpoint
from tidal.weights_sync.families import mapping_for
from tidal.weights_sync.gather import GatherTimes, Groups, iter_hf
from tidal.weights_sync.sender import SyncReport, WeightSender


class TrainerWeightSync:
    def __init__(
        self,
        config: WeightSyncConfig,
        model: ModelConfig,
        chunks: list[torch.nn.Module],
        engines: list[EngineEndpoint],
        *,
        export_dtype: torch.dtype | None = None,
    ):
        from megatron.core import parallel_state as ps

        self.config = config
        self.chunks = chunks
        self.mapping = mapping_for(model.resolved())
        self.export_dtype = export_dtype
        self.times = GatherTimes()
        # the stage's sender holds every shard after the TP / EP all-gathers: tp, cp and dp rank 0
        is_sender = (
            ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank(with_context_parallel=True) == 0
        )
        cuda = torch.cuda.is_available() and next(chunks[0].parameters()).is_cuda
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        # colocated (engines on this GPU): CUDA IPC handles instead of a collective group
        self.transport = resolve_transport(config, engines, device)
        if self.transport == "cuda_ipc":
            self.sender = ColocatedSender(
                config,
                engines,
                device=device,
                stage=ps.get_pipeline_model_parallel_rank(),
                is_sender=is_sender,
            )
        else:
            self.sender = WeightSender(
                config,
                engines,
                stage=ps.get_pipeline_model_parallel_rank(),
                stages=ps.get_pipeline_model_parallel_world_size(),
                is_sender=is_sender,
                backend="nccl" if cuda else "gloo",
                master_address=config.master_address or _host_address(),
                device=device,
            )

    def set_engines(self, engines: list[EngineEndpoint]) -> None:
        """Membership changed: the next sync rebuilds the group and sends everything to the new set."""
        self.sender.set_engines(engines)

    @property
    def engines(self) -> list[str]:
        """The engines the next sync sends to (the set given, less those a sync dropped since)."""
        return self.sender.engines

    def sync(self, version: int) -> SyncReport:
        self.times = GatherTimes()
        return self.sender.sync(
            lambda: iter_hf(
                self.chunks,
                self.mapping,
                Groups.from_megatron(),
                self.times,
                self.export_dtype,
                packable=True,
            ),
            version,
        )

    def before_step(self) -> None:
        """Colocated with ``colocated_sleep``: the engines give their GPU memory back while this rank trains."""
        if self.transport == "cuda_ipc" and self.config.colocated_sleep:
            self.sender.sleep()

    def after_step(self, step: int, version: int) -> SyncReport | None:
        if step % self.config.every_steps == 0:
            return self.sync(version)  # a colocated sync wakes sleeping engines first
        if self.transport == "cuda_ipc":
            self.sender.wake()
        return None

    def close(self) -> None:
        self.sender.close()


def _host_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
