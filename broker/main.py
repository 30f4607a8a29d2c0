"""``tidal broker``: run the sample broker until SIGTERM/SIGINT.

It replays the journal (``broker.journal.dir``, default ``<run_dir>/journal``), binds ``broker.bind``,
and serves rollout nodes and the trainer. Prompts come from ``broker.data.path`` (parquet or JSONL in
verl's format).
"""

from __future__ import annotations

import asyncio
import logging
import signal

from tidal.broker import native_codec
from tidal.broker.journal import Journal
from tidal.broker.journal_lock import lock_journal_dir
from tidal.broker.local_memory import allow_memory_reads
from tidal.broker.metrics import serve_metrics
from tidal.broker.process import (
    huge_page_heap_active,
    keep_freed_memory,
    prefault_heap,
    reexec_with_huge_page_heap,
    tune_gc,
)
from tidal.broker.server import BrokerServer
from tidal.broker.source import PromptSource, data_files, load_rows
from tidal.broker.state import BrokerState
from tidal.errors import ConfigError

log = logging.getLogger("tidal.broker")
_held_locks: list[int] = []  # descriptors of the journal locks this process holds (journal_lock.py)


def build_state(config) -> BrokerState:
    """Load the prompt source and replay the journal."""
    cfg = config.broker
    if not cfg.data.path:
        raise ConfigError(
            "broker.data.path is not set: give the broker parquet or JSONL in verl's format (a file, a "
            "directory of them or a list; tidal run writes one for the task; `tidal broker` needs it explicitly)"
        )
    files = data_files(cfg.data.path)
    rows = load_rows(files)
    shown = ", ".join(str(f) for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    log.info("prompt data: %d rows from %s", len(rows), shown)
    source = PromptSource(rows, seed=cfg.data.seed, shuffle=cfg.data.shuffle, epochs=cfg.data.epochs)
    journal_dir = config.journal_dir()
    _held_locks.append(lock_journal_dir(journal_dir, cfg.bind))  # for the process's life
    journal = Journal.from_config(journal_dir, cfg.journal)
    state = BrokerState(cfg, source, journal)
    records = journal.open()
    state.replay(records, journal.replayed_locs)
    state.maybe_compact()
    return state


async def _serve(config) -> None:
    keep_freed_memory()
    heap = config.broker.huge_page_heap_bytes
    if heap and huge_page_heap_active():
        prefault_heap(heap)
        log.info("heap on huge pages, %d MiB faulted in", heap >> 20)
    if config.broker.memory_reads and not allow_memory_reads():
        log.info("no Yama ptrace exception set: local consumers read this broker's memory only where allowed")
    codec, how = native_codec.load()
    log.info("group codec: %s", how if codec is not None else f"Python only ({how})")
    state = build_state(config)
    tune_gc()
    server = BrokerServer(config.broker, state)
    if config.broker.metrics_port is not None:
        serve_metrics(config.broker.metrics_port, config.broker.metrics_host, lambda: server.snapshot)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    s = state.stats()
    log.info(
        "broker on %s: journal %s (%d bytes), version %d, next batch %d, %d groups buffered, %d requeued",
        config.broker.bind,
        state.journal.path,
        state.journal.bytes_written,
        s["policy_version"],
        s["batches"]["next"],
        s["buffered_groups"],
        s["requeued"],
    )
    try:
        await server.serve(stop)
    finally:
        state.journal.close()
        log.info("broker stopped")


def main(config, args: list[str]) -> int:
    if args:
        raise ConfigError(f"tidal broker takes no flags, got {args}; configure it with broker.* overrides")
    if config.broker.huge_page_heap_bytes:
        reexec_with_huge_page_heap()  # returns only where it cannot
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvloop

    uvloop.run(_serve(config))
    return 0
