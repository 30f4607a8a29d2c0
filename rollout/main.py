"""``tidal rollout --broker ADDR``: run a rollout node agent until SIGTERM or until the data is exhausted.

    tidal rollout configs/tiny.yaml --broker tcp://10.0.0.5:5555 [--name NODE] [--engine URL ...]

Without ``--engine`` (or ``rollout.engine_urls``, or ``rollout.engine.url``) the node starts
``rollout.engines_per_node`` engines itself as child processes: ``tidal serve`` for the embedded engine,
``python -m sglang.launch_server`` for SGLang. With them it drives engines that are already serving
SGLang's HTTP protocol. ``--broker`` defaults to ``broker.bind``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tidal.configio import dump_config
from tidal.errors import ConfigError
from tidal.procs import die_with_parent, free_port
from tidal.rollout.engine_pool import EnginePool, EngineSlot, Launch

log = logging.getLogger("tidal.rollout")


def parse_args(config, args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tidal rollout", add_help=False)
    parser.add_argument("--broker", default=config.broker.bind)
    parser.add_argument("--name", default=f"{socket.gethostname()}-{os.getpid()}")
    parser.add_argument("--engine", action="append", default=[], help="URL of an engine already serving")
    ns, unknown = parser.parse_known_args(args)
    if unknown:
        raise ConfigError(
            f"tidal rollout: unknown flag(s) {unknown}; flags are --broker ADDR, --name NAME, --engine URL"
        )
    if "*" in ns.broker or "0.0.0.0" in ns.broker:
        raise ConfigError(
            f"--broker {ns.broker}: that is a bind address; give the broker's reachable address, "
            "e.g. tcp://10.0.0.5:5555"
        )
    return ns


def engine_launcher(config, node_dir: Path) -> Launch:
    """Start engine ``index`` on ``port``: ``tidal serve`` with this node's resolved config (embedded), or
    ``python -m sglang.launch_server`` (sglang without a url)."""
    engine = config.rollout.engine
    if engine.type == "embedded":
        config_path = node_dir / "config.yaml"
        dump_config(config, config_path)
        devices_per_engine = 1

        def command(port: int) -> list[str]:
            return [
                sys.executable,
                "-m",
                "tidal.cli",
                "serve",
                str(config_path),
                "--host",
                engine.host,
                "--port",
                str(port),
            ]

        on_cuda = engine.device.startswith("cuda")
    else:
        from tidal.rollout.sglang_launcher import sglang_command

        if not config.model.path:
            raise ConfigError("rollout.engine.type=sglang needs model.path (the checkpoint SGLang serves)")
        devices_per_engine = engine.tp

        def command(port: int) -> list[str]:
            return sglang_command(engine, config.model.path, port=port)

        on_cuda = True
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]

    def launch(index: int, port: int) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if on_cuda and config.rollout.engines_per_node > 1:
            ids = range(index * devices_per_engine, (index + 1) * devices_per_engine)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(
                visible[i % len(visible)] if visible else str(i) for i in ids
            )
        out = open(node_dir / f"engine-{index}.log", "ab")  # noqa: SIM115 - the child owns it
        try:
            # Own session: a SIGTERM or Ctrl-C sent to the node's process group reaches the agent alone,
            # which drains and then stops its engines itself. The parent-death signal kills the engines
            # when the agent dies without that (SIGKILL, crash).
            return subprocess.Popen(
                command(port),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent(os.getpid(), signal.SIGKILL),  # no engine outlives the agent
            )
        finally:
            out.close()

    return launch


def build_pool(config, engine_urls: list[str], node_dir: Path) -> EnginePool:
    rollout = config.rollout
    agent = rollout.agent
    common = {
        "concurrency": rollout.concurrency,
        "request_timeout_s": agent.request_timeout_s,
        "start_timeout_s": agent.engine_start_timeout_s,
        "max_restarts": agent.engine_max_restarts,
    }
    urls = list(engine_urls or rollout.engine_urls)
    if not urls and rollout.engine.type == "sglang" and rollout.engine.url is not None:
        urls = [rollout.engine.url]
    if urls:
        slots = [EngineSlot(i, u.rstrip("/"), port=0) for i, u in enumerate(urls)]
        return EnginePool(slots, **common)
    engine = rollout.engine
    slots = []
    for i in range(rollout.engines_per_node):
        port = engine.port + i if engine.port else free_port(engine.host)
        slot = EngineSlot(
            i, f"http://{engine.host}:{port}", port=port, log_path=str(node_dir / f"engine-{i}.log")
        )
        slots.append(slot)
    return EnginePool(slots, launch=engine_launcher(config, node_dir), **common)


def served_model(config, pool: EnginePool) -> dict[str, str] | None:
    """The identity of the model this node's engines serve (tidal/model_identity.py), which the broker
    checks against the trainer's; None where the node cannot know it: engines it did not start (a pool
    without a launcher), with no ``model.path`` to say what they serve."""
    from tidal.model_identity import model_identity

    if pool.launch is None and not config.model.path:
        log.info(
            "the engines' model is not checked against the trainer's: no model.path says what they serve"
        )
        return None
    try:
        return model_identity(config.model)
    except ValueError as exc:  # a config.json tidal cannot read: the trainer could not train it either
        log.warning("the engines' model is not checked against the trainer's: %s", exc)
        return None


def load_task(config):
    from tidal.rollout.tasks import build_task, task_files
    from tidal.rollout.tasks.char_tokenizer import save_char_tokenizer

    files = task_files(config)
    if config.task.name == "arithmetic" and not (files.tokenizer / "tokenizer.json").exists():
        save_char_tokenizer(files.tokenizer)  # a node on its own machine makes the (deterministic) tokenizer
    return build_task(config)


async def run_node(config, broker: str, name: str, engine_urls: list[str]) -> int:
    from tidal.broker.client import AsyncBrokerClient
    from tidal.broker.curve import client_keys
    from tidal.rollout.agent import RolloutAgent

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    agent_cfg = config.rollout.agent
    curve = client_keys(agent_cfg.curve_secret_key_file, agent_cfg.curve_server_key_file, "rollout.agent")
    node_dir = Path(config.run_dir) / "nodes" / name
    node_dir.mkdir(parents=True, exist_ok=True)
    pool = build_pool(config, engine_urls, node_dir)
    client = AsyncBrokerClient(broker, curve=curve, timeout_s=agent_cfg.broker_timeout_s)
    task = None
    try:
        # engines boot while the tokenizer loads (both take seconds); a signal meanwhile stops cleanly
        ready = asyncio.gather(pool.start(), asyncio.to_thread(load_task, config))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not ready.done():
            ready.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ready  # retrieved, so asyncio does not log the cancelled gather as an error
            log.info("stopped while the engines were starting")
            return 0
        _, task = ready.result()
        agent = RolloutAgent(
            config.rollout,
            client,
            pool,
            task,
            name=name,
            group_size_hint=config.broker.group_size,
            group_failures_reported=config.broker.max_group_failures,
            model=served_model(config, pool),
        )
        agent.install_signal_handlers()
        return await agent.run()
    finally:
        await pool.close()
        await client.close()
        if task is not None:
            task.close()


def main(config, args: list[str]) -> int:
    ns = parse_args(config, args)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {ns.name} %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    import uvloop

    from tidal.broker.client import BrokerError
    from tidal.broker.protocol import MODEL_MISMATCH
    from tidal.rollout.engine_pool import EngineStartError

    try:
        return uvloop.run(run_node(config, ns.broker, ns.name, ns.engine))
    except BrokerError as exc:
        if exc.code == MODEL_MISMATCH:  # the same command would be refused again
            raise ConfigError(str(exc)) from None
        log.error("%s", exc)
        return 1
    except EngineStartError as exc:
        log.error("%s", exc)
        return 1
