"""`tidal run` survives SIGKILL of a rollout node, of the broker and of the trainer, one after another: the
supervisor restarts each; the broker resumes its journal and the nodes and the trainer register with it
again; the trainer resumes from its last checkpoint. The broker's journal shows every prompt group
accounted for, none in two batches, and the trainer's final lineage trained each batch exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tidal.journal_audit import audit_journal
from tidal.procs import free_port

REPO = Path(__file__).parents[2]


def _steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _trainer_worker_pid(run_dir: Path) -> int | None:
    """The training process itself (torchrun's child), found by its command line."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        is_train = "tidal.cli" in args and "train" in args and any(str(run_dir) in a for a in args)
        if is_train and "tidal.torchrun" not in args:  # not the launcher (tidal/torchrun.py)
            return int(entry.name)
    return None


def _wait(predicate, timeout_s: float, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"tidal run exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _checkpointed_step(run_dir: Path) -> int:
    markers = list(run_dir.rglob("checkpoints/latest"))
    return json.loads(markers[0].read_text())["step"] if markers else 0


def _alive(proc: psutil.Process) -> list[str] | None:
    """The command line of ``proc`` if it still runs (not a zombie; not another process under its pid),
    else None."""
    try:
        if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.cmdline()[:4]
    except psutil.NoSuchProcess:
        return None


def _kill_between_checkpoints(pid: int, run_dir: Path, timeout_s: float = 120) -> None:
    """SIGKILL the trainer at a moment when it has recorded a step after its latest checkpoint (so that step
    must run again): stopped (SIGSTOP) to look, let run on (SIGCONT) while the two are level."""
    deadline = time.monotonic() + timeout_s
    while True:
        os.kill(pid, signal.SIGSTOP)
        recorded = max((m["step"] for m in _steps(run_dir)), default=0)
        if recorded > _checkpointed_step(run_dir) or time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.05)


def _kill_and_see_restarted(name: str, output: list[str], proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's process ``name`` (its pid from the launcher's output), then wait until the
    launcher has seen it die and started it again."""
    started = f"started {name} (pid "
    pid = next(int(line.split("(pid ")[1].split(")")[0]) for line in output if started in line)
    os.kill(pid, signal.SIGKILL)
    _wait(
        lambda: (
            any(f"{name} died" in line for line in output) and sum(started in line for line in output) >= 2
        ),
        60,
        proc,
        f"{name}'s restart",
    )


@pytest.mark.slow
def test_job_recovers_from_sigkill_of_a_rollout_node_the_broker_and_the_trainer(tmp_path: Path):
    run_dir = tmp_path / "run"
    steps = 10
    cmd = [
        sys.executable,
        "-m",
        "tidal.cli",
        "run",
        "configs/tiny.yaml",
        f"run_dir={run_dir}",
        f"broker.bind=tcp://127.0.0.1:{free_port()}",
        "warmup.steps=4",
        "warmup.batch_size=64",
        f"trainer.steps={steps}",
        "trainer.checkpoint_every=2",
        "broker.batch_groups=4",
        "task.num_train=2000",
        "task.num_eval=50",
        "--plain",
        "--no-control",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        _wait(lambda: len(_steps(run_dir)) >= 2, 400, proc, "two GRPO steps")
        _kill_and_see_restarted("rollout0", output, proc)
        # the broker: restarted on its journal, the nodes and the trainer register with it again
        at_kill = len(_steps(run_dir))
        _kill_and_see_restarted("broker", output, proc)
        _wait(lambda: len(_steps(run_dir)) > at_kill, 300, proc, "a GRPO step after the broker's restart")
        _wait(lambda: len(_steps(run_dir)) >= 5, 300, proc, "five GRPO steps (a checkpoint at step 4)")
        trainer_pid = _trainer_worker_pid(run_dir)
        assert trainer_pid is not None, "no trainer process found"
        # its checkpoints were written by then: a child of the trainer that outlives it is an orphan
        trainer_children = psutil.Process(trainer_pid).children(recursive=True)
        _kill_between_checkpoints(trainer_pid, run_dir)
        proc.wait(timeout=500)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        reader.join(timeout=10)
    text = "".join(output)
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted((run_dir / "logs").glob("*.log"))
    )
    assert proc.returncode == 0, text[-4000:] + logs
    orphans = [_alive(p) for p in trainer_children]
    assert not any(orphans), f"the killed trainer left processes behind: {[o for o in orphans if o]}"
    assert "trainer died" in text, text[-3000:]

    # the trainer's final lineage: the last record of each step, batch ids 0..steps-1 each once
    lineage = {m["step"]: m for m in _steps(run_dir)}
    assert sorted(lineage) == list(range(1, steps + 1))
    assert [lineage[s]["batch_id"] for s in range(1, steps + 1)] == list(range(steps))
    redone = len(_steps(run_dir)) - steps
    assert redone >= 1, "the trainer was killed after a checkpoint, so some steps ran again"

    audit = audit_journal(run_dir / "journal")
    assert audit.problems == [], audit.as_dict()
    assert audit.batches[:steps] == list(range(steps))
    # every group taken from the prompt source is accepted, filtered or still in flight, and every
    # accepted one is in a batch, waiting in the buffer or dropped as too stale: none lost
    assert audit.taken == audit.accepted + audit.filtered + audit.outstanding
    assert audit.accepted == audit.batched + audit.buffered + audit.dropped_stale
    report = json.loads((run_dir / "report.json").read_text())
    assert report["journal"]["problems"] == []
