"""The engine side of weight-update groups: join a group, receive broadcast tensors, leave.

Receiving only fills fresh buffers, so it runs in a worker thread while generation continues; loading
into the model happens afterwards on the scheduler thread. A bad announcement whose size is still known
(unknown name, shape mismatch) is received first and then rejected, so the sender's broadcast completes
and both sides stay in step; one whose size cannot be computed (unknown dtype, ragged lists) is rejected
before any receive, and the sender's broadcast times out.
"""

from __future__ import annotations

import threading

import torch

from tidal.weights_sync import bucket
from tidal.weights_sync.transport import WeightGroup, create_group


class WeightUpdateError(ValueError):
    pass


class WeightReceiver:
    def __init__(self, device: torch.device | str, timeout_s: float):
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.groups: dict[str, WeightGroup] = {}
        self._lock = threading.Lock()

    def init_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Join ``group_name`` as rank ``rank_offset`` (the engine is one process); blocks until all ranks joined."""
        if backend == "nccl" and self.device.type != "cuda":
            raise WeightUpdateError(
                f"backend='nccl' needs a CUDA engine; this engine runs on {self.device}; use 'gloo'"
            )
        if not 0 < rank_offset < world_size:
            raise WeightUpdateError(
                f"rank_offset={rank_offset} must be in [1, world_size={world_size}) (rank 0 is the sender)"
            )
        with self._lock:
            old = self.groups.pop(group_name, None)
        if old is not None:  # the sender rebuilt the group (a node joined or left): replace ours
            old.destroy()
        group = create_group(
            master_address=master_address,
            master_port=master_port,
            rank=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=self.timeout_s,
        )
        with self._lock:
            self.groups[group_name] = group

    def destroy(self, group_name: str) -> None:
        with self._lock:
            group = self.groups.pop(group_name, None)
        if group is None:
            raise WeightUpdateError(
                f"no weight update group named {group_name!r} (have: {sorted(self.groups)})"
            )
        group.destroy()

    def _group(self, group_name: str) -> WeightGroup:
        group = self.groups.get(group_name)
        if group is None:
            raise WeightUpdateError(
                f"Group {group_name} not in {sorted(self.groups)}. Please call `init_weights_update_group` first."
            )
        return group

    def receive(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        load_format: str | None,
        checksum: int | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Receive the announced tensors from group rank 0 (blocking).

        ``checksum`` (tidal's extension, flattened buckets only): the CRC32 the sender announced.
        """
        group = self._group(group_name)
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise WeightUpdateError(
                f"names, dtypes and shapes must be non-empty lists of one length, got "
                f"{len(names)}, {len(dtypes)}, {len(shapes)}"
            )
        spec = bucket.BucketSpec(names=list(names), dtypes=list(dtypes), shapes=[list(s) for s in shapes])
        try:
            tensor_dtypes = [bucket._dtype(d) for d in dtypes]
            nbytes = spec.nbytes
        except ValueError as exc:
            raise WeightUpdateError(str(exc)) from exc
        if load_format == "flattened_bucket":
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            group.broadcast(buf, src=0)
            if checksum is not None and bucket.checksum(buf) != checksum:
                raise WeightUpdateError(
                    f"bucket of {len(names)} tensors ({names[0]} ...) in group {group_name}: checksum "
                    f"{bucket.checksum(buf)} != announced {checksum}"
                )
            return bucket.unpack(buf, spec)
        if load_format not in (None, "auto", "direct"):
            raise WeightUpdateError(
                f"load_format={load_format!r} is not supported; use null (one broadcast per tensor) or "
                "'flattened_bucket'"
            )
        received = []
        for name, dtype, shape in zip(names, tensor_dtypes, shapes, strict=True):
            t = torch.empty(list(shape), dtype=dtype, device=self.device)
            group.broadcast(t, src=0)
            received.append((name, t))
        return received

    def close(self) -> None:
        for name in list(self.groups):
            self.destroy(name)
