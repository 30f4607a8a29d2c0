"""The receive side of a weight sync: named groups, one flattened bucket per announcement.

Engines call this from their ``/init_weights_update_group`` and ``/update_weights_from_distributed``
handlers; the handler blocks in ``receive`` until the sender's broadcast of that bucket completes.
"""

from __future__ import annotations

import threading

import torch

from tidal.weights_sync import bucket, transport


class ChecksumMismatch(ValueError):
    pass


class WeightReceiver:
    def __init__(self, device: str = "cpu"):
        self.device = device
        self._groups: dict[str, transport.WeightGroup] = {}
        self._buffers: dict[str, torch.Tensor] = {}
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
        timeout_s: float = 60.0,
        local_rank: int = 0,
    ) -> None:
        """Join ``group_name`` as rank ``rank_offset + local_rank`` (blocks until all ranks joined)."""
        with self._lock:
            old = self._groups.pop(group_name, None)
        if old is not None:  # the sender rebuilt the group (a node joined or died): replace ours
            old.destroy()
        group = transport.create_group(
            master_address=master_address,
            master_port=master_port,
            rank=rank_offset + local_rank,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=timeout_s,
        )
        with self._lock:
            self._groups[group_name] = group

    def destroy_group(self, group_name: str) -> bool:
        with self._lock:
            group = self._groups.pop(group_name, None)
            self._buffers.pop(group_name, None)
        if group is None:
            return False
        group.destroy()
        return True

    def _buffer(self, group_name: str, nbytes: int) -> torch.Tensor:
        # reused across buckets: a fresh CPU allocation per bucket costs page faults on every byte
        buf = self._buffers.get(group_name)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._buffers[group_name] = buf
        return buf[:nbytes]

    @property
    def group_names(self) -> list[str]:
        with self._lock:
            return sorted(self._groups)

    def receive(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        checksum: int | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Receive one flattened bucket and return views of its tensors.

        The views share a buffer kept per group (a group's buckets arrive one after another): load them
        before the next receive on the same group.
        """
        with self._lock:
            group = self._groups.get(group_name)
        if group is None:
            raise KeyError(
                f"weight-update group {group_name!r} does not exist: call init_weights_update_group first"
            )
        spec = bucket.BucketSpec(names=list(names), dtypes=list(dtypes), shapes=[list(s) for s in shapes])
        buf = self._buffer(group_name, spec.nbytes)
        group.broadcast(buf, src=0)
        if checksum is not None and bucket.checksum(buf) != checksum:
            raise ChecksumMismatch(
                f"bucket of {len(names)} tensors ({names[0]} ...) in group {group_name}: checksum "
                f"{bucket.checksum(buf)} != announced {checksum}"
            )
        return bucket.unpack(buf, spec)

    def receive_raw(self, sizes: list[int], group_name: str) -> None:
        """Receive plain uint8 broadcasts of ``sizes`` bytes into one reused buffer (benchmark baseline)."""
        with self._lock:
            group = self._groups[group_name]
        buf = self._buffer(group_name, max(sizes))  # the same reused buffer as bucket receives
        for n in sizes:
            group.broadcast(buf[:n], src=0)
