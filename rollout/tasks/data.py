"""Prompt rows in verl's data format, read from and written to JSONL or parquet.

A verl row is ``{"data_source", "prompt", "ability", "reward_model": {"style", "ground_truth"},
"extra_info"}``; ``prompt`` is a list of chat messages or a plain string.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tidal.broker.types import PromptRow

SUFFIXES = (".jsonl", ".json", ".parquet")


def row_from_record(record: dict[str, Any], index: int, where: str = "") -> PromptRow:
    """A verl record -> PromptRow; a record without ``prompt`` or ``data_source`` is an error naming it."""
    missing = [k for k in ("data_source", "prompt") if k not in record]
    if missing:
        raise ValueError(
            f"{where or 'row'} {index}: missing field(s) {missing}; verl rows need data_source, prompt, "
            f"reward_model.ground_truth (got keys {sorted(record)})"
        )
    reward_model = record.get("reward_model") or {}
    if not isinstance(reward_model, dict):
        raise ValueError(f"{where or 'row'} {index}: reward_model must be a mapping, got {reward_model!r}")
    return PromptRow(
        index=index,
        data_source=str(record["data_source"]),
        prompt=record["prompt"],
        ground_truth=reward_model.get("ground_truth"),
        extra_info=dict(record.get("extra_info") or {}),
    )


def record_from_row(row: PromptRow, ability: str = "math") -> dict[str, Any]:
    return {
        "data_source": row.data_source,
        "prompt": row.prompt,
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": row.ground_truth},
        "extra_info": row.extra_info,
    }


def _check_suffix(path: Path) -> None:
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{path}: unsupported data file type {path.suffix!r}; use one of {SUFFIXES}")


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    path = Path(path)
    _check_suffix(path)
    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches():
            yield from batch.to_pylist()
        return
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({exc})") from None


def read_rows(path: str | Path | list[Path]) -> Iterator[PromptRow]:
    """The rows of verl JSONL/parquet data, numbered in order: a file, a directory of them or a list
    (``broker.data.path``'s forms, ``tidal.broker.source.data_files``)."""
    from tidal.broker.source import data_files

    index = 0
    for file in data_files(path) if isinstance(path, list) or Path(path).is_dir() else [Path(path)]:
        for record in read_records(file):
            yield row_from_record(record, index, where=str(file))
            index += 1


def write_records(path: str | Path, records: Iterable[dict[str, Any]]) -> int:
    """Write records as JSONL or parquet (by suffix), atomically; returns the number written."""
    path = Path(path)
    _check_suffix(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # unique: two nodes may prepare at once
    records = list(records)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), tmp)
    else:
        with tmp.open("w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    tmp.replace(path)
    return len(records)
