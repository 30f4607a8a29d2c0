"""Configuration of the weight sync from trainer to engines."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class WeightSyncConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every_steps: int = Field(1, ge=1, description="sync after every k optimizer steps")
    bucket_bytes: int | None = Field(
        None,
        gt=0,
        description="flattened bucket size; the sender keeps two staging buffers of it. None: 64 MiB with "
        "gloo (CPU: small buckets let packing and the engine's load overlap the transfer), 512 MiB with "
        "NCCL (fewer HTTP announcements per GB)",
    )
    first_bucket_bytes: int | None = Field(
        None,
        gt=0,
        description="the first bucket's size, doubling per bucket up to bucket_bytes, so the first "
        "broadcast waits for a small pack; None: bucket_bytes // 8",
    )
    inflight_buckets: int = Field(
        2,
        ge=1,
        description="buckets announced to an engine before the oldest one's reply is awaited, for engines "
        "that receive in bucket_seq order (tidal's; they load bucket k while receiving k+1); 1: one at a "
        "time. SGLang engines always get one at a time",
    )
    own_broadcast_bytes: Annotated[int, Field(gt=0)] | Literal["auto"] | None = Field(
        "auto",
        description="to engines that declare bucket_segments (tidal's), contiguous tensors of at least this "
        "many bytes (alone, or back to back in memory like gate/up) go out as a broadcast of their own, "
        "straight from their memory (no pack copy), and such an engine receives them straight into its "
        "weights while paused (no load copy); smaller ones are packed. auto: 4 MiB with gloo (a broadcast "
        "costs ~0.5 ms there and a CPU copy is slow), 64 MiB with NCCL (a broadcast costs ~40-80 us of "
        "launches and handshakes, a device copy of a 6 MB matrix ~3 us); None: pack everything",
    )
    segmented_bucket_bytes: int | None = Field(
        None,
        gt=0,
        description="to engines that declare bucket_segments, a bucket's size in all: tensors sent from their "
        "own memory count only against this, packed ones also against bucket_bytes, so a bucket of large "
        "tensors needs one HTTP announcement per this many bytes instead of per bucket_bytes; None: "
        "4 x bucket_bytes",
    )
    master_port: int = Field(
        0, ge=0, description="0: pick a free port; else pipeline stage s uses master_port + s"
    )
    master_address: str | None = Field(
        None, description="address engines reach each sender at; None: this host's resolved name"
    )
    timeout_s: float = Field(60.0, gt=0, description="a node that does not answer in time is dropped")
    verify_checksums: bool = Field(False, description="send a CRC32 per bucket for the engine to compare")
    pause_mode: Literal["in_place", "abort", "retract"] | None = Field(
        "in_place",
        description="/pause_generation mode around a sync (SGLang's); None: do not pause",
    )
    retries: int = Field(1, ge=0, description="attempts after one that lost an engine (rebuilt without it)")
    replay_updates: bool = Field(
        True,
        description="repeat a sync of the same buckets without announcing them, to engines that declare "
        "replay_updates (weights_sync/replay.py); false: announce every bucket of every sync",
    )
    transport: Literal["auto", "collective", "cuda_ipc"] = Field(
        "auto",
        description="how buckets reach the engines: 'collective' (a weight-update group: gloo on CPU, NCCL "
        "on GPUs), 'cuda_ipc' (colocated: CUDA IPC handles through /update_weights_from_tensor, trainer and "
        "engines on the same GPU); 'auto': cuda_ipc when every engine reports the trainer's GPU, else "
        "collective",
    )
    colocated_sleep: bool = Field(
        True,
        description="colocated (cuda_ipc) only: the engines release their GPU memory while the trainer "
        "steps (/release_memory_occupation, after pausing with mode='retract') and retake it before the "
        "weights arrive (/resume_memory_occupation)",
    )
    colocated_sleep_tags: list[Literal["kv_cache", "weights", "cuda_graph"]] = Field(
        default_factory=lambda: ["kv_cache"],
        description="what the engines release while the trainer steps (SGLang's tags); 'weights' also "
        "frees the engine's weights (kept in pinned host memory and copied back on wake); 'cuda_graph' "
        "drops the decode graphs (recaptured on wake, which costs about a second per wake)",
    )

    def bucket_sizes(self, backend: str) -> tuple[int, int]:
        """(first bucket, bucket) in bytes for a group on ``backend``, with the defaults filled in."""
        size = self.bucket_bytes or DEFAULT_BUCKET_BYTES.get(backend, DEFAULT_BUCKET_BYTES["nccl"])
        return min(self.first_bucket_bytes or max(1, size // 8), size), size

    def own_bytes(self, backend: str) -> int | None:
        """The size from which a tensor goes on a broadcast of its own on ``backend`` (None: never)."""
        if self.own_broadcast_bytes == "auto":
            return DEFAULT_OWN_BROADCAST_BYTES.get(backend, DEFAULT_OWN_BROADCAST_BYTES["nccl"])
        return self.own_broadcast_bytes

    def segmented_bytes(self, backend: str) -> int:
        """A bucket's size in all, to engines that take segments (at least the bucket's packed size)."""
        size = self.bucket_sizes(backend)[1]
        return max(self.segmented_bucket_bytes or 4 * size, size)


DEFAULT_BUCKET_BYTES = {"gloo": 64 << 20, "nccl": 512 << 20}
DEFAULT_OWN_BROADCAST_BYTES = {"gloo": 4 << 20, "nccl": 64 << 20}
