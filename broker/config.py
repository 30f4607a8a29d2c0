"""Configuration of the broker."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | list[str] | None = Field(
        None,
        description="parquet or JSONL in verl's format: a file, a directory of them (read in name order) or "
        "a list of either (concatenated in order, e.g. several data sets); None: the task generates it",
    )
    shuffle: bool = True
    seed: int = 0
    epochs: int | None = Field(None, ge=1, description="None: cycle forever")


class JournalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dir: str | None = Field(None, description="None: <run_dir>/journal")
    fsync: Literal["always", "interval", "never"] = "interval"
    fsync_interval_s: float = Field(0.05, gt=0)
    compact_every_bytes: int = Field(256 << 20, gt=0, description="compact once this many bytes are dead")
    compact_dead_per_live: float = Field(
        4.0,
        ge=0,
        description="and once the dead bytes are this many times the live ones: compaction copies the live "
        "groups, so this bounds that copy to 1/ratio of the bytes journaled (0: the byte threshold alone)",
    )
    direct_io: bool = Field(
        True, description="append with O_DIRECT (falls back to the page cache where the file system refuses)"
    )
    inline_bytes: int = Field(
        4 << 20,
        ge=0,
        description="with writer 'thread': the records of one batch of requests handled that come to at most "
        "this many bytes are written by the event loop at once, without waking the writer thread (the "
        "wake-ups cost more than small writes); larger ones and compactions go to the thread, and so do "
        "all while it is writing. 0: always the thread. At 1 MiB a 1K-token run's larger commits sent it "
        "to the thread often enough to cost the broker ~2 CPU-us a sample (docs/decisions.md, session 34)",
    )
    spare_files: int = Field(
        2,
        ge=0,
        description="journal files compaction no longer needs that are kept to be written over by the next "
        "ones instead of deleted (O_DIRECT journals only): writing over a file's blocks ran ~30% faster than "
        "appending new ones here, and deleting trims them (discard). Costs their disk space",
    )
    writer: Literal["thread", "loop"] = Field(
        "thread",
        description="who writes: 'thread' = a writer thread takes the large commits (over inline_bytes) and "
        "compactions, so the loop serves on while the device writes them; small commits the loop writes "
        "itself. 'loop' = the event loop writes every commit, once per batch of requests handled (no "
        "thread at all; serving pauses while the device writes and while compaction writes its snapshot). "
        "On a 2-core host the thread moved 8K- and 32K-token samples 10-20% faster and 1K alike "
        "(docs/decisions.md, session 34)",
    )


class CurveConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    server_secret_key_file: str | None = None
    allowed_client_keys_dir: str | None = None


def check_curve_pair(secret_key_file: str | None, server_key_file: str | None, prefix: str) -> None:
    """A client's CURVE settings (``PREFIX.curve_secret_key_file`` and ``PREFIX.curve_server_key_file``) go
    together; raises ValueError (the config model's error) for one without the other."""
    if (secret_key_file is None) != (server_key_file is None):
        raise ValueError(
            f"CURVE needs both {prefix}.curve_secret_key_file and {prefix}.curve_server_key_file"
        )


class BrokerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    bind: str = Field("tcp://127.0.0.1:5555", description="ZeroMQ ROUTER address")
    metrics_port: int | None = Field(None, description="Prometheus endpoint port; None: off")
    metrics_host: str = Field("127.0.0.1", description="interface the Prometheus endpoint listens on")
    group_size: int = Field(8, ge=1, description="samples per prompt (GRPO's G)")
    batch_groups: int = Field(32, ge=1, description="prompt groups per training batch")
    max_staleness: int = Field(2, ge=0, description="eta; 0 is synchronous on-policy")
    staleness_policy: Literal["drop", "keep"] = "drop"
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards are all equal")
    lease_timeout_s: float = Field(60.0, gt=0)
    max_group_failures: int = Field(
        3,
        ge=1,
        description="a group that nodes failed to sample this many times (a prompt longer than the engine's "
        "context, a reward function that raises on it) is dropped, journaled and counted instead of being "
        "leased again forever; failures of an engine itself (gone, crashed) do not count",
    )
    node_timeout_s: float = Field(30.0, gt=0)
    max_frame_bytes: int = Field(256 << 20, gt=0)
    io_threads: int = Field(1, ge=1, description="ZeroMQ I/O threads of the broker's socket")
    status_every_s: float = Field(
        30.0,
        ge=0,
        description="0: off. Else the broker logs a status line this often: nodes alive by role, policy "
        "version, queue, groups in flight and buffered, groups accepted (samples/s and MB/s since the last "
        "line), batches cut and consumed, dropped, filtered, expired, rejected, bad frames, the cursor",
    )
    memory_reads: bool = Field(
        True,
        description="a consumer on the broker's host may copy a batch's group frames out of the broker's "
        "memory (process_vm_readv, checked against each group's CRC) instead of reading them back from "
        "the journal's device, which then only writes; off: such consumers read the journal",
    )
    submit_memory_bytes: int = Field(
        256 << 20,
        ge=0,
        description="0: off. Else a rollout node on the broker's host is offered a ring of this many bytes "
        "of memory shared with the broker (memfd) to encode its group frames into, and submits only where "
        "they lie: the frames then never cross loopback into the broker. The ring holds the node's groups "
        "until the broker lets go of them (consumed or dropped); when it is full, submits go over the "
        "wire. Memory is committed as the ring is first filled, up to this size per local node (a node "
        "goes back to the ring's start once the room there is twice the most bytes it has had in flight, so "
        "it touches "
        "about three times those)",
    )
    huge_page_heap_bytes: int = Field(
        0,
        ge=0,
        description="0: off. Else the broker process runs with glibc's heap on transparent huge pages (one "
        "arena for all threads; it starts itself again with glibc's tunables, same pid) and faults this "
        "many bytes of it in at start (~0.6 s of CPU per 256 MiB here), then keeps them: the group frames "
        "ZeroMQ receives lie on huge pages, which a consumer on this host copies 2-3x faster (the kernel "
        "pins each page it reads) and which the I/O thread then never faults. Size it to the frames the "
        "broker holds, about (max_staleness + 2) x batch_groups groups",
    )
    data: DataConfig = DataConfig()
    journal: JournalConfig = JournalConfig()
    curve: CurveConfig = CurveConfig()
