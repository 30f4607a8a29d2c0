"""The prompt source: verl-format rows from parquet or JSONL, shuffled per epoch with a seed.

The cursor is ``(epoch, position)`` in that epoch's permutation; the permutation is a pure function of
``(seed, epoch)``, so the journal only needs the cursor to resume exactly where it stopped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tidal.broker.types import PromptRow
from tidal.errors import ConfigError


def _row(index: int, raw: dict[str, Any], path: Path) -> PromptRow:
    if "prompt" not in raw:
        raise ConfigError(
            f"broker.data.path={str(path)!r}: row {index} has no 'prompt' column "
            f"(verl format: data_source, prompt, reward_model.ground_truth, extra_info)"
        )
    reward_model = raw.get("reward_model") or {}
    if not isinstance(reward_model, dict):
        raise ConfigError(
            f"broker.data.path={str(path)!r}: row {index}: reward_model must be a map with 'ground_truth'"
        )
    extra = raw.get("extra_info") or {}
    return PromptRow(
        index=index,
        data_source=str(raw.get("data_source") or ""),
        prompt=raw["prompt"],
        ground_truth=reward_model.get("ground_truth"),
        extra_info=extra if isinstance(extra, dict) else {"value": extra},
    )


def load_rows(path: str | Path) -> list[PromptRow]:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"broker.data.path={str(path)!r}: file does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        raws = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        raws = []
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    raws.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ConfigError(
                        f"broker.data.path={str(path)!r}: line {lineno} is not JSON ({exc})"
                    ) from None
    else:
        raise ConfigError(
            f"broker.data.path={str(path)!r}: unknown format {path.suffix!r}; use .parquet or .jsonl"
        )
    if not raws:
        raise ConfigError(f"broker.data.path={str(path)!r}: the data set has no rows")
    return [_row(i, r, path) for i, r in enumerate(raws)]


class PromptSource:
    """Hands out row indices in a seeded per-epoch order; ``epochs=None`` cycles forever."""

    def __init__(self, rows: list[PromptRow], *, seed: int, shuffle: bool, epochs: int | None):
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.epochs = epochs
        self.epoch = 0
        self.pos = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.rows)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def seek(self, epoch: int, pos: int) -> None:
        self.epoch, self.pos = epoch, pos
        self._order = self._permutation(epoch)

    @property
    def exhausted(self) -> bool:
        return self.epochs is not None and self.epoch >= self.epochs

    def remaining_in_epoch(self) -> int:
        return 0 if self.exhausted else len(self.rows) - self.pos

    def take(self, k: int) -> list[str]:
        """Up to ``k`` group ids ``"<epoch>:<row index>"``; fewer only when the data is exhausted."""
        out: list[str] = []
        while len(out) < k and not self.exhausted:
            if self.pos >= len(self.rows):
                self.seek(self.epoch + 1, 0)
                continue
            out.append(f"{self.epoch}:{int(self._order[self.pos])}")
            self.pos += 1
        if self.pos >= len(self.rows) and not self.exhausted:
            self.seek(self.epoch + 1, 0)
        return out

    def row_of(self, group_id: str) -> PromptRow:
        return self.rows[int(group_id.split(":", 1)[1])]
