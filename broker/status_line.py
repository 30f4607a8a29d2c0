"""The broker's status line: what an operator watching its log (or ``tidal stats``) wants at a glance.

Built from two ``stats`` snapshots (this one and the one at the previous line), so rates are over the
interval between lines; from one snapshot alone, over the stats' own 10 s window."""

from __future__ import annotations

from typing import Any


def _rate(now: dict[str, Any], prev: dict[str, Any], key: str, elapsed_s: float) -> float:
    if elapsed_s <= 0:
        return 0.0
    return (now["counters"][key] - prev["counters"][key]) / elapsed_s


def status_line(now: dict[str, Any], prev: dict[str, Any] | None, elapsed_s: float = 0.0) -> str:
    """One line from the stats snapshot ``now`` and ``prev``, taken ``elapsed_s`` before it (the previous
    line's, or the broker's at its start); without ``prev``, the rates of the stats' own window."""
    if prev is None:
        window = now["throughput"]
        samples_s, bytes_s = window["samples_per_s"], window["bytes_per_s"]
        over = f"over the last {window['window_s']:.0f} s"
    else:
        samples_s = _rate(now, prev, "accepted_samples", elapsed_s)
        bytes_s = _rate(now, prev, "accepted_bytes", elapsed_s)
        over = "since the last line"
    roles: dict[str, int] = {}
    for node in now["nodes"].values():
        if node["alive"]:
            roles[node["role"]] = roles.get(node["role"], 0) + 1
    alive = ", ".join(f"{count} {role}" for role, count in sorted(roles.items())) or "none"
    c = now["counters"]
    batches = now["batches"]
    errors = sum(now.get("errors", {}).values())
    failing = f" ({now['failing_groups']} failing)" if now.get("failing_groups") else ""
    refused = f"refused nodes {c['refused_nodes']} (another model), " if c.get("refused_nodes") else ""
    if c.get("refused_trainers"):
        refused += f"refused trainers {c['refused_trainers']} (another alive), "
    if c.get("trainer_takeovers"):
        refused += f"trainer takeovers {c['trainer_takeovers']} (predecessor's process gone), "
    return (
        f"status: nodes alive {alive}; policy version {now['policy_version']}; "
        f"queue {now['queue_depth']} groups, in flight {now['in_flight_groups']}, "
        f"buffered {now['buffered_groups']}; "
        f"accepted {c['accepted_groups']} groups ({samples_s:.0f} samples/s, {bytes_s / 1e6:.1f} MB/s {over}); "
        f"batches cut {c['batches_cut']}, consumed through {batches['consumed']}; "
        f"dropped stale {c['dropped_stale_groups']}, filtered {c['filtered_groups']}, "
        f"failed {c.get('failed_groups', 0)}{failing}, "
        f"{refused}"
        f"expired leases {c['expired_leases']}, rejected submissions {c['rejected_submissions']}, "
        f"bad frames {c['bad_frames']}, error replies {errors}; "
        f"epoch {now['cursor']['epoch']} at row {now['cursor']['pos']} of {now['cursor']['rows']}"
    )
