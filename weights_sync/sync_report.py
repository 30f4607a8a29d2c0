"""What a sync reports, how an attempt fails, and the small helpers the sender and the colocated path share."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from tidal.weights_sync.engine_api import EngineError

log = logging.getLogger(__name__)


@dataclass
class SyncReport:
    version: int
    ok: bool = True
    attempts: int = 0
    buckets: int = 0
    bytes: int = 0
    pack_s: float = 0.0
    transfer_s: float = 0.0
    wall_s: float = 0.0
    # the fixed cost around the buckets (wall, from the first request until every engine answered):
    # /pause_generation + /begin_weight_update (with one sender they run while the first bucket is
    # gathered and packed) and /end_weight_update + /continue_generation
    open_s: float = 0.0
    close_s: float = 0.0
    # announcements allowed ahead of the replies: > 1 when every engine receives in bucket_seq order
    inflight: int = 0
    replayed: bool = False  # sent as a replayed update (replay.py): no announcements, no closing call
    bucket_sizes: list[int] = field(default_factory=list)  # bytes of each bucket sent, in order
    dropped: list[str] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes / self.wall_s / 1e9 if self.wall_s else 0.0


class SyncFailed(Exception):
    """An engine failed during this attempt (already dropped)."""


class ReplayRefused(SyncFailed):
    """An engine had no record of the update to replay (replay.py): the next attempt announces it."""


def settle(futures: dict[str, Future], timeout_s: float) -> list[str]:
    """The engines whose call failed or did not finish within ``timeout_s`` (one deadline for all). Each
    failure is logged, once per engine and message: the sync leaves such an engine out and goes on, and
    without the log a node whose model does not match the trainer's only idled, unexplained."""
    deadline = time.monotonic() + timeout_s
    failed = []
    for url, future in futures.items():
        why = _failure(url, future, max(0.0, deadline - time.monotonic()))
        if why is None:
            continue
        failed.append(url)
        if why not in _logged:
            _logged.add(why)
            log.warning("weight sync: %s; that engine is left out (logged once)", why)
    return failed


def _failure(url: str, future: Future, timeout_s: float) -> str | None:
    try:
        future.result(timeout=timeout_s)
    except EngineError as exc:
        return str(exc)  # names the engine's URL and route
    except FutureTimeout:
        return f"{url}: no answer in time (weights_sync.timeout_s)"
    return None


_logged: set[str] = set()


def drain(tensors: Iterable) -> None:
    """Read the rest of a source (its gathers are collective: the other ranks wait for them)."""
    for _ in tensors:
        pass
