"""``tidal stats``: what a running broker reports, without writing a client.

    tidal stats --broker tcp://A:5555                  # the status line and one line per node
    tidal stats --broker tcp://A:5555 --format json    # the whole stats body (docs/protocol.md, Stats)
    tidal stats --broker tcp://A:5555 --watch 10       # a status line every 10 s until Ctrl-C

Without ``--broker`` it asks ``broker.bind`` of the config. A broker that asks for CURVE is asked with the
trainer's keys (``trainer.curve_secret_key_file``, ``trainer.curve_server_key_file``).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from tidal.errors import ConfigError


@dataclass
class StatsOptions:
    broker: str | None = None
    format: str = "text"
    watch: float = 0.0
    timeout: float = 5.0


def node_lines(stats: dict[str, Any]) -> list[str]:
    def model(n: dict[str, Any]) -> str:
        named = (n.get("meta") or {}).get("model")
        return f", {named['summary']}" if isinstance(named, dict) and "summary" in named else ""

    return [
        f"  {node_id}  {n['role']} {n['name']!r}  {'alive' if n['alive'] else 'gone'}, heard "
        f"{n['seen_s_ago']:.1f} s ago, {n['leases']} leases, {n['groups_in_flight']} groups in flight"
        f"{model(n)}"
        for node_id, n in sorted(stats["nodes"].items())
    ]


def main(config, args: list[str]) -> int:
    from tidal.broker.client import BrokerClient, BrokerTimeout
    from tidal.broker.curve import client_keys
    from tidal.broker.status_line import status_line
    from tidal.trainer.flags import parse_flags

    opts = parse_flags(
        args,
        StatsOptions(),
        "tidal stats",
        "--broker ADDR, --format text|json, --watch SECONDS, --timeout SECONDS",
        {"watch": float, "timeout": float},
    )
    if opts.format not in ("text", "json"):
        raise ConfigError(f"tidal stats: --format={opts.format!r}; use text or json")
    if opts.watch < 0 or opts.timeout <= 0:
        raise ConfigError("tidal stats: --watch must be >= 0 and --timeout > 0")
    tc = config.trainer
    curve = client_keys(tc.curve_secret_key_file, tc.curve_server_key_file, "trainer")
    address = opts.broker or config.broker.bind
    with BrokerClient(address, curve=curve, timeout_s=opts.timeout) as client:
        try:
            stats = client.stats()
            if opts.format == "json":
                print(json.dumps(stats, indent=2, sort_keys=True))
                return 0
            print(status_line(stats, None))
            print("\n".join(node_lines(stats)), flush=True)
            last, at = stats, time.monotonic()
            while opts.watch:
                time.sleep(opts.watch)
                stats = client.stats()
                now = time.monotonic()
                print(status_line(stats, last, now - at), flush=True)
                last, at = stats, now
        except BrokerTimeout as exc:
            print(f"tidal stats: {exc}", file=sys.stderr)
            return 1
    return 0
