"""Start named processes, watch them, restart the ones that may be restarted, stop them all cleanly.

The local launcher uses this to run the broker, rollout nodes and trainer as separate processes, the same
entries a cluster would start by hand.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tidal.errors import CONFIG_ERROR_EXIT
from tidal.procs import spawn, stop, tail


@dataclass
class ProcessSpec:
    name: str
    cmd: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    restart: bool = False  # restart when it dies (rollout nodes); otherwise its death stops the job
    max_restarts: int = 3
    # a process that finishes on its own and whose exit 0 is success, not restarted: the trainer, and a rollout
    # node once the broker has no more prompts
    expect_exit: bool = False
    # exit codes after which a restart would fail the same way: the job stops with the process's log instead
    final_exit_codes: tuple[int, ...] = (CONFIG_ERROR_EXIT,)


@dataclass
class ProcessState:
    spec: ProcessSpec
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    exit_code: int | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class ProcessDied(RuntimeError):
    """A process that may not be restarted died; the message names it and shows its last log lines."""


class Supervisor:
    def __init__(self, on_event: Callable[[str], None] | None = None) -> None:
        self.states: dict[str, ProcessState] = {}
        self.on_event = on_event or (lambda msg: None)

    def start(self, spec: ProcessSpec) -> ProcessState:
        state = self.states.get(spec.name) or ProcessState(spec)
        # SIGTERM when the launcher dies (even by SIGKILL): each stops as when stopped (the trainer saves a
        # checkpoint) instead of running on unwatched and holding the broker's port
        state.proc = spawn(spec.cmd, spec.log, spec.env, parent_death_signal=signal.SIGTERM)
        state.started_at = time.time()
        state.exit_code = None
        self.states[spec.name] = state
        self.on_event(f"started {spec.name} (pid {state.proc.pid}), log {spec.log}")
        return state

    def poll(self) -> list[str]:
        """Check every process; restart those allowed. Returns names of processes that finished with 0.

        Raises ProcessDied for a process that died and may not be restarted (or ran out of restarts).
        """
        finished = []
        for name, state in list(self.states.items()):
            if state.proc is None or state.exit_code is not None:
                continue
            code = state.proc.poll()
            if code is None:
                continue
            state.exit_code = code
            if code == 0 and state.spec.expect_exit:
                self.on_event(f"{name} finished")
                finished.append(name)
                continue
            final = code in state.spec.final_exit_codes
            if state.spec.restart and not final and state.restarts < state.spec.max_restarts:
                state.restarts += 1
                self.on_event(
                    f"{name} died with exit code {code}; restarting ({state.restarts}/{state.spec.max_restarts})"
                )
                self.start(state.spec)
                continue
            raise self.died(name)
        return finished

    def died(self, name: str) -> ProcessDied:
        """The error for process ``name``, which exited: its exit code and the last lines of its log."""
        state = self.states[name]
        code, log = state.proc.poll(), state.spec.log
        return ProcessDied(f"{name} died with exit code {code}. Last lines of {log}:\n{tail(log, 15)}")

    def stop_all(
        self,
        timeout_s: float = 15.0,
        order: list[str] | None = None,
        timeouts: dict[str, float] | None = None,
    ) -> None:
        """SIGTERM each process in ``order``, waiting ``timeouts[name]`` (else ``timeout_s``) before SIGKILL.
        An interrupt (a second Ctrl-C) while waiting kills that process and every one after it at once."""
        names = order or list(reversed(self.states))
        hurry = False
        for name in names:
            state = self.states.get(name)
            if state and state.proc is not None and state.proc.poll() is None:
                wait_s = 0.0 if hurry else (timeouts or {}).get(name, timeout_s)
                self.on_event(f"stopping {name}" + ("" if hurry else f" (SIGKILL after {wait_s:g} s)"))
                try:
                    state.exit_code = stop(state.proc, wait_s)
                except KeyboardInterrupt:
                    hurry = True
                    state.exit_code = stop(state.proc, 0.0)

    def health(self) -> dict[str, str]:
        out = {}
        for name, state in self.states.items():
            if state.alive:
                up = time.time() - state.started_at
                out[name] = f"up {up:.0f}s" + (f", {state.restarts} restarts" if state.restarts else "")
            else:
                out[name] = f"exited {state.exit_code}"
        return out
