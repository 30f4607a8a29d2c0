"""Where a task's files live in the run directory, and writing them before the job starts.

``prepare_task(config, run_dir)`` is what the launcher calls: for the arithmetic task it writes
``data/{train,eval,sft}.jsonl`` and ``tokenizer/`` (a Hugging Face tokenizer directory) into the run
directory, skipping the work when a manifest says the same data is already there; for user data it checks
that the files the config names exist.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.broker.source import data_files
from tidal.errors import ConfigError
from tidal.rollout.tasks import arithmetic
from tidal.rollout.tasks.base import Task
from tidal.rollout.tasks.char_tokenizer import DEFAULT_CHARSET, save_char_tokenizer
from tidal.rollout.tasks.data import write_records
from tidal.rollout.tasks.gsm8k import CustomTask, Gsm8kTask

if TYPE_CHECKING:
    from tidal.config import RunConfig

TASKS: dict[str, type[Task]] = {
    "arithmetic": arithmetic.ArithmeticTask,
    "gsm8k": Gsm8kTask,
    "custom": CustomTask,
}


ARITHMETIC_SFT = "sft.jsonl"  # the arithmetic task's own demonstrations, in <run_dir>/data
ARITHMETIC_TOKENIZER = "tokenizer"  # its character-level tokenizer, in <run_dir>


@dataclass(frozen=True)
class TaskFiles:
    train: Path | list[Path]  # verl rows the broker serves (broker.data.path: a file, a directory, a list)
    eval: Path | None
    sft: Path | None  # {"prompt", "response"} rows for the supervised warm-up; None: the task has none
    tokenizer: Path  # a Hugging Face tokenizer directory


def task_files(config: RunConfig, run_dir: str | Path | None = None) -> TaskFiles:
    """The task's files for this config (they may not exist yet; see ``prepare_task``)."""
    run_dir = Path(run_dir or config.run_dir)
    task = config.task
    demonstrations = Path(config.warmup.data) if config.warmup.data else None
    if task.name == "arithmetic":
        data = run_dir / "data"
        generated = not config.broker.data.path  # with its own data, the task writes demonstrations too
        return TaskFiles(
            train=_data_path(config.broker.data.path) if config.broker.data.path else data / "train.jsonl",
            eval=Path(task.eval_path) if task.eval_path else data / "eval.jsonl",
            sft=demonstrations or (data / ARITHMETIC_SFT if generated else None),
            # a checkpoint keeps its own tokenizer; only a model tidal initialises gets the character one
            tokenizer=Path(task.tokenizer or config.model.path or run_dir / ARITHMETIC_TOKENIZER),
        )
    if not config.broker.data.path:
        raise ConfigError(
            f"task.name={task.name} reads your data: set broker.data.path to a verl parquet/JSONL file"
        )
    tokenizer = task.tokenizer or config.model.path
    if not tokenizer:
        raise ConfigError(
            f"task.name={task.name} needs a tokenizer: set task.tokenizer or model.path to a Hugging Face directory"
        )
    return TaskFiles(
        train=_data_path(config.broker.data.path),
        eval=Path(task.eval_path) if task.eval_path else None,
        sft=demonstrations,
        tokenizer=Path(tokenizer),
    )


def _data_path(path: str | list[str]) -> Path | list[Path]:
    return [Path(p) for p in path] if isinstance(path, list) else Path(path)


def _write_arithmetic(config: RunConfig, files: TaskFiles) -> None:
    task = config.task
    manifest = {
        "digits": task.digits,
        "num_train": task.num_train,
        "num_eval": task.num_eval,
        "num_sft": task.num_sft,
        "seed": config.seed,
        "charset": DEFAULT_CHARSET,
    }
    # its own files only: never a task.eval_path, warmup.data, task.tokenizer or model.path that it was given
    data = files.train.parent
    evaluation_path, sft = data / "eval.jsonl", data / ARITHMETIC_SFT
    tokenizer = data.parent / ARITHMETIC_TOKENIZER
    manifest_path = data / "manifest.json"
    wanted = [files.train, evaluation_path, sft]
    if files.tokenizer == tokenizer:
        wanted.append(tokenizer / "tokenizer.json")
    if (
        manifest_path.exists()
        and json.loads(manifest_path.read_text()) == manifest
        and all(p is not None and p.exists() for p in wanted)
    ):
        return
    try:
        train, evaluation = arithmetic.make_records(task.digits, task.num_train, task.num_eval, config.seed)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    write_records(files.train, train)
    write_records(evaluation_path, evaluation)
    write_records(sft, arithmetic.sft_records(train[: task.num_sft]))
    if files.tokenizer == tokenizer:
        save_char_tokenizer(tokenizer, DEFAULT_CHARSET)
    manifest_path.write_text(json.dumps(manifest, indent=1))


def prepare_task(config: RunConfig, run_dir: str | Path | None = None) -> TaskFiles:
    """Write (arithmetic) or check (user data) the task's files; returns where they are."""
    files = task_files(config, run_dir)
    if config.task.name == "arithmetic" and not config.broker.data.path:
        _write_arithmetic(config, files)
    if config.broker.data.path:
        data_files(config.broker.data.path)  # each file there, of a format the broker reads
    missing = [str(p) for p in (files.eval, files.sft) if p is not None and not p.exists()]
    if (
        not (files.tokenizer / "tokenizer.json").exists()
        and not (files.tokenizer / "tokenizer_config.json").exists()
    ):
        missing.append(f"{files.tokenizer} (a Hugging Face tokenizer directory)")
    if missing:
        raise ConfigError(f"task.name={config.task.name}: missing {', '.join(missing)}")
    vocab = _tokenizer_vocab_size(files.tokenizer)
    if vocab > config.model.resolved().vocab_size:
        raise ConfigError(
            f"model.vocab_size={config.model.resolved().vocab_size} is smaller than the tokenizer's "
            f"{vocab} tokens ({files.tokenizer}); set model.vocab_size >= {vocab}"
        )
    return files


PROMPTS_CHECKED = 32


def check_prompts(files: TaskFiles, rows: int = PROMPTS_CHECKED) -> None:
    """The first ``rows`` training rows render as prompts with the task's tokenizer (chat messages need a
    chat template). A mismatch fails here, naming the files, instead of on every node for every row."""
    from tidal.rollout.tasks.base import render_prompt
    from tidal.rollout.tasks.data import read_rows

    tokenizer = load_tokenizer(files.tokenizer)
    try:
        for row in itertools.islice(read_rows(files.train), rows):
            render_prompt(tokenizer, row)
    except ValueError as exc:
        raise ConfigError(
            f"broker.data.path={files.train} with the tokenizer {files.tokenizer}: {exc}"
        ) from None


def _tokenizer_vocab_size(directory: Path) -> int:
    from tokenizers import Tokenizer

    path = directory / "tokenizer.json"
    if path.exists():
        return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    return len(load_tokenizer(directory))


# Tokenizer classes that AutoTokenizer resolves to transformers' generic fast tokenizer.
_GENERIC_TOKENIZERS = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def load_tokenizer(directory: str | Path):
    """The Hugging Face tokenizer in ``directory``, as ``AutoTokenizer`` loads it.

    When the directory names the generic fast tokenizer (ours does), that class is loaded directly:
    it is what AutoTokenizer picks, and importing it alone skips torch, which saves a rollout node
    seconds of start-up.
    """
    directory = Path(directory)
    config_path = directory / "tokenizer_config.json"
    generic = (
        config_path.exists()
        and (directory / "tokenizer.json").exists()
        and json.loads(config_path.read_text()).get("tokenizer_class") in _GENERIC_TOKENIZERS
    )
    if generic:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def build_task(config: RunConfig, run_dir: str | Path | None = None, tokenizer=None) -> Task:
    """The configured task with its tokenizer loaded (from ``task_files``, unless one is given)."""
    if tokenizer is None:
        tokenizer = load_tokenizer(task_files(config, run_dir).tokenizer)
    cls = TASKS[config.task.name]
    try:
        return cls(config.task, tokenizer, config.rollout.sampling.max_new_tokens)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
