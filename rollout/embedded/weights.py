"""The engine side of weight-update groups: the shared ordered, double-buffered receiver
(``tidal.weights_sync.receiver``) with the engine's checks and its errors.

A flattened bucket is received into one of the group's two buffers and held there while the engine
loads it, so bucket k+1 (announced with ``bucket_seq``, tidal's extension) is received while bucket k is
loaded; without ``bucket_seq`` handlers are served one at a time in arrival order, as in SGLang.
Receiving runs in a worker thread while generation continues; loading into the model happens on the
scheduler thread. A bad announcement whose size is still known (unknown name, shape mismatch) is
received first and then rejected, so the sender's broadcast completes and both sides stay in step; one
whose size cannot be computed (unknown dtype, ragged lists) is rejected before any receive, and the
sender's broadcast times out.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tidal.weights_sync import receiver as shared
from tidal.weights_sync.transport import WeightGroup

# what ``/init_weights_update_group`` answers besides SGLang's fields: the sender may pipeline buckets
# (``bucket_seq``) and send large tensors as broadcasts of their own (``segments``)
ORDERED_BUCKETS = shared.DECLARED_EXTENSIONS


class WeightUpdateError(ValueError):
    pass


def load_all(loader, tensors: list[tuple[str, torch.Tensor]], known: bool = False) -> None:
    """Copy received ``tensors`` into the model through ``loader`` (a ``NamedTensorLoader``): every name and
    shape is checked before anything is written (unless ``known``: a replayed bucket, whose names and shapes
    loaded before), then one multi-tensor copy (on CUDA a few kernels instead of a launch per tensor; a
    bucket holds hundreds)."""
    if not known:
        loader.check(tensors)
    if not tensors:
        return
    pairs = [pair for name, t in tensors for pair in loader.copies(name, t)]
    # CUDA's multi-tensor kernels take a list only if every source has its destination's strides: one
    # strided pair (a fused QKV's q, k or v) would send the whole list to a copy per tensor
    alike, unlike = [], []
    for pair in pairs:
        (alike if pair[0].stride() == pair[1].stride() else unlike).append(pair)
    with torch.no_grad():
        for group in (alike, unlike):
            if group:
                torch._foreach_copy_([dst for dst, _ in group], [src for _, src in group])


class WeightReceiver:
    def __init__(self, device: torch.device | str, timeout_s: float):
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.shared = shared.WeightReceiver(str(self.device), timeout_s)

    @property
    def groups(self) -> dict[str, WeightGroup]:
        return {name: self.shared.group(name) for name in self.shared.group_names}

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
        self.shared.init_group(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )

    def destroy(self, group_name: str) -> None:
        if not self.shared.destroy_group(group_name):
            raise WeightUpdateError(
                f"no weight update group named {group_name!r} (have: {self.shared.group_names})"
            )

    def _check_group(self, group_name: str) -> None:
        if group_name not in self.shared.group_names:
            raise WeightUpdateError(
                f"Group {group_name} not in {self.shared.group_names}. Please call "
                "`init_weights_update_group` first."
            )

    @contextmanager
    def receive_bucket(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        load_format: str | None,
        checksum: int | None = None,
        seq: int | None = None,
        segments: list[int] | None = None,
        target: shared.Target | None = None,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Receive the announced tensors from group rank 0 (blocking); yields them until they are loaded.

        ``load_format='flattened_bucket'``: views into one of the group's two receive buffers (reused;
        the next bucket may be received into the other meanwhile). ``None``/``auto``/``direct``: one
        broadcast per tensor, into fresh tensors. ``checksum`` (flattened buckets only): the CRC32 the
        sender announced. ``seq``: tidal's ``bucket_seq``; waits for its turn. ``segments``: tidal's
        ``bucket_segments``; a one-tensor segment goes straight into ``target(name, shape, dtype)`` when
        that returns a tensor, and is not yielded.
        """
        self._check_group(group_name)
        if load_format not in (None, "auto", "direct", "flattened_bucket"):
            raise WeightUpdateError(
                f"load_format={load_format!r} is not supported; use null (one broadcast per tensor) or "
                "'flattened_bucket'"
            )
        announced = dict(names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, seq=seq)
        if load_format != "flattened_bucket":
            try:
                received = self.shared.receive_tensors(**announced)
            except _RECEIVE_ERRORS as exc:
                raise WeightUpdateError(_message(exc)) from exc
            yield received
            return
        entered = False
        try:
            with self.shared.receive(
                **announced, checksum=checksum, segments=segments, target=target
            ) as tensors:
                entered = True
                yield tensors
        except _RECEIVE_ERRORS as exc:
            if entered:  # the caller's own error (its load), not the receive's
                raise
            raise WeightUpdateError(_message(exc)) from exc

    def receive(self, **kwargs) -> list[tuple[str, torch.Tensor]]:
        """As ``receive_bucket``, but the tensors are the caller's to keep (a copy of a flattened bucket)."""
        with self.receive_bucket(**kwargs) as tensors:
            return [(name, t.clone()) for name, t in tensors]

    def close(self) -> None:
        for name in self.shared.group_names:
            self.shared.destroy_group(name)


# what the shared receiver raises for a bad announcement, a lost bucket or a missing group
_RECEIVE_ERRORS = (ValueError, RuntimeError, KeyError)


def _message(exc: BaseException) -> str:
    return exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
