"""How megatron-core spreads a full tensor over ranks: TP/ETP splits, EP expert ranges, PP/VPP layers.

Pure functions on tensors; the collective gather of a live model is in ``gather.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.weights_sync.mapping import Shard


def split(full: torch.Tensor, shard: Shard, size: int) -> list[torch.Tensor]:
    """The ``size`` tensor-parallel shards of ``full`` (rank order)."""
    if size == 1 or shard == "replicated":
        return [full] * size
    if shard == "column_glu":
        gate, up = full.chunk(2, dim=0)
        return [torch.cat(pair, dim=0) for pair in zip(_even(gate, 0, size), _even(up, 0, size), strict=True)]
    return _even(full, 0 if shard == "column" else 1, size)


def merge(shards: list[torch.Tensor], shard: Shard) -> torch.Tensor:
    """Inverse of ``split``: the full tensor from its rank-ordered shards."""
    if len(shards) == 1 or shard == "replicated":
        return shards[0]
    if shard == "column_glu":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=0 if shard == "column" else 1)


def _even(t: torch.Tensor, dim: int, size: int) -> list[torch.Tensor]:
    if t.shape[dim] % size:
        raise ValueError(f"dimension {dim} of shape {list(t.shape)} does not split evenly over {size} ranks")
    return list(t.chunk(size, dim=dim))


@dataclass(frozen=True)
class StageLayout:
    """Which global layers each (pipeline rank, virtual chunk) holds: megatron-core's even split."""

    num_layers: int
    pp: int = 1
    vpp: int = 1

    def __post_init__(self) -> None:
        if self.num_layers % (self.pp * self.vpp):
            raise ValueError(
                f"num_layers={self.num_layers} is not divisible by pp*vpp={self.pp * self.vpp}; "
                "uneven pipeline layouts are not supported by the offline converter"
            )

    @property
    def per_chunk(self) -> int:
        return self.num_layers // (self.pp * self.vpp)

    def offset(self, pp_rank: int, chunk: int = 0) -> int:
        """Global id of the chunk's first layer (megatron-core: chunk-major, then pipeline rank)."""
        return (chunk * self.pp + pp_rank) * self.per_chunk

    def locate(self, layer: int) -> tuple[int, int, int]:
        """(pp_rank, chunk, local layer id) of a global layer id."""
        stage, local = divmod(layer, self.per_chunk)
        chunk, pp_rank = divmod(stage, self.pp)
        return pp_rank, chunk, local

    def has_embedding(self, pp_rank: int, chunk: int) -> bool:
        return pp_rank == 0 and chunk == 0

    def has_head(self, pp_rank: int, chunk: int) -> bool:
        return pp_rank == self.pp - 1 and chunk == self.vpp - 1


def local_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    """Global ids of the experts that expert-parallel rank ``ep_rank`` holds (contiguous blocks)."""
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep}")
    n = num_experts // ep
    return range(ep_rank * n, (ep_rank + 1) * n)
