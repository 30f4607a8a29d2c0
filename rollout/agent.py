"""The rollout node agent: leases prompt groups from the broker, samples them on the node's engines,
scores them and submits whole groups.

One asyncio loop runs three kinds of work: a heartbeat (keeps the node alive, extends its leases, learns
the policy version and whether the data is exhausted), a lease loop (asks for as many groups as the
engines can take), and one task per leased group (the scored group is submitted as soon as it is whole).
A group of short samples goes to an engine as one ``/generate`` with ``sampling_params.n`` (one HTTP
request, one prefill batch); longer ones send each sample as its own request, so that an engine place is
reused as soon as its sample ends (``rollout.agent.group_request_max_new_tokens``).

Weight updates are driven by the trainer's sender straight over the engines' HTTP routes. In
``in_place`` mode requests keep going and the engine stamps each token with the version that produced it
(``meta_info.weight_versions``); in ``abort`` mode the engine returns partial outputs with
``finish_reason: abort`` and :mod:`tidal.rollout.generation` resumes them. The agent does the same in
both modes, so it reports its mode at registration for the sender to read.

SIGTERM (or SIGINT) stops leasing, lets in-flight groups finish for ``rollout.agent.drain_timeout_s``,
releases the groups that did not, and leaves; a second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import time
from dataclasses import dataclass, field

import numpy as np

from tidal.broker.client import AsyncBrokerClient, BrokerError, LeaseRejected
from tidal.broker.protocol import MODEL_MISMATCH
from tidal.broker.types import Group, Lease, PromptGroup, PromptRow, Sample
from tidal.errors import CONFIG_ERROR_EXIT
from tidal.rollout.config import RolloutConfig
from tidal.rollout.engine_pool import EnginePool, EngineUnavailable
from tidal.rollout.generation import PartialResponse, SampleFailed, generate, generate_group, parse_version
from tidal.rollout.tasks import Task

log = logging.getLogger("tidal.rollout.agent")


@dataclass
class AgentStats:
    leases: int = 0
    groups_submitted: int = 0
    groups_rejected: int = 0  # the broker had already re-leased them
    groups_released: int = 0
    groups_failed: int = 0
    samples: int = 0
    tokens: int = 0
    resumes: int = 0
    retries: int = 0
    started: float = field(default_factory=time.monotonic)


@dataclass
class _InFlight:
    lease_id: str
    group: PromptGroup
    task: asyncio.Task


WEIGHT_WAIT_LOG_S = 30.0  # how often a node waiting for newer weights says it still is
_FINISHED = object()  # the broker pushed the end of the data


class RolloutAgent:
    def __init__(
        self,
        config: RolloutConfig,
        client: AsyncBrokerClient,
        pool: EnginePool,
        task: Task,
        *,
        name: str | None = None,
        group_size_hint: int = 8,
        group_failures_reported: int = 3,
        model: dict[str, str] | None = None,
    ) -> None:
        self.config = config
        self.agent_cfg = config.agent
        self.client = client
        self.pool = pool
        self.task = task
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.model = model  # the identity of the model its engines serve (tidal/model_identity.py), if known
        self.stats = AgentStats()
        self.policy_version = 0
        self.data_finished = False
        self.inflight: dict[str, _InFlight] = {}
        self.unfinished_samples = 0  # samples leased and not yet generated and scored
        self.stop_requested = asyncio.Event()
        self._hurry = asyncio.Event()  # a second signal: skip the drain
        self._changed = asyncio.Event()
        self._group_size = group_size_hint
        self._group_tasks: set[asyncio.Task] = set()
        self._credit = 0  # the standing lease request's credit, as the broker last confirmed it
        self._failures_in_a_row = 0
        # a group's failure is laid on its prompt only while this node fails no more than this in a row (the
        # broker's max_group_failures: a bad prompt leased back to this node gets that far); beyond it the
        # node itself is suspect (its tokenizer or its engine refuses everything) and must not use up the data
        self._group_failures_reported = group_failures_reported
        self.exit_code = 0
        # the broker's staleness bound where it drops what is beyond it (None: it keeps stale groups)
        self._stale_limit: int | None = None
        self.engine_version = 0  # the oldest policy version this node's engines serve, as last asked
        self._comebacks_seen = 0  # the pool's engines back after a failure when engine_version was set
        self._waiting_for_weights = False
        self._waiting_since = self._wait_logged = 0.0
        self._base_sampling = {
            "temperature": config.sampling.temperature,
            "top_p": config.sampling.top_p,
            "top_k": config.sampling.top_k,
        }

    # --- capacity --------------------------------------------------------------------------------

    @property
    def max_inflight_groups(self) -> int:
        if self.agent_cfg.max_inflight_groups is not None:
            return self.agent_cfg.max_inflight_groups
        return math.ceil(self.pool.capacity / max(1, self._group_size)) + 1

    def free_groups(self) -> int:
        """Groups to lease now.

        By default the node leases by free sample slots: a group keeps its place until its slowest sample
        ends, so a fixed group cap leaves engine slots idle behind long tails. With
        ``rollout.agent.max_inflight_groups`` set, that fixed cap applies instead.
        """
        if self.agent_cfg.max_inflight_groups is not None:
            return self.agent_cfg.max_inflight_groups - len(self.inflight)
        free_slots = self.pool.capacity - self.unfinished_samples
        return math.ceil(free_slots / max(1, self._group_size)) if free_slots > 0 else 0

    # --- lifecycle -------------------------------------------------------------------------------

    def request_stop(self) -> None:
        if self.stop_requested.is_set():
            self._hurry.set()
        self.stop_requested.set()
        self.pool.draining = True
        self._changed.set()

    def _refused(self, exc: BrokerError) -> bool:
        """Whether the broker refuses this node for good (its engines serve another model than the trainer
        trains, broker/membership.py); the node then stops at once with the configuration error's exit code,
        which ``tidal run`` does not restart."""
        if exc.code != MODEL_MISMATCH:
            return False
        if self.exit_code != CONFIG_ERROR_EXIT:
            log.error("stopping: %s", exc)
            self.exit_code = CONFIG_ERROR_EXIT
            self.request_stop()
            self._hurry.set()  # its leases went back to the queue: nothing it holds can be submitted
        return True

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    async def run(self) -> int:
        """Register, work until stopped or the data is exhausted, drain, leave. Returns an exit code."""
        if not await self._register_unless_stopped():
            log.info("stopped while waiting for the broker")
            return self.exit_code
        log.info(
            "node %s (%s) registered with %d engine(s): %s; policy version %d",
            self.client.node_id,
            self.name,
            len(self.pool.slots),
            ", ".join(self.pool.urls),
            self.policy_version,
        )
        heartbeat = asyncio.create_task(self._heartbeat_loop())
        try:
            await self._lease_loop()
        finally:
            await self._drain()
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
            if self.exit_code != CONFIG_ERROR_EXIT:  # a refused node is no member to leave
                with contextlib.suppress(BrokerError):
                    await self.client.leave()
            self._log_progress("stopped")
        return self.exit_code

    async def _register_unless_stopped(self) -> bool:
        """Register (waiting up to ``broker_wait_s`` for a broker that does not answer yet); False when a
        signal stopped the node first. Seen by hand: a node started after its broker had stopped ignored
        SIGTERM for the whole wait (600 s)."""
        register = asyncio.create_task(self._register())
        stopped = asyncio.create_task(self.stop_requested.wait())
        await asyncio.wait([register, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not register.done():
            register.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await register
            return False
        register.result()  # the broker's refusal, or the wait running out, is raised here
        return True

    async def _register(self) -> None:
        meta = {
            "engines": self.pool.urls,
            "update_mode": self.config.update_mode,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        if self.model is not None:
            meta["model"] = self.model
        await self.client.register("rollout", self.name, meta, wait_s=self.agent_cfg.broker_wait_s)
        settings = self.client.registered
        drops = settings.get("staleness_policy") == "drop" and "max_staleness" in settings
        self._stale_limit = int(settings["max_staleness"]) if drops else None
        hb = await self.client.heartbeat()
        self.policy_version = int(hb.get("policy_version", 0))

    async def _weights_fresh(self) -> bool:
        """Whether groups this node starts now can be trained. The broker drops a group whose oldest token
        is more than ``max_staleness`` versions behind the trainer's (policy ``drop``), so engines that far
        behind (a node started mid-run, every process of a resumed run: they load the run's first weights)
        would only use up prompts. Such a node waits for the trainer's weight sync instead, asking its
        engines' ``/model_info`` until their version is recent enough. An engine back after a failure
        (restarted by the pool) is asked again: it serves the weights it started with."""
        limit = self._stale_limit
        if limit is None:
            return True
        if self.pool.comebacks != self._comebacks_seen:  # a restarted engine serves its start-up weights
            self._comebacks_seen, self.engine_version = self.pool.comebacks, 0
        if self.policy_version - self.engine_version > limit:
            versions = await self.pool.weight_versions()
            if versions:
                self.engine_version = min(parse_version(v) for v in versions)
        fresh = self.policy_version - self.engine_version <= limit
        now = time.monotonic()
        if fresh and self._waiting_for_weights:
            log.info("engines now serve weights of version %d; leasing again", self.engine_version)
        elif not fresh and not self._waiting_for_weights:
            self._waiting_since = self._wait_logged = now
            log.info(
                "engines serve weights of version %d, the trainer is at %d and the broker drops groups more "
                "than %d versions behind (broker.max_staleness): waiting for the trainer's weights before "
                "leasing",
                self.engine_version,
                self.policy_version,
                limit,
            )
        elif not fresh and now - self._wait_logged >= WEIGHT_WAIT_LOG_S:
            self._wait_logged = now
            log.warning(
                "still waiting for the trainer's weights after %.0fs (engines at version %d, trainer at %d); "
                "the trainer syncs every engine the broker lists after each step: its log names engines it "
                "left out and why (e.g. a model that does not match the trainer's), and the engines' logs "
                "say what they refused",
                now - self._waiting_since,
                self.engine_version,
                self.policy_version,
            )
        self._waiting_for_weights = not fresh
        return fresh

    # --- loops -----------------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        last_log = time.monotonic()
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            try:
                hb = await self.client.heartbeat()
            except BrokerError as exc:  # the client registers again by itself after a broker restart
                if not self._refused(exc):
                    log.warning("heartbeat failed: %s", exc)
                continue
            self.policy_version = int(hb.get("policy_version", self.policy_version))
            if hb.get("finished"):
                self.data_finished = True
                self._changed.set()
            if time.monotonic() - last_log > 30:
                last_log = time.monotonic()
                self._log_progress("running")

    async def _lease_loop(self) -> None:
        """Keep the broker's standing lease request (``stream_leases``) at the groups this node can take
        now, and start the groups of each lease the broker pushes. The broker pushes as soon as admission
        allows, so the node neither polls nor waits a round trip: asking for each lease and waiting
        ``lease_poll_s`` after a refusal cost a synchronous run ~5% of its rate (docs/BENCHMARKS.md,
        "Async vs sync scheduling")."""
        try:
            while not self.stop_requested.is_set():
                if self.data_finished and not self.inflight:
                    log.info("the broker has no more prompts; stopping")
                    return
                if self.data_finished:
                    await self._wait_change(None)
                    continue
                if not await self._weights_fresh():
                    if await self._stand(0):
                        await self._wait_change(self.agent_cfg.lease_poll_s)
                    continue
                self._changed.clear()  # from here: a change while the credit is sent is seen below
                if not await self._stand(len(self.inflight) + max(0, self.free_groups())):
                    continue
                lease = await self._next_pushed()
                if lease is _FINISHED:
                    self.data_finished = True
                elif lease is not None:
                    await self._take(lease)
        finally:
            await self._give_back_pushed()

    async def _stand(self, credit: int) -> bool:
        """The standing lease request at ``credit`` groups in flight (sent where it changed); False where the
        broker could not be asked (then after ``lease_poll_s``)."""
        if credit == self._credit:
            return True
        try:
            await self.client.stream_leases(credit, self.agent_cfg.max_groups_per_lease)
        except BrokerError as exc:
            if not self._refused(exc):
                log.warning("lease request failed: %s", exc)
            await self._wait_change(self.agent_cfg.lease_poll_s)
            return False
        self._credit = credit
        return True

    async def _next_pushed(self) -> Lease | object | None:
        """The next lease the broker pushes; ``_FINISHED`` at the end of the data; None where something
        changed here first (a sample or group ended, a stop), which may change the credit."""
        pushed = asyncio.ensure_future(self.client.next_lease())
        changed = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait([pushed, changed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
            if not pushed.done():
                pushed.cancel()
            await asyncio.wait([pushed])  # a lease that arrived meanwhile is its result, not lost
        if pushed.cancelled():
            return None
        lease = pushed.result()
        return _FINISHED if lease is None else lease

    async def _take(self, lease: Lease) -> None:
        """Start the groups of a pushed lease; one pushed while this node's engines fell behind the weights
        the broker accepts goes back at once (the next freshness check stops the pushes)."""
        if not await self._weights_fresh():
            await self._release(lease.lease_id, [pg.group_id for pg in lease.groups])
            return
        self.stats.leases += 1
        for pg in lease.groups:
            self._group_size = pg.n
            self.unfinished_samples += pg.n
            t = asyncio.create_task(self._run_group(lease.lease_id, pg), name=f"group {pg.group_id}")
            self._group_tasks.add(t)
            t.add_done_callback(self._group_tasks.discard)
            self.inflight[pg.group_id] = _InFlight(lease.lease_id, pg, t)

    async def _give_back_pushed(self) -> None:
        """On the way out: stop the pushes, and give back the leases pushed and not taken (their groups
        are leased again first). A refused node holds nothing (the broker let its leases go), and on a second
        signal ``leave`` gives them back."""
        if self.exit_code == CONFIG_ERROR_EXIT or self._hurry.is_set():
            return
        if self._credit:
            with contextlib.suppress(BrokerError):
                await self.client.stream_leases(0)
                self._credit = 0
        for lease in self.client.pushed_leases():
            await self._release(lease.lease_id, [pg.group_id for pg in lease.groups])

    async def _wait_change(self, timeout: float | None) -> None:
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    async def _drain(self) -> None:
        """Let in-flight groups finish (bounded), then cancel and release what is left."""
        if self.inflight and not self._hurry.is_set():
            log.info(
                "finishing %d in-flight group(s) (up to %.1fs)",
                len(self.inflight),
                self.agent_cfg.drain_timeout_s,
            )
            pending = [f.task for f in self.inflight.values()]
            hurry = asyncio.create_task(self._hurry.wait())
            await asyncio.wait(
                [asyncio.gather(*pending, return_exceptions=True), hurry],
                timeout=self.agent_cfg.drain_timeout_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            hurry.cancel()
        left = list(self.inflight.values())
        for f in left:
            f.task.cancel()
        await asyncio.gather(*(f.task for f in left), return_exceptions=True)
        by_lease: dict[str, list[str]] = {}
        for f in left:
            by_lease.setdefault(f.lease_id, []).append(f.group.group_id)
        for lease_id, ids in by_lease.items():
            await self._release(lease_id, ids)
        if self._group_tasks:  # finished groups still being submitted
            await asyncio.wait(self._group_tasks, timeout=self.agent_cfg.broker_timeout_s)

    # --- one group -------------------------------------------------------------------------------

    async def _run_group(self, lease_id: str, pg: PromptGroup) -> None:
        try:
            group = await self._sample_group(pg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of one group returns it to the broker
            self._group_failed(pg, exc)
            # the broker counts the group's failures (and drops it after broker.max_group_failures), but not
            # those of an engine that is gone, or of a node that fails everything: another node may sample it
            prompts_fault = (
                not self._engine_trouble(exc) and self._failures_in_a_row <= self._group_failures_reported
            )
            await self._release(
                lease_id, [pg.group_id], f"{type(exc).__name__}: {exc}" if prompts_fault else None
            )
            self._done(pg.group_id)
            return
        self._failures_in_a_row = 0
        self._done(pg.group_id)  # from here on the group is the broker's, not in flight
        try:
            await self.client.submit(lease_id, [group])
            self.stats.groups_submitted += 1
        except LeaseRejected as exc:
            self.stats.groups_rejected += 1
            log.warning("group %s dropped: %s", pg.group_id, exc)
        except BrokerError as exc:
            self.stats.groups_failed += 1
            if not self._refused(exc):
                log.error("submitting group %s failed: %s", pg.group_id, exc)

    def _group_failed(self, pg: PromptGroup, exc: Exception) -> None:
        self.stats.groups_failed += 1
        self._failures_in_a_row += 1
        expected = isinstance(exc, SampleFailed | EngineUnavailable | ValueError)
        log.error(
            "group %s goes back to the broker: %s: %s",
            pg.group_id,
            type(exc).__name__,
            exc,
            exc_info=None if expected else exc,
        )
        if self.pool.all_failed or self._failures_in_a_row >= self.agent_cfg.max_failed_groups:
            log.error(
                "giving up after %d failed groups in a row%s",
                self._failures_in_a_row,
                " (every engine failed)" if self.pool.all_failed else " (rollout.agent.max_failed_groups)",
            )
            self.exit_code = 1
            self.request_stop()

    def _done(self, group_id: str) -> None:
        self.inflight.pop(group_id, None)
        self._changed.set()

    def _engine_trouble(self, exc: BaseException) -> bool:
        """Whether a group failed because its engine did not answer (gone, crashed, timed out), not because
        of its prompt or its responses."""
        return (
            self.pool.all_failed
            or isinstance(exc, EngineUnavailable)
            or isinstance(exc.__cause__, EngineUnavailable)
        )

    async def _release(self, lease_id: str, group_ids: list[str], error: str | None = None) -> None:
        try:
            await self.client.release(lease_id, group_ids, error)
            self.stats.groups_released += len(group_ids)
        except BrokerError as exc:
            log.warning("release of %s failed (the lease will expire instead): %s", group_ids, exc)

    async def _sample_group(self, pg: PromptGroup) -> Group:
        try:
            prompt_ids = self.task.prompt_ids(pg.row)
        except BaseException:
            self.unfinished_samples -= pg.n  # none of its samples will start
            self._changed.set()
            raise
        if pg.n > 1 and self.config.sampling.max_new_tokens <= self.agent_cfg.group_request_max_new_tokens:
            samples = await self._sample_together(pg, prompt_ids)
        else:
            samples = await self._sample_each(pg, prompt_ids)
        return Group(
            group_id=pg.group_id,
            samples=samples,
            meta={"node": self.name, "row": pg.row.index, "data_source": pg.row.data_source},
        )

    async def _sample_together(self, pg: PromptGroup, prompt_ids: list[int]) -> list[Sample]:
        """The group's samples from one /generate with sampling_params.n, then scored."""
        try:
            partials = await generate_group(
                self.pool,
                prompt_ids,
                pg.n,
                max_new_tokens=self.config.sampling.max_new_tokens,
                sampling=self._base_sampling,
                stop_token_ids=self.task.stop_token_ids,
                limits=self.agent_cfg,
            )
            return list(await asyncio.gather(*(self._score(pg.row, prompt_ids, p) for p in partials)))
        finally:
            self.unfinished_samples -= pg.n
            self._changed.set()

    async def _sample_each(self, pg: PromptGroup, prompt_ids: list[int]) -> list[Sample]:
        """The group's samples as one request each (each engine place is reused as its sample ends)."""
        jobs = [asyncio.create_task(self._sample(pg.row, prompt_ids)) for _ in range(pg.n)]
        try:
            samples = await asyncio.gather(*jobs)
        except BaseException:
            for j in jobs:
                if not j.done() and not j.cancelling():  # gather already cancelled them when we were
                    j.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            raise
        return samples

    async def _sample(self, row: PromptRow, prompt_ids: list[int]) -> Sample:
        try:
            return await self._generate_and_score(row, prompt_ids)
        finally:
            self.unfinished_samples -= 1
            self._changed.set()

    async def _generate_and_score(self, row: PromptRow, prompt_ids: list[int]) -> Sample:
        partial = await generate(
            self.pool,
            prompt_ids,
            max_new_tokens=self.config.sampling.max_new_tokens,
            sampling=self._base_sampling,
            stop_token_ids=self.task.stop_token_ids,
            limits=self.agent_cfg,
        )
        return await self._score(row, prompt_ids, partial)

    async def _score(self, row: PromptRow, prompt_ids: list[int], partial: PartialResponse) -> Sample:
        score = await self.task.score(row, partial.token_ids)
        self.stats.samples += 1
        self.stats.tokens += len(partial.token_ids)
        self.stats.resumes += partial.resumes
        self.stats.retries += partial.retries
        return Sample(
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            response_ids=np.asarray(partial.token_ids, dtype=np.int32),
            logprobs=np.asarray(partial.logprobs, dtype=np.float32),
            versions=partial.version_array(),
            reward=score.reward,
            finish_reason=partial.finish_reason or "abort",
            meta={"segments": partial.segments, "resumes": partial.resumes, **score.metrics},
        )

    def _log_progress(self, what: str) -> None:
        s = self.stats
        elapsed = max(1e-9, time.monotonic() - s.started)
        log.info(
            "%s: %d groups submitted, %d rejected, %d released, %d failed; %d samples, %.1f tokens/s; "
            "%d resumes, %d retries; policy version %d",
            what,
            s.groups_submitted,
            s.groups_rejected,
            s.groups_released,
            s.groups_failed,
            s.samples,
            s.tokens / elapsed,
            s.resumes,
            s.retries,
            self.policy_version,
        )
