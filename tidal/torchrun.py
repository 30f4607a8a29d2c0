"""torchrun as ``tidal run`` launches it: the workers' own exit code, and one line instead of a traceback.

    python -m tidal.torchrun [torchrun's arguments] -m tidal.cli train ...

Plain torchrun exits 1 whatever its workers exited with, so ``tidal run`` could not tell a trainer that
crashed (worth a restart) from one that waited ``trainer.batch_timeout_s`` for a batch or was refused its
configuration (a restart waits or fails the same way again). Its stop by SIGTERM, the normal end of a
stopped job, also printed a traceback of torchrun's own internals into ``trainer.log`` after the worker's
message saying where its checkpoint is. This runs the same launcher (``torch.distributed.run``'s argument
parser and ``run``) and exits with:

- the exit code of the first worker that failed (128 + the signal for one killed by a signal);
- 128 + the signal when torchrun itself was signalled (143 for SIGTERM, as the workers' own stop);
- 0 when every worker succeeded.
"""

from __future__ import annotations

import sys


def exit_code_of_failure(exitcode: int) -> int:
    """A worker's exit code as a shell reports it: a negative one is a signal's."""
    return 128 - exitcode if exitcode < 0 else exitcode


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = exit_code_of_failure(failure.exitcode)
        print(
            f"tidal.torchrun: rank {rank} (pid {failure.pid}) exited with code {code}; "
            f"{len(exc.failures)} rank(s) failed; the lines above are its output",
            file=sys.stderr,
            flush=True,
        )
        return code or 1
    except SignalException as exc:
        print(f"tidal.torchrun: stopped by {exc.sigval.name}", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
