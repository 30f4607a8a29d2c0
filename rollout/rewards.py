"""Reward functions and what wraps them: exact match, math-verify, DAPO's overlong penalty, user functions.

A reward function has verl's signature ``fn(data_source, solution_str, ground_truth, extra_info)`` and
returns a number, a bool, or a dict with a ``"score"`` key (its other keys are kept as metrics). It may be
sync or async. A user's function is given by import path: ``package.module:function`` or
``path/to/file.py:function``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

RewardFn = Callable[..., Any]


def exact_match(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the ground truth; else 0.0."""
    return float(solution_str.strip() == str(ground_truth).strip())


def gsm8k_answer_text(solution_str: str) -> str:
    """The part of a GSM8K-style response that holds the answer: after the last ``####`` if there is one."""
    if "####" in solution_str:
        return solution_str.rsplit("####", 1)[1]
    return solution_str


def math_verify_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """1.0 when math-verify finds the response's final answer equal to the ground truth; else 0.0.

    math-verify bounds its own parsing time with ``signal.alarm``, which works only in a process's main
    thread; elsewhere (a thread pool) it runs without that bound.
    """
    import threading

    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(str(ground_truth), parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground truth {ground_truth!r} ({data_source})")
    answer = parse(gsm8k_answer_text(solution_str), parsing_timeout=timeout)
    if not answer:
        return 0.0
    return float(verify(gold, answer, timeout_seconds=timeout))


def overlong_penalty(response_length: int, max_response_length: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max - buffer`` tokens, then falling linearly to
    ``-factor`` at ``max`` tokens (and beyond). ``buffer == 0`` turns it off."""
    if buffer <= 0:
        return 0.0
    if buffer > max_response_length:
        raise ValueError(
            f"overlong buffer {buffer} exceeds the maximum response length {max_response_length}; "
            "set task.overlong_buffer <= rollout.sampling.max_new_tokens"
        )
    exceed = response_length - (max_response_length - buffer)
    return min(-exceed / buffer * factor, 0.0)


def _load_module_from_file(path: Path):
    spec = importlib.util.spec_from_file_location(f"tidal_user_reward_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_reward_fn(spec: str) -> RewardFn:
    """``module:function`` or ``file.py:function`` -> the callable; errors say what is wrong."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"task.reward={spec!r}: expected 'package.module:function' or 'path/to/file.py:function'"
        )
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.exists():
                raise ImportError(f"file {path} does not exist")
            module = _load_module_from_file(path)
        else:
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"task.reward={spec!r}: cannot import {module_name!r} ({exc})") from exc
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ValueError(f"task.reward={spec!r}: {module_name!r} has no callable named {attr!r}")
    return fn


def score_value(result: Any, fn_name: str) -> tuple[float, dict[str, float]]:
    """A reward function's result -> (score, extra metrics)."""
    if isinstance(result, dict):
        if "score" not in result:
            raise TypeError(f"reward function {fn_name} returned a dict without a 'score' key: {result!r}")
        extras = {k: float(v) for k, v in result.items() if k != "score" and isinstance(v, int | float)}
        return float(result["score"]), extras
    if isinstance(result, bool | int | float):
        return float(result), {}
    raise TypeError(
        f"reward function {fn_name} returned {type(result).__name__}; return a number or a dict with 'score'"
    )


async def call_reward(
    fn: RewardFn, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any]
) -> tuple[float, dict[str, float]]:
    """Call a sync or async reward function and normalise its result."""
    result = fn(
        data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info
    )
    if inspect.isawaitable(result):
        result = await result
    return score_value(result, getattr(fn, "__qualname__", repr(fn)))


def is_async(fn: RewardFn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


_WORKER_FNS: dict[str, RewardFn] = {}


def score_in_worker(spec: str, kwargs: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """Entry of a reward worker process: load ``spec`` once per process, call it, normalise the result.

    A worker's reward runs in that process's main thread, so math-verify's signal timeouts apply there.
    """
    fn = _WORKER_FNS.get(spec)
    if fn is None:
        fn = _WORKER_FNS[spec] = load_reward_fn(spec)
    return score_value(fn(**kwargs), spec)
