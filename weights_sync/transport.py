"""Collective groups between trainer sender ranks and engine ranks, outside torch's default group.

A trainer under torchrun already owns torch.distributed's default group, and an engine may own its
own; the weight-update group is a separate, standalone process group built from a TCP store, as
SGLang's ``init_weights_update_group`` does. Rank 0 is always the sender (one group per sender).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class WeightGroup:
    name: str
    rank: int
    world_size: int
    backend: str
    pg: dist.ProcessGroup
    store: dist.Store

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast ``tensor`` in place from group rank ``src`` (blocking)."""
        self.broadcast_async(tensor, src).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        """Start broadcasting ``tensor``; ``wait()`` on the result (gloo: until it is done; NCCL: orders
        the current stream after it). Ranks match broadcasts by the order in which they start them, so
        every rank must start the same broadcasts in the same order (one thread at a time); several may
        be in flight, so the next one's receive is posted while the current one's bytes move."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return self.pg.broadcast([tensor], opts)

    def barrier(self) -> None:
        """Return once every rank reached it (on CUDA: and the work queued before it has finished)."""
        if self.backend == "nccl":
            torch.cuda.synchronize()
            self.broadcast(torch.zeros(1, device="cuda"))
            torch.cuda.synchronize()  # NCCL's wait() only orders the stream: wait for the kernel itself
        else:
            self.broadcast(torch.zeros(1))

    def destroy(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if callable(shutdown):
            # a dead peer may make shutdown fail; the group is gone either way
            with contextlib.suppress(Exception):
                shutdown()


def create_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 60.0,
) -> WeightGroup:
    """Join (rank > 0) or host (rank 0) the weight-update group ``group_name``."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: weight-update groups support 'gloo' (CPU) or 'nccl' (CUDA)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=(rank == 0),
        timeout=timeout,
        wait_for_workers=False,
    )
    prefixed = dist.PrefixStore(f"tidal-weights/{group_name}", store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=master_address)]
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    return WeightGroup(name=group_name, rank=rank, world_size=world_size, backend=backend, pg=pg, store=store)
