"""The prompt source: verl-format rows from parquet or JSONL, shuffled per epoch with a seed.

The cursor is ``(epoch, position)`` in that epoch's permutation; the permutation is a pure function of
``(seed, epoch)``, so the journal only needs the cursor to resume exactly where it stopped, provided it
resumes over the same rows in the same order: the journal also keeps the source's identity (row count,
shuffle, seed and a digest of the rows), and a broker refuses to resume over other data.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from tidal.broker.types import PromptRow
from tidal.errors import ConfigError

SUFFIXES = (".parquet", ".jsonl", ".json")


def data_files(path: str | Path | list[str] | list[Path]) -> list[Path]:
    """The files ``broker.data.path`` names, in the order their rows are numbered: a file; a directory's
    parquet and JSONL files in name order (a data set saved in shards); a list of either, concatenated."""
    if isinstance(path, list | tuple):
        if not path:
            raise ConfigError("broker.data.path=[]: name at least one file")
        return [f for p in path for f in data_files(p)]
    path = Path(path)
    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix in SUFFIXES)
        if not files:
            raise ConfigError(
                f"broker.data.path={str(path)!r}: the directory holds no .parquet or .jsonl file"
            )
        return files
    if not path.exists():
        raise ConfigError(f"broker.data.path={str(path)!r}: file does not exist")
    if path.suffix not in SUFFIXES:
        raise ConfigError(
            f"broker.data.path={str(path)!r}: unknown format {path.suffix!r}; use .parquet or .jsonl"
        )
    return [path]


def _row(index: int, raw: dict[str, Any], path: Path, at: str) -> PromptRow:
    if "prompt" not in raw:
        raise ConfigError(
            f"broker.data.path={str(path)!r}: {at} has no 'prompt' column "
            f"(verl format: data_source, prompt, reward_model.ground_truth, extra_info)"
        )
    reward_model = raw.get("reward_model") or {}
    if not isinstance(reward_model, dict):
        raise ConfigError(
            f"broker.data.path={str(path)!r}: {at}: reward_model must be a map with 'ground_truth'"
        )
    extra = raw.get("extra_info") or {}
    return PromptRow(
        index=index,
        data_source=str(raw.get("data_source") or ""),
        prompt=raw["prompt"],
        ground_truth=reward_model.get("ground_truth"),
        extra_info=extra if isinstance(extra, dict) else {"value": extra},
    )


def _read_file(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
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
    return raws


def load_rows(path: str | Path | list[str]) -> list[PromptRow]:
    """Every row of the files ``path`` names (``data_files``), numbered across them in order."""
    rows: list[PromptRow] = []
    for file in data_files(path):
        raws = _read_file(file)
        if not raws:
            raise ConfigError(f"broker.data.path={str(file)!r}: the data set has no rows")
        rows += [_row(len(rows) + i, r, file, f"row {i}") for i, r in enumerate(raws)]
    return rows


def rows_digest(rows: list[PromptRow]) -> str:
    """A digest of what the rows ask (data source, prompt, ground truth), in their order: what a journal's
    group ids ("<epoch>:<row index>") refer to. ``extra_info`` is left out: metadata, whose map order may
    change when the same rows are written in another format."""
    h = hashlib.blake2b(digest_size=12)
    pack = msgpack.Packer(default=str, use_bin_type=True).pack
    for r in rows:
        h.update(pack((r.data_source, r.prompt, r.ground_truth)))
    return h.hexdigest()


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
        self._identity: dict[str, Any] | None = None

    @property
    def identity(self) -> dict[str, Any]:
        """What the cursor and group ids mean: rows, their order (shuffle, and the seed where it matters)
        and a digest of their content. ``epochs`` is not part of it: a run may be given more."""
        if self._identity is None:
            self._identity = {
                "rows": len(self.rows),
                "shuffle": self.shuffle,
                "seed": self.seed if self.shuffle else None,
                "digest": rows_digest(self.rows),
            }
        return self._identity

    def check_resumable(
        self, journaled: dict[str, Any] | None, group_ids, journal: str, path: str | None
    ) -> None:
        """Refuse to resume a journal written over other data (``journaled``: the identity it recorded;
        None for a journal of an earlier tidal, where only the row indices of its open groups are checked)."""
        where = f"broker.data.path={path!r}" if path else "the prompt data"
        hint = (
            "give the data and broker.data.shuffle/seed it was written with, or start afresh with another "
            "broker.journal.dir (or run_dir)"
        )
        mine = self.identity  # computed here, at start, not at the first lease (0.6 us a row)
        if journaled is not None:
            changed = [
                f"{k} {journaled.get(k)!r} -> {mine[k]!r}" for k in mine if journaled.get(k) != mine[k]
            ]
            if changed:
                raise ConfigError(
                    f"{where}: the journal {journal} was written over other prompt data (journal -> now: "
                    f"{', '.join(changed)}); "
                    f"its cursor and group ids name rows of that data: {hint}"
                )
            return
        n = len(self.rows)
        beyond = [g for g in group_ids if int(g.split(":", 1)[1]) >= n]
        if beyond:
            raise ConfigError(
                f"{where}: the journal {journal} holds groups of rows this data does not have "
                f"({beyond[:3]}, but {n} rows): {hint}"
            )

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
