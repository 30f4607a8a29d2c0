"""The default job's live view: progress with ETA, reward, solved, staleness, throughput, sync time, the broker's
queue and drops, health."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Group as RichGroup
from rich.live import Live
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


def read_metrics(path: Path, last_pos: int = 0) -> tuple[list[dict[str, Any]], int]:
    """New complete JSON lines of ``path`` after byte ``last_pos``; returns (records, new position)."""
    if not path.exists():
        return [], last_pos
    with path.open("rb") as f:
        f.seek(last_pos)
        data = f.read()
    end = data.rfind(b"\n") + 1
    records = []
    for line in data[:end].splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records, last_pos + end


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "-"
    try:
        return format(float(value), spec)
    except (TypeError, ValueError):
        return str(value)


class LiveView:
    """Renders with rich when attached to a terminal; otherwise prints one line per step."""

    def __init__(self, total_steps: int, title: str, interactive: bool) -> None:
        self.total_steps = total_steps
        self.title = title
        self.interactive = interactive
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} steps"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
        )
        self.task_id = self.progress.add_task(title, total=total_steps)
        self.last: dict[str, Any] = {}
        self.broker: dict[str, Any] = {}
        self.health: dict[str, str] = {}
        self.events: list[str] = []
        self.live: Live | None = None
        self._printed_step = -1

    def __enter__(self) -> LiveView:
        if self.interactive:
            self.live = Live(self.render(), refresh_per_second=2, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.update(self.render())
            self.live.__exit__(*exc)

    def event(self, msg: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        self.events = [*self.events[-5:], f"{stamp} {msg}"]
        if not self.interactive:
            print(f"[{stamp}] {msg}", flush=True)

    def update(
        self, metrics: list[dict[str, Any]], broker: dict[str, Any] | None, health: dict[str, str]
    ) -> None:
        for m in metrics:
            self.last.update(m)
        if broker:
            self.broker = broker
        self.health = health
        step = int(self.last.get("step", 0))
        self.progress.update(self.task_id, completed=min(step, self.total_steps))
        if self.live is not None:
            self.live.update(self.render())
        elif step != self._printed_step and metrics:
            self._printed_step = step
            print(self.line(), flush=True)

    def line(self) -> str:
        m = self.last
        return (
            f"step {m.get('step', 0)}/{self.total_steps} reward {_fmt(m.get('reward/mean'))} "
            f"solved {_fmt(m.get('reward/solved', m.get('reward/mean')))} "
            f"staleness {_fmt(m.get('offpolicy/staleness_mean'), '.2f')} "
            f"samples/s {_fmt(m.get('throughput/wall_samples_per_s'), '.1f')} "
            f"sync {_fmt(m.get('time/weight_sync_s'), '.2f')}s"
        )

    def rows(self) -> list[tuple[str, str]]:
        """The view's figures: the trainer's latest metrics line, then the broker's latest stats."""
        m = self.last
        rows = [
            ("reward", _fmt(m.get("reward/mean"))),
            ("solved (train samples)", _fmt(m.get("reward/solved"))),
            (
                "staleness mean / max",
                f"{_fmt(m.get('offpolicy/staleness_mean'), '.2f')} / "
                f"{_fmt(m.get('offpolicy/staleness_max'), '.0f')}",
            ),
            ("samples/s (trained)", _fmt(m.get("throughput/samples_per_s"), ".1f")),
            ("tokens/s (trained)", _fmt(m.get("throughput/tokens_per_s"), ".0f")),
            ("weight sync", f"{_fmt(m.get('time/weight_sync_s'), '.3f')} s"),
            ("loss", _fmt(m.get("loss/total"), ".4f")),
        ]
        b = self.broker
        if b:
            c = b.get("counters", {})
            nodes = sum(n.get("role") == "rollout" and n.get("alive") for n in b.get("nodes", {}).values())
            rows.append(
                (
                    "broker",
                    f"{nodes} rollout node(s); queued {b.get('queue_depth', '-')}, in flight "
                    f"{b.get('in_flight_groups', '-')}, buffered {b.get('buffered_groups', '-')} groups; "
                    f"dropped stale {c.get('dropped_stale_groups', '-')}, filtered "
                    f"{c.get('filtered_groups', '-')}, failed {c.get('failed_groups', '-')}",
                )
            )
        return rows

    def render(self) -> RichGroup:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        rows = self.rows()
        for k, v in rows:
            table.add_row(k, v)
        health = Table("process", "state", box=None)
        for name, state in self.health.items():
            health.add_row(name, state)
        parts = [self.progress, Panel(table, title=self.title), health]
        if self.events:
            parts.append(Panel("\n".join(self.events), title="events"))
        return RichGroup(*parts)
