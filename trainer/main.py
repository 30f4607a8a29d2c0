"""``tidal train``: the GRPO trainer, launched with torchrun; pulls batches from the broker.

    torchrun --nproc-per-node N -m tidal.cli train [CONFIG.yaml] [key=value ...]
        [--broker ADDR] [--init HF_DIR] [--out DIR] [--export HF_DIR] [--resume auto|never]

Per batch: group-normalised advantages, split into ``trainer.minibatches_per_batch`` minibatches, one
optimizer step each (each step bumps the policy version, so staleness is never under-reported), weight sync
to the engines, the new version published to the broker, metrics to ``<run_dir>/metrics.jsonl``. Every
``trainer.checkpoint_every`` steps (at a batch boundary) a checkpoint to ``--out`` (default
``<run_dir>/train``), after which the broker learns the batch was consumed; a restarted trainer resumes from
the latest checkpoint and asks for the batch after the last one it trained on. SIGTERM or SIGINT stops it at
the next batch boundary with a checkpoint (exit code 143; trainer/stop_request.py). Rank 0 fetches the next
batch in a background thread while the current one trains.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from tidal.broker.curve import client_keys
from tidal.broker.process_identity import this_process
from tidal.config import RunConfig
from tidal.errors import NO_BATCH_EXIT, ConfigError
from tidal.heap import freeze_start_up_heap
from tidal.model_identity import model_identity
from tidal.trainer.flags import parse_flags
from tidal.trainer.stop_request import StopRequest

log = logging.getLogger("tidal.trainer")


@dataclass
class TrainOptions:
    broker: str | None = None
    init: str | None = None
    out: str | None = None
    export: str | None = None
    resume: str = "auto"


def parse_options(args: list[str]) -> TrainOptions:
    opts = parse_flags(
        args,
        TrainOptions(),
        "tidal train",
        "--broker ADDR, --init HF_DIR, --out DIR, --export HF_DIR, --resume auto|never",
    )
    if opts.resume not in ("auto", "never"):
        raise ConfigError(f"--resume={opts.resume!r}; use auto or never")
    return opts


class _BatchFeed:
    """Rank 0's broker connection: batches fetched one ahead in a thread; the rest on the main thread."""

    def __init__(
        self,
        address: str,
        timeout_s: float,
        name: str,
        curve=None,
        broker_wait_s: float = 0.0,
        model: dict[str, str] | None = None,
        ask_ahead: str = "starved",
    ):
        from tidal.broker.client import BrokerClient

        self.ask_ahead = ask_ahead  # trainer.ask_ahead: "starved" or "never"

        self.address = address
        self.timeout_s = timeout_s
        self.fetcher = BrokerClient(address, curve=curve)
        self.control = BrokerClient(address, curve=curve)
        # with the model's identity the broker turns away rollout nodes serving another (broker/membership.py);
        # with the process's, a trainer restarted here after a crash need not wait for this one to be forgotten
        meta = {"process": this_process()}
        if model is not None:
            meta["model"] = model
        self.control.register("trainer", name, meta, wait_s=broker_wait_s)
        # the control connection is used by the main thread and the heartbeat's
        self._control_lock = threading.Lock()
        interval_s = self.control.joined.get("node_timeout_s", 30.0) / 3
        self._heartbeat = _Heartbeat(self.control, self._control_lock, interval_s)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self.pending: tuple[int, concurrent.futures.Future] | None = None
        self._engines: list[str] = []
        self.stop: StopRequest | None = None  # once a stop is asked for, the broker gets little time

    def prefetch(self, after: int) -> None:
        if self.pending is None or self.pending[0] != after:
            self.pending = (after, self.pool.submit(self.fetcher.get_batch, after, None, self.timeout_s))

    def get(self, after: int, wait_s: float | None = None):
        """Batch ``after + 1`` (None when the broker has none); raises TimeoutError after ``wait_s``
        (the request stays pending for the next call)."""
        self.prefetch(after)
        _, future = self.pending
        # A trainer that has to wait for its batch is starved: its fetches then ask one batch ahead, so that
        # the broker's reply time overlaps the copying and decoding of the batch before; one whose batch
        # is ready leaves that off (always on, it moved that work into the default job's CPU steps, 5-9%
        # slower). docs/protocol.md, "A client may ask one batch ahead".
        self.fetcher.ask_ahead = self.ask_ahead == "starved" and not future.done()
        try:
            batch = future.result(timeout=wait_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError from None
        self.pending = None
        return batch

    # A broker killed with one of these calls in flight never answers it; it is restarted on its journal
    # (`tidal run` does). Each call is cumulative (the next version, the next report, the next stats cover
    # a lost one), so the trainer goes on instead of dying on the BrokerTimeout.
    def publish_version(self, version: int) -> None:
        self._tolerant(self.control.publish_version, version)

    def report_consumed(self, batch_id: int) -> None:
        self._tolerant(self.control.report_consumed, batch_id)

    def why_it_cannot_resume(self, last_batch_id: int, out: Path) -> str | None:
        """Why a trainer would ask for a batch the broker's run has trained through already (a new or
        wrong ``--out``: no checkpoint, or an older one), so that it fails naming why before the broker
        refuses its first fetch with a bare ``bad_request``; None when it can resume."""
        stats = self._tolerant(self.control.stats)
        consumed = stats["batches"]["consumed"] if stats is not None else -1
        if last_batch_id >= consumed:
            return None
        where = f"it has no checkpoint in {out}"
        if last_batch_id >= 0:
            where = f"its checkpoint in {out} ends at batch {last_batch_id}"
        return (
            f"the broker's run has trained through batch {consumed} (reported by a trainer's checkpoint), "
            f"but {where}; start it with that run's checkpoint directory (--out, by default "
            "<run_dir>/train), or give a new run its own broker journal"
        )

    def why_no_batch(self) -> tuple[str, str]:
        """Why ``get`` gave None: ``("exhausted", ...)`` when no group will ever come again, else
        ``("timeout", ...)``, each with a line saying what the broker holds."""
        stats = self._tolerant(self.control.stats)
        if stats is None:
            return "timeout", "the broker did not answer a stats request either"
        if stats.get("finished"):
            cursor = stats["cursor"]
            return "exhausted", (
                f"the broker's data is exhausted: it handed out its {cursor['rows']} rows "
                f"{cursor['epoch']} time(s) (broker.data.epochs) and nothing is in flight"
            )
        rollout = sum(n["role"] == "rollout" and n["alive"] for n in stats.get("nodes", {}).values())
        return "timeout", (
            f"broker: {rollout} rollout node(s) alive, {stats['queue_depth']} groups queued, "
            f"{stats['in_flight_groups']} in flight, {stats['buffered_groups']} buffered"
        )

    def engines(self) -> list[str]:
        stats = self._tolerant(self.control.stats)
        if stats is not None:
            self._engines = sorted(
                url
                for node in stats.get("nodes", {}).values()
                if node.get("role") == "rollout" and node.get("alive")
                for url in node.get("meta", {}).get("engines", [])
            )
        return self._engines

    def _tolerant(self, call, *args):
        from tidal.broker.client import BrokerTimeout

        if self.stop is not None and self.stop.requested:
            # the checkpoint matters, not these calls: with the whole job stopping (a killed `tidal run`
            # signals every process at once) the broker may be gone, and each call would wait it out
            self.control.timeout_s = min(self.control.timeout_s, STOPPING_BROKER_TIMEOUT_S)
        try:
            with self._control_lock:
                return call(*args)
        except BrokerTimeout as exc:
            log.warning("%s; going on (the broker may be restarting; the next call covers this one)", exc)
            return None

    def close(self) -> None:
        from tidal.broker.client import BrokerError

        self._heartbeat.stop()
        # leaving lets a restarted trainer register at once instead of waiting for this one to be forgotten
        self.control.timeout_s = min(self.control.timeout_s, STOPPING_BROKER_TIMEOUT_S)
        try:
            with self._control_lock:
                self.control.leave()
        except BrokerError as exc:  # gone, or restarting: it forgets this trainer after node_timeout_s
            log.info("leaving the broker: %s", exc)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.fetcher.close()
        self.control.close()


class _Heartbeat:
    """Heartbeats on the feed's control connection every ``interval_s``: a step longer than the broker's
    ``node_timeout_s`` otherwise left the trainer dead in its stats, and let a second trainer register
    (broker/membership.py). Broker timeouts are the feed's to report; here they are only skipped."""

    def __init__(self, client, lock: threading.Lock, interval_s: float):
        self.client, self.lock, self.interval_s = client, lock, interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tidal-trainer-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from tidal.broker.client import BrokerError

        while not self._stopped.wait(self.interval_s):
            try:
                with self.lock:  # a short wait: a stopping trainer's calls queue behind it
                    self.client.heartbeat(timeout_s=STOPPING_BROKER_TIMEOUT_S)
            except BrokerError as exc:
                log.debug("heartbeat: %s", exc)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=STOPPING_BROKER_TIMEOUT_S + 1)


CATCH_UP_POLL_S = 2.0
STOPPING_BROKER_TIMEOUT_S = 3.0
# not 0: a supervisor that did not ask for the stop restarts the trainer, which resumes from the checkpoint
STOPPED_EXIT_CODE = 143


STOP = object()  # what _next_batch returns when a signal asked the trainer to stop (trainer/stop_request.py)


def _next_batch(feed, progress, push: _WeightPush, stop: StopRequest):
    """The next broker batch (rank 0 fetches, every rank gets it), or STOP. While it is not there, engines
    that joined since the last sync get the current weights: the trainer only syncs after a step, so without
    this a node joining a starved job would generate with old weights whose samples the broker drops as
    stale, and no batch would ever come."""
    while True:
        if stop.agreed():
            return STOP
        message = None
        if feed is not None:
            try:
                message = ("batch", feed.get(progress.last_batch_id, CATCH_UP_POLL_S))
            except TimeoutError:
                message = ("waiting", None)
        if message is not None and message[0] == "batch" and message[1] is None:
            message = ("end", feed.why_no_batch())
        kind, batch = _broadcast(message)
        if kind == "batch":
            return batch
        if kind == "end":
            return NoBatch(*batch)
        push.catch_up(progress.step)


@dataclass(frozen=True)
class NoBatch:
    """What _next_batch returns when the broker gives no batch: ``reason`` is ``exhausted`` (no group will
    ever come: the run ends early, with its export) or ``timeout`` (``trainer.batch_timeout_s`` passed: the
    trainer saves its checkpoint and fails, so that a restart resumes)."""

    reason: str
    detail: str


def _broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main(config: RunConfig, args: list[str]) -> int:
    from tidal.trainer.advantages import batch_advantages, reward_stats
    from tidal.trainer.checkpoint import Progress, latest
    from tidal.trainer.losses import check_loss_setup
    from tidal.trainer.metrics import MetricsWriter
    from tidal.trainer.packing import items_from_groups, split_minibatches
    from tidal.trainer.runner import TrainerRank
    from tidal.trainer.synthetic import make_loss

    opts = parse_options(args)
    tc = config.trainer
    check_loss_setup(tc.loss, tc.minibatches_per_batch)
    curve = client_keys(tc.curve_secret_key_file, tc.curve_server_key_file, "trainer")  # before any model
    run_dir = Path(config.run_dir)
    out = Path(opts.out) if opts.out else run_dir / "train"
    export = Path(opts.export) if opts.export else run_dir / "final_hf"
    resuming = opts.resume == "auto" and latest(out) is not None
    # the initial weights: the checkpoint's when resuming; the reference model (KL) loads --init either way
    trainer = TrainerRank(config, total_steps=tc.steps, init_hf=opts.init, load_init=not resuming)
    progress = trainer.resume(out) if resuming else None
    if progress is None:
        progress = Progress()
    feed = (
        _BatchFeed(
            opts.broker or config.broker.bind,
            tc.batch_timeout_s,
            # host and pid tell two trainers apart in the broker's messages (one trainer at a time)
            f"trainer-{dist.get_world_size()}ranks@{socket.gethostname()}:{os.getpid()}",
            curve,
            tc.broker_wait_s,
            model_identity(config.model),
            tc.ask_ahead,
        )
        if trainer.rank == 0
        else None
    )
    writer = MetricsWriter(run_dir) if trainer.rank == 0 else None
    push = _WeightPush(config, trainer, feed)
    stop = StopRequest()
    if feed is not None:
        feed.stop = stop
    try:
        # Every rank leaves with the refusal's exit code: were rank 0 to leave alone, another rank would
        # find rank 0's end of a collective closed and might exit (with 1) first, which torchrun reports.
        refusal = feed.why_it_cannot_resume(progress.last_batch_id, out) if feed is not None else None
        if (refusal := _broadcast(refusal)) is not None:
            raise ConfigError(
                refusal if trainer.rank == 0 else f"rank {trainer.rank} stops with rank 0, which says why"
            )
        if feed is not None:
            feed.publish_version(progress.step)
        # torch, megatron-core and the model built hundreds of thousands of objects that live until exit:
        # without this, each full collection walks them all while a batch decodes (benchmarks/feed_gc.py)
        log.info("garbage collector: %d start-up objects frozen", freeze_start_up_heap())
        last_saved = progress.step
        last_wall = time.perf_counter()
        stopped = False
        ended: NoBatch | None = None
        while progress.step < tc.steps:
            batch = _next_batch(feed, progress, push, stop)
            if batch is STOP:
                stopped = True  # every rank saw it (a collective): all save and leave together
                break
            if isinstance(batch, NoBatch):
                ended = batch
                break
            if feed is not None:
                feed.prefetch(batch.batch_id)
            groups = batch.groups
            advantages = batch_advantages(groups, norm_by_std=tc.loss.norm_adv_by_std)
            adv_by_group = dict(zip((g.group_id for g in groups), advantages, strict=True))
            minibatches = split_minibatches(groups, min(tc.minibatches_per_batch, len(groups)))
            plans = []
            for minibatch in minibatches:
                items = items_from_groups(minibatch, [adv_by_group[g.group_id] for g in minibatch])
                plans.append((minibatch, items, trainer.plan(items)))
            # the proximal policy is the batch's starting point: every minibatch's logprobs before any update
            proximal = [trainer.proximal(plan, _train_temperature(config)) for _, _, plan in plans]
            for (minibatch, items, plan), plan_proximal in zip(plans, proximal, strict=True):
                loss_fn = make_loss("grpo", tc.loss, plan.normalizer, current_version=progress.step)
                push.before_step()
                result = trainer.step(
                    plan,
                    loss_fn,
                    with_entropy=tc.loss.entropy_coef > 0,
                    temperature=_train_temperature(config),
                    proximal=plan_proximal,
                )
                progress.step += 1
                progress.samples += len(items)
                sync_s = push.after_step(progress.step)
                if feed is not None:
                    feed.publish_version(progress.step)
                now = time.perf_counter()
                if writer is not None:
                    metrics = dict(result.stats)
                    if sync_s is not None:
                        metrics["time/weight_sync_s"] = sync_s
                    metrics.update(reward_stats(minibatch).summary())
                    metrics.update(
                        {
                            "loss": result.loss,
                            "grad_norm": result.grad_norm,
                            "throughput/tokens_per_s": result.tokens / max(result.seconds, 1e-9),
                            "throughput/samples_per_s": len(items) / max(result.seconds, 1e-9),
                            "throughput/wall_samples_per_s": len(items) / max(now - last_wall, 1e-9),
                            "staleness/batch": progress.step - 1 - min(g.min_version for g in minibatch),
                            "batch_id": batch.batch_id,
                            "lr": trainer.state.optimizer.param_groups[0]["lr"],
                        }
                    )
                    writer.write(progress.step, metrics)
                last_wall = now
            progress.last_batch_id = batch.batch_id
            due = tc.checkpoint_every and progress.step - last_saved >= tc.checkpoint_every
            if due or progress.step >= tc.steps:
                trainer.save(out, progress)
                last_saved = progress.step
                if feed is not None:
                    feed.report_consumed(batch.batch_id)
        if progress.step > last_saved:
            trainer.save(out, progress)
            if feed is not None and progress.last_batch_id >= 0:
                feed.report_consumed(progress.last_batch_id)
        if stopped:
            if trainer.rank == 0:
                by = stop.name if stop.requested else "a signal to another rank"
                print(
                    f"tidal train: stopped by {by} after step {progress.step} (broker batch "
                    f"{progress.last_batch_id}); its checkpoint is in {out}, a restart resumes from it",
                    file=sys.stderr,
                    flush=True,
                )
            return STOPPED_EXIT_CODE
        if ended is not None and trainer.rank == 0:
            what = (
                f"no batch from the broker within trainer.batch_timeout_s={tc.batch_timeout_s:g}s"
                if ended.reason == "timeout"
                else "the run ends early"
            )
            print(
                f"tidal train: {what} after step {progress.step} of {tc.steps} (broker batch "
                f"{progress.last_batch_id}): {ended.detail}",
                file=sys.stderr,
                flush=True,
            )
        if ended is not None and ended.reason == "timeout":
            if trainer.rank == 0:
                print(
                    f"tidal train: its checkpoint is in {out}; a restart resumes from it",
                    file=sys.stderr,
                    flush=True,
                )
            return NO_BATCH_EXIT  # not restarted by `tidal run`: the job is starving the trainer
        trainer.export_hf(export, tokenizer_from=opts.init)
        return 0
    finally:
        stop.restore()
        push.close()
        if writer is not None:
            writer.close()
        if feed is not None:
            feed.close()
        trainer.close()


def _reached(report, urls: list[str]) -> str:
    """``3 engine(s)``, or ``2 of 3 engine(s), left out: URL`` when the sync had to leave engines out (the
    sender logs why, once per engine and reason)."""
    left_out = sorted(set(urls) - set(report.engines))  # the engines the sync ended with
    if not left_out:
        return f"{len(urls)} engine(s)"
    return f"{len(urls) - len(left_out)} of {len(urls)} engine(s), left out: {', '.join(left_out)}"


class LeftOut:
    """Engines a weight sync dropped (down, restarting, or refusing: another model). Each is tried again
    after 1, 2, 4, ... steps (at most ``MAX_STEPS``): a restarted engine gets the weights at once, and one
    that keeps refusing costs a failed attempt only now and then, not at every step."""

    MAX_STEPS = 64

    def __init__(self) -> None:
        self.until: dict[str, int] = {}  # url -> the step from which it is tried again
        self.wait: dict[str, int] = {}  # url -> the steps it waited last time

    def filter(self, urls: list[str], step: int) -> list[str]:
        return [u for u in urls if step >= self.until.get(u, 0)]

    def update(self, report, step: int) -> None:
        for url in set(report.dropped):
            self.wait[url] = min(2 * self.wait.get(url, 0) or 1, self.MAX_STEPS)
            self.until[url] = step + self.wait[url]
        for url in report.engines:  # those the sync reached
            self.until.pop(url, None)
            self.wait.pop(url, None)


def _train_temperature(config: RunConfig) -> float:
    """The sampling temperature of the rollouts (their logprobs are of the scaled distribution)."""
    t = config.rollout.sampling.temperature
    return t if t > 0 else 1.0


class _WeightPush:
    """Weight sync to the rollout engines the broker knows; the engine set is re-read every step."""

    def __init__(self, config: RunConfig, trainer, feed):
        self.config, self.trainer, self.feed = config, trainer, feed
        self.sync = None
        self.urls: list[str] = []
        self.left_out = LeftOut()  # engines a sync dropped, tried again after a growing number of steps

    def _listed(self, step: int) -> list[str]:
        """The engines to sync now (rank 0 decides, every rank gets the same list): the broker's, less those
        a recent sync left out. A dropped engine used to stay out until the broker's list changed: one
        restarted on its URL never got weights again."""
        if self.feed is None:
            return _broadcast(None)
        return _broadcast(self.left_out.filter(self.feed.engines(), step))

    def _settled(self, report, step: int) -> None:
        if self.trainer.rank == 0 and report is not None:
            self.left_out.update(report, step)

    def _engines(self, urls: list[str]) -> None:
        """Point the sender at ``urls`` (a changed set rebuilds the group at the next sync)."""
        from tidal.weights_sync.engine_api import EngineEndpoint

        engines = [EngineEndpoint(url) for url in urls]
        if self.sync is None:
            from tidal.weights_sync.trainer_sync import TrainerWeightSync

            self.sync = TrainerWeightSync(
                self.config.weights_sync, self.config.model, self.trainer.state.chunks, engines
            )
        elif urls != self.urls or set(urls) != set(self.sync.engines):
            self.sync.set_engines(engines)  # also adds back an engine a sync dropped (LeftOut says when)
        self.urls = urls

    def before_step(self) -> None:
        """Colocated engines release their GPU memory while the trainer steps (weights_sync.colocated_sleep)."""
        if self.sync is not None:
            self.sync.before_step()

    def after_step(self, step: int) -> float | None:
        """Sync if due; returns the seconds it took (None when there was nothing to sync)."""
        from tidal.trainer.optimizer import gather_full_weights

        urls = self._listed(step)
        if not urls:
            return None
        self._engines(urls)
        started = time.perf_counter()
        gather_full_weights(self.trainer.state.chunks)  # fsdp2: the sender reads full weights
        report = self.sync.after_step(step, step)
        seconds = time.perf_counter() - started
        self._settled(report, step)
        if self.trainer.rank == 0 and report is not None:
            how = "replayed" if report.replayed else "announced"
            print(f"step {step}: weights to {_reached(report, urls)} in {seconds:.2f}s ({how})")
        return seconds if report is not None else None

    def catch_up(self, step: int) -> None:
        """Sync the current weights if the broker lists engines the last sync did not reach."""
        from tidal.trainer.optimizer import gather_full_weights

        urls = self._listed(step)
        if not urls or urls == self.urls or (self.sync is None and step == 0):
            return  # at step 0 every engine holds the initial weights
        self._engines(urls)
        started = time.perf_counter()
        gather_full_weights(self.trainer.state.chunks)
        report = self.sync.sync(step)
        self._settled(report, step)
        if self.trainer.rank == 0:
            print(
                f"waiting for a batch: weights of step {step} to {_reached(report, urls)} (the set changed) "
                f"in {time.perf_counter() - started:.2f}s"
            )

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
