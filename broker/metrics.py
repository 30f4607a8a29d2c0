"""Prometheus endpoint: exposes the broker's stats snapshot (refreshed by the event loop every tick).

The collector only reads the latest snapshot dict, which the loop replaces as a whole, so the HTTP thread
never sees state being mutated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from tidal.errors import ConfigError

PREFIX = "tidal_broker"


class BrokerCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        s = self._snapshot()
        if not s:
            return
        gauges = {
            "policy_version": ("trainer policy version", s["policy_version"]),
            "queue_depth": (
                "prompt groups waiting to be leased (requeued + rest of epoch)",
                s["queue_depth"],
            ),
            "in_flight_groups": ("prompt groups out on leases", s["in_flight_groups"]),
            "leases": ("open leases", s["leases"]),
            "buffered_groups": ("accepted groups waiting for a batch", s["buffered_groups"]),
            "failing_groups": (
                "prompt groups with failed sampling attempts, not yet dropped (broker.max_group_failures)",
                s.get("failing_groups", 0),
            ),
            "admission_capacity": (
                "groups that may be leased now under the staleness bound",
                s["admission"]["capacity"],
            ),
            "nodes_alive": ("registered nodes heard from recently", s["nodes_alive"]),
            "batches_consumed": ("last batch the trainer reported consumed", s["batches"]["consumed"]),
            "journal_bytes": ("journal size in bytes", s["journal"]["bytes"]),
            "journal_dir_bytes": (
                "bytes of every file in the journal's directory (earlier files kept, spares)",
                s["journal"].get("dir_bytes", 0),
            ),
            "samples_per_second": (
                "accepted samples per second (sliding window)",
                s["throughput"]["samples_per_s"],
            ),
            "bytes_per_second": (
                "accepted bytes per second (sliding window)",
                s["throughput"]["bytes_per_s"],
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        for name, value in s["counters"].items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", f"total {name.replace('_', ' ')}", value=value)
        yield CounterMetricFamily(
            f"{PREFIX}_auth_failures", "CURVE handshakes refused", value=s["auth_failures"]
        )
        yield CounterMetricFamily(
            f"{PREFIX}_journal_packed_groups",
            "groups journaled with their per-token versions as runs (since the broker started)",
            value=s["journal"]["packed_groups"],
        )
        yield CounterMetricFamily(
            f"{PREFIX}_journal_packed_bytes_saved",
            "journal bytes those groups did not take (since the broker started)",
            value=s["journal"]["packed_bytes_saved"],
        )
        yield CounterMetricFamily(
            f"{PREFIX}_submit_memory_wire_submits",
            "submits sent over the wire by nodes holding a shared ring (theirs was full)",
            value=s.get("submit_memory", {}).get("wire_submits", 0),
        )
        errors = CounterMetricFamily(f"{PREFIX}_errors", "error replies by code", labels=["code"])
        for code, n in s["errors"].items():
            errors.add_metric([code], n)
        yield errors
        hist = s["staleness_histogram"]
        buckets, running = [], 0
        for k in sorted(hist):
            running += hist[k]
            buckets.append((str(float(k)), running))
        buckets.append(("+Inf", running))
        yield HistogramMetricFamily(
            f"{PREFIX}_group_staleness",
            "trainer version minus the oldest token version of each group cut into a batch",
            buckets=buckets,
            sum_value=sum(k * v for k, v in hist.items()),
        )


def serve_metrics(port: int, host: str, snapshot: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BrokerCollector(snapshot))
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(
            f"broker.metrics_port={port} (broker.metrics_host={host!r}): cannot serve Prometheus there "
            f"({exc.strerror}); choose another port, or null to serve none"
        ) from None
    return registry
