"""A stop asked for by signal, honoured at the trainer's next batch boundary with a checkpoint.

SIGTERM (what ``tidal run``'s stop, Slurm's preemption and torchrun's own shutdown send) or SIGINT used to
kill the trainer mid-step, losing every step since its last periodic checkpoint. With a ``StopRequest``
installed the signal only records itself. The training loop asks every rank at each batch boundary
(``agreed``), and when any rank was signalled they all finish the batch, save a checkpoint, report it to
the broker and exit. torchrun kills its workers 30 s after it forwards a signal, so a step and checkpoint
that take longer end as before: killed, and a restart resumes from the last checkpoint. A second SIGINT
raises KeyboardInterrupt at once (a user at a terminal who will not wait).
"""

from __future__ import annotations

import signal
from types import FrameType


class StopRequest:
    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signum: int | None = None
        self._previous = {s: signal.signal(s, self._record) for s in signals}

    def _record(self, signum: int, frame: FrameType | None) -> None:  # noqa: ARG002 - a signal handler
        if signum == signal.SIGINT and self.signum is not None:
            raise KeyboardInterrupt
        # a SIGTERM again is expected: `tidal run` signals the process group and torchrun forwards its own
        self.signum = self.signum or signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "no signal"

    def agreed(self) -> bool:
        """Whether any rank was asked to stop (a collective: every rank calls it at the same point)."""
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.requested
        flags: list[bool | None] = [None] * dist.get_world_size()
        dist.all_gather_object(flags, self.requested)
        return any(flags)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
