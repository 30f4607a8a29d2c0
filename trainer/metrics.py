"""Per-step training statistics: accumulate over micro-batches, reduce over ranks, write JSONL + TensorBoard.

:class:`StepStats` keeps four kinds of statistic so that the value after reduction is the same however the
minibatch was split into micro-batches and ranks:

- ``mean``: a (sum, count) pair; the reported value is total sum / total count;
- ``sum``: additive values, e.g. a micro-batch's share of the minibatch loss;
- ``max`` / ``min``: extremes.

Every rank must record the same names (the losses always record the same names for a given config), since
:meth:`StepStats.all_reduce` reduces them as stacked tensors in sorted-name order.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

_KINDS = ("mean", "sum", "max", "min")


class StepStats:
    def __init__(self) -> None:
        self._mean: dict[str, list[torch.Tensor]] = {}
        self._sum: dict[str, torch.Tensor] = {}
        self._max: dict[str, torch.Tensor] = {}
        self._min: dict[str, torch.Tensor] = {}

    @staticmethod
    def _scalar(value: torch.Tensor | float) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value.detach().to(torch.float64).reshape(())
        return torch.tensor(float(value), dtype=torch.float64)

    def _check_new_kind(self, name: str, kind: str) -> None:
        for other, table in zip(_KINDS, (self._mean, self._sum, self._max, self._min), strict=True):
            if other != kind and name in table:
                raise ValueError(f"statistic {name!r} is already recorded as {other!r}, not {kind!r}")

    def add_mean(self, name: str, total: torch.Tensor | float, count: torch.Tensor | float) -> None:
        """Add ``total`` over ``count`` items; reported as the overall mean (NaN when no item was counted)."""
        self._check_new_kind(name, "mean")
        total, count = self._scalar(total), self._scalar(count)
        if name in self._mean:
            self._mean[name][0] = self._mean[name][0] + total
            self._mean[name][1] = self._mean[name][1] + count
        else:
            self._mean[name] = [total, count]

    def add_sum(self, name: str, value: torch.Tensor | float) -> None:
        self._check_new_kind(name, "sum")
        value = self._scalar(value)
        self._sum[name] = self._sum[name] + value if name in self._sum else value

    def add_max(self, name: str, value: torch.Tensor | float) -> None:
        self._check_new_kind(name, "max")
        value = self._scalar(value)
        self._max[name] = torch.maximum(self._max[name], value) if name in self._max else value

    def add_min(self, name: str, value: torch.Tensor | float) -> None:
        self._check_new_kind(name, "min")
        value = self._scalar(value)
        self._min[name] = torch.minimum(self._min[name], value) if name in self._min else value

    def merge(self, other: StepStats) -> StepStats:
        """Fold another micro-batch's statistics into this one; returns self."""
        for name, (total, count) in other._mean.items():
            self.add_mean(name, total, count)
        for name, value in other._sum.items():
            self.add_sum(name, value)
        for name, value in other._max.items():
            self.add_max(name, value)
        for name, value in other._min.items():
            self.add_min(name, value)
        return self

    def names(self) -> list[str]:
        return sorted([*self._mean, *self._sum, *self._max, *self._min])

    def all_reduce(self, group: Any = None, device: torch.device | str = "cpu") -> StepStats:
        """Reduce in place over a torch.distributed group (three collectives); returns self.

        ``device`` is where the stacked tensors travel (``cuda`` under NCCL, ``cpu`` under gloo).
        """
        import torch.distributed as dist

        sums = sorted(self._mean)
        adds = sorted(self._sum)
        maxes = sorted(self._max)
        mins = sorted(self._min)
        additive = [t for n in sums for t in self._mean[n]] + [self._sum[n] for n in adds]
        if additive:
            packed = torch.stack([t.to(device) for t in additive])  # values may sit on CPU or GPU
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
            packed = packed.cpu()
            for i, n in enumerate(sums):
                self._mean[n] = [packed[2 * i], packed[2 * i + 1]]
            for i, n in enumerate(adds):
                self._sum[n] = packed[2 * len(sums) + i]
        # max and min in one collective: min(x) = -max(-x).
        extremes = [self._max[n] for n in maxes] + [-self._min[n] for n in mins]
        if extremes:
            packed = torch.stack([t.to(device) for t in extremes])
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
            packed = packed.cpu()
            for i, n in enumerate(maxes):
                self._max[n] = packed[i]
            for i, n in enumerate(mins):
                self._min[n] = -packed[len(maxes) + i]
        return self

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, (total, count) in self._mean.items():
            out[name] = float(total / count) if float(count) > 0 else math.nan
        for table in (self._sum, self._max, self._min):
            for name, value in table.items():
                out[name] = float(value)
        return dict(sorted(out.items()))


class MetricsWriter:
    """Writes one JSON line per step to ``<run_dir>/<jsonl_name>`` and the same scalars to TensorBoard.

    Only one rank should write (the trainer's last pipeline stage on data-parallel rank 0). Non-finite
    values are kept (Python's json writes ``NaN``/``Infinity``) so that a diverging run is visible.
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, jsonl_name: str = "metrics.jsonl"):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / jsonl_name
        self._jsonl = self.jsonl_path.open("a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def write(self, step: int, metrics: Mapping[str, float | int]) -> None:
        record: dict[str, Any] = {"step": int(step), "time": time.time()}
        for name, value in metrics.items():
            if name in record:
                raise ValueError(f"metric name {name!r} is reserved by the metrics writer; rename it")
            record[name] = float(value)
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for name, value in metrics.items():
                self._tb.add_scalar(name, float(value), global_step=int(step))

    def flush(self) -> None:
        self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if not self._jsonl.closed:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file, in order."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]
