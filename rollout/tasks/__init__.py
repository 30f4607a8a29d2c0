"""Tasks: a prompt source (verl rows), how a row becomes token ids, and a reward."""

from tidal.rollout.tasks.base import Score, Task
from tidal.rollout.tasks.prepare import (
    TASKS,
    TaskFiles,
    build_task,
    check_prompts,
    load_tokenizer,
    prepare_task,
    task_files,
)

__all__ = [
    "TASKS",
    "Score",
    "Task",
    "TaskFiles",
    "build_task",
    "check_prompts",
    "load_tokenizer",
    "prepare_task",
    "task_files",
]
