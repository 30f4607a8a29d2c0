"""The node's engines: started as child processes (or given by URL), shared under a concurrency limit,
watched, and restarted when they die.

Each request goes to the healthy engine with the fewest requests in flight, waiting while every engine is
at ``rollout.concurrency``. A request that fails because its engine is unreachable marks that engine down;
a child engine that died is started again on the same port (so its URL stays what the node registered), an
external one is polled until it answers again. Requests are retried by the caller on another engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tidal.procs import tail
from tidal.rollout.engine import EngineClient, EngineError, GenerateResult
from tidal.rollout.http_client import SGLangClient

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineUnavailable(RuntimeError):
    """The engine did not answer (connection refused or reset, timeout, 5xx); retry elsewhere."""


class EngineStartError(RuntimeError):
    """An engine did not come up: it exited, or did not answer within the start timeout."""


class EngineRejected(RuntimeError):
    """The engine answered 4xx: the request itself is wrong; retrying will not help."""


Launch = Callable[[int, int], subprocess.Popen]  # (engine index, port) -> the started process


@dataclass
class EngineSlot:
    index: int
    url: str
    port: int
    client: EngineClient | None = None
    process: subprocess.Popen | None = None  # set when this node started the engine
    log_path: str | None = None
    inflight: int = 0
    healthy: bool = False
    failed: bool = False  # gave up restarting it
    restarts: int = 0
    served: int = 0
    recovering: asyncio.Task | None = field(default=None, repr=False)


class EnginePool:
    def __init__(
        self,
        slots: list[EngineSlot],
        *,
        concurrency: int,
        request_timeout_s: float,
        start_timeout_s: float,
        launch: Launch | None = None,
        max_restarts: int = 5,
    ) -> None:
        if not slots:
            raise ValueError("an engine pool needs at least one engine")
        self.slots = slots
        self.concurrency = concurrency
        self.start_timeout_s = start_timeout_s
        self.launch = launch
        self.max_restarts = max_restarts
        for slot in slots:
            if slot.client is None:
                slot.client = SGLangClient(slot.url, timeout_s=request_timeout_s)
        self._changed = asyncio.Condition()
        self._watch: asyncio.Task | None = None
        self.closed = False
        self.draining = False  # the node is stopping: an engine that fails now is not restarted
        # engines back after a failure (restarted, or an external one answering again): each may serve the
        # weights it loaded at start again, which the agent must ask about (RolloutAgent._weights_fresh)
        self.comebacks = 0

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.slots]

    @property
    def all_failed(self) -> bool:
        """Every engine gave up restarting: nothing can sample on this node any more."""
        return all(s.failed for s in self.slots)

    @property
    def capacity(self) -> int:
        return self.concurrency * len(self.slots)

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the child engines (if any) and wait until every engine answers."""
        for slot in self.slots:
            if self.launch is not None and slot.process is None:
                slot.process = self.launch(slot.index, slot.port)
                log.info("started engine %d (pid %d) for %s", slot.index, slot.process.pid, slot.url)
        await asyncio.gather(*(self._wait_healthy(slot, self.start_timeout_s) for slot in self.slots))
        self._watch = asyncio.create_task(self._watch_children())

    async def close(self) -> None:
        self.closed = True
        tasks = [t for t in [self._watch, *(s.recovering for s in self.slots)] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for slot in self.slots:
            await slot.client.close()
        for slot in self.slots:
            if slot.process is not None:
                await asyncio.to_thread(_stop, slot.process)

    # --- requests --------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def slot(self, places: int = 1) -> AsyncIterator[EngineSlot]:
        """Hold ``places`` request places (a group's samples) on the least-loaded healthy engine that has
        them free; more than ``rollout.concurrency`` places take a whole engine."""
        places = max(1, min(places, self.concurrency))
        async with self._changed:
            while True:
                ready = [s for s in self.slots if s.healthy and s.inflight + places <= self.concurrency]
                if ready:
                    chosen = min(ready, key=lambda s: (s.inflight, s.served))
                    break
                if self.closed:
                    raise EngineUnavailable("the engine pool is closed")
                if self.all_failed:
                    raise EngineUnavailable(
                        f"every engine failed {self.max_restarts} restarts (rollout.agent.engine_max_restarts); "
                        f"see {', '.join(str(s.log_path) for s in self.slots)}"
                    )
                await self._changed.wait()
            chosen.inflight += places
            chosen.served += places
        try:
            yield chosen
        finally:
            async with self._changed:
                chosen.inflight -= places
                self._changed.notify_all()

    async def generate(
        self, slot: EngineSlot, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> GenerateResult:
        """``/generate`` with logprobs. An engine that cannot be reached or fails (5xx) is marked down and
        raises EngineUnavailable; a request it refuses (4xx) raises EngineRejected. A cancelled call
        aborts its request on the engine (by ``rid``), so it stops using the engine's capacity."""
        call = slot.client.generate(input_ids, sampling_params, rid=rid, return_logprob=True)
        return await self._request(slot, call, [] if rid is None else [rid])

    async def generate_n(
        self,
        slot: EngineSlot,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        n: int,
        rid: str | None = None,
    ) -> list[GenerateResult]:
        """``n`` samples of one prompt in one request (SGLang's ``sampling_params.n``), failures handled as
        :meth:`generate` handles them; a cancelled call aborts each of its requests (``{rid}_{i}``)."""
        call = slot.client.generate_n(input_ids, sampling_params, n, rid=rid, return_logprob=True)
        rids = [] if rid is None else [rid] if n == 1 else [f"{rid}_{i}" for i in range(n)]
        return await self._request(slot, call, rids)

    async def _request(self, slot: EngineSlot, call: Awaitable[T], rids: list[str]) -> T:
        try:
            return await call
        except asyncio.CancelledError:
            if rids:
                aborts = asyncio.gather(*(slot.client.abort(r) for r in rids))
                try:  # shielded: a second cancellation must not stop the abort from reaching the engine
                    await asyncio.shield(asyncio.wait_for(aborts, 5.0))
                except Exception as exc:  # noqa: BLE001 - best effort; the engine may be gone
                    log.warning("could not abort request(s) %s on %s: %r", rids, slot.url, exc)
            raise
        except EngineError as exc:
            if exc.status is not None and 400 <= exc.status < 500:
                raise EngineRejected(f"engine {slot.url} rejected the request: {exc}") from exc
            await self.mark_down(slot, str(exc))
            raise EngineUnavailable(f"engine {slot.url}: {exc}") from exc

    # --- health ----------------------------------------------------------------------------------

    async def weight_versions(self) -> list[str | None]:
        """The ``weight_version`` each healthy engine reports (``/model_info``); one that does not answer
        is left out (its requests find out)."""
        healthy = [s for s in self.slots if s.healthy]
        infos = await asyncio.gather(*(s.client.model_info() for s in healthy), return_exceptions=True)
        return [info.get("weight_version") for info in infos if isinstance(info, dict)]

    async def mark_down(self, slot: EngineSlot, why: str) -> None:
        async with self._changed:
            if not slot.healthy or self.closed:
                return
            slot.healthy = False
            log.warning("engine %d at %s is down (%s)", slot.index, slot.url, why)
            if self.draining:
                slot.failed = True  # its requests go back to the broker instead of waiting for a restart
                self._changed.notify_all()
                return
            slot.recovering = asyncio.create_task(self._recover(slot))

    async def _ping(self, slot: EngineSlot) -> bool:
        return await slot.client.health()

    async def _wait_healthy(self, slot: EngineSlot, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not await self._ping(slot):
            if slot.process is not None and slot.process.poll() is not None:
                raise EngineStartError(
                    f"engine {slot.index} exited with {slot.process.returncode} before serving {slot.url}; "
                    f"last log lines:\n{tail(slot.log_path) if slot.log_path else '<no log>'}"
                )
            if time.monotonic() > deadline:
                raise EngineStartError(
                    f"engine {slot.index} at {slot.url} did not answer within {timeout_s:.0f}s"
                )
            await asyncio.sleep(0.2)
        async with self._changed:
            slot.healthy = True
            self._changed.notify_all()

    async def _recover(self, slot: EngineSlot) -> None:
        """Bring ``slot`` back: restart a dead (or hung) child; wait for an external engine."""
        try:
            while not self.closed:
                if slot.process is not None and self.launch is not None:
                    if slot.process.poll() is None and await self._ping(slot):
                        break  # a transient failure; the engine is fine
                    if slot.restarts >= self.max_restarts:
                        log.error("engine %d failed %d restarts; giving up on it", slot.index, slot.restarts)
                        async with self._changed:
                            slot.failed = True
                            self._changed.notify_all()
                        return
                    await asyncio.to_thread(_stop, slot.process)
                    slot.restarts += 1
                    log.warning(
                        "restarting engine %d on port %d (restart %d)", slot.index, slot.port, slot.restarts
                    )
                    slot.process = self.launch(slot.index, slot.port)
                try:
                    await self._wait_healthy(slot, self.start_timeout_s)
                    self.comebacks += 1
                    log.info("engine %d at %s is back", slot.index, slot.url)
                    return
                except EngineStartError as exc:
                    log.warning("engine %d not back yet: %s", slot.index, exc)
            async with self._changed:
                slot.healthy = True
                self._changed.notify_all()
        finally:
            slot.recovering = None

    async def _watch_children(self) -> None:
        """Notice a child engine that died even when no request is on it."""
        while not self.closed:
            await asyncio.sleep(0.5)
            for slot in self.slots:
                if slot.process is not None and slot.process.poll() is not None and slot.healthy:
                    await self.mark_down(slot, f"process exited with {slot.process.returncode}")


def _stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
