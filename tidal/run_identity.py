"""A run directory belongs to one run: the settings its data, models and journal were made from.

``tidal run`` keeps a run directory's ``config.yaml`` and continues the run it holds when started on it
again. Most settings may change between launches (``trainer.steps`` to train longer, ``rollout.nodes``,
the staleness bound); these may not, once what they made exists, because the launcher would keep the
old files and mix them with the new settings:

- ``model.*`` and ``seed``: the initial model (``init_hf/``), and the SFT and trainer checkpoints built on it
  (also when the run starts from ``model.path``, which it does not copy);
- ``warmup.*``: the SFT checkpoint (``sft/hf/``), which is not made again, and the trainer checkpoint that
  started from it or, without a warm-up, from the initial model;
- ``task.*`` (but ``task.reward_workers``), ``seed`` and ``broker.data.*`` (but ``broker.data.epochs``): the
  prompts the broker's journal took, and the demonstrations the SFT checkpoint learned from.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.config import RunConfig
from tidal.configio import load_config
from tidal.errors import ConfigError
from tidal.model_config import has_hf_weights

# settings that change nothing already made: how rewards are computed in parallel, how many epochs to run
MAY_CHANGE = ("task.reward_workers", "broker.data.epochs")


@dataclass(frozen=True)
class Artifact:
    """Something a run directory holds, and the settings it was made from."""

    what: str
    made_from: tuple[str, ...]  # dotted prefixes


def artifacts(config: RunConfig, root: Path) -> list[Artifact]:
    """What ``root`` already holds of a run (the artifacts that bind its settings)."""
    held = []
    init = root / "init_hf"
    if has_hf_weights(init):
        held.append(Artifact(f"its initial model {init}", ("model", "seed")))
    if (root / "sft" / "hf" / "config.json").exists():
        held.append(
            Artifact(f"its SFT checkpoint {root / 'sft' / 'hf'}", ("model", "seed", "warmup", "task"))
        )
    latest = root / "train" / "checkpoints" / "latest"  # the trainer's (trainer/checkpoint.py)
    if latest.exists():
        held.append(Artifact(f"its trainer checkpoint {latest.parent}", ("model", "seed", "warmup")))
    journal = config.journal_dir()
    if any(journal.glob("journal*.log")):
        held.append(Artifact(f"its broker journal {journal}", ("task", "seed", "broker.data")))
    return held


def _flat(prefix: str, value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flat(f"{prefix}.{k}" if prefix else k, v)
    else:
        yield prefix, value


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def binding_changes(saved: RunConfig, given: RunConfig, held: list[Artifact]) -> list[str]:
    """One line per setting that differs between ``saved`` and ``given`` while something made from it exists."""
    old = dict(_flat("", saved.model_dump(mode="json")))
    new = dict(_flat("", given.model_dump(mode="json")))
    lines = []
    for key in sorted(old.keys() | new.keys()):
        if old.get(key) == new.get(key) or any(_under(key, k) for k in MAY_CHANGE):
            continue
        made = [a.what for a in held if any(_under(key, p) for p in a.made_from)]
        if made:
            lines.append(f"  {key}: {old.get(key)!r} there, {new.get(key)!r} given ({'; '.join(made)})")
    return lines


def check_run_dir(config: RunConfig, root: Path) -> None:
    """Raise ConfigError when ``config`` would continue the run in ``root`` with settings that made its files.

    Called before the launcher writes anything into ``root``; a directory without a ``config.yaml`` is new."""
    saved_path = root / "config.yaml"
    if not saved_path.exists():
        return
    try:
        saved = load_config(RunConfig, saved_path)
    except ConfigError as exc:
        raise ConfigError(
            f"run_dir={root}: its saved settings {saved_path} no longer load ({exc}); "
            "start a new run with another run_dir"
        ) from None
    lines = binding_changes(saved, config, artifacts(config, root))
    if lines:
        raise ConfigError(
            f"run_dir={root} holds a run made with other settings (its {saved_path}):\n"
            + "\n".join(lines)
            + "\nA run directory keeps the model, seed, task, data and warm-up its files were made from. "
            f"Continue this run as it was with `tidal run --resume {root}` (key=value settings after it "
            "change the rest), or start a new one with another run_dir"
        )
