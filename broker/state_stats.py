"""What the broker reports about its state (the ``stats`` request's body, which the Prometheus endpoint
also serves), and the window of recently accepted groups its throughput figures come from."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from tidal.broker import staleness as st

if TYPE_CHECKING:
    from tidal.broker.state import BrokerState

THROUGHPUT_WINDOW_S = 10.0


class ThroughputWindow:
    """Groups, samples and bytes accepted over the last ``span`` seconds; the sums are kept as groups come
    and go (stats are taken every tick)."""

    def __init__(self, span: float = THROUGHPUT_WINDOW_S):
        self.span = span
        self._recent: deque[tuple[float, int, int]] = deque()  # (time, samples, bytes) of accepted groups
        self._samples = 0
        self._bytes = 0

    def add(self, now: float, samples: int, nbytes: int) -> None:
        self._recent.append((now, samples, nbytes))
        self._samples += samples
        self._bytes += nbytes

    def rates(self, now: float) -> dict[str, float]:
        while self._recent and self._recent[0][0] < now - self.span:
            _, samples, nbytes = self._recent.popleft()
            self._samples -= samples
            self._bytes -= nbytes
        return {
            "window_s": self.span,
            "groups_per_s": len(self._recent) / self.span,
            "samples_per_s": self._samples / self.span,
            "bytes_per_s": self._bytes / self.span,
        }


def state_stats(state: BrokerState, now: float) -> dict[str, Any]:
    cfg = state.cfg
    journal = state.journal
    return {
        "policy_version": state.version,
        "queue_depth": len(state.requeue) + state.source.remaining_in_epoch(),
        "requeued": len(state.requeue),
        "in_flight_groups": state.leased,
        "leases": len(state.leases),
        "buffered_groups": len(state.buffer),
        "failing_groups": len(state.failures),  # not yet resolved, with failed sampling attempts
        "admission": {
            "accepted": state.accepted_live,
            "leased": state.leased,
            "limit": st.admission_limit(state.version, cfg.max_staleness, cfg.batch_groups),
            "capacity": state.capacity(),
            "max_staleness": cfg.max_staleness,
            "policy": cfg.staleness_policy,
        },
        "batches": {
            "next": state.next_batch_id,
            "consumed": state.consumed,
            "held": len(state.batches),
        },
        "cursor": {"epoch": state.source.epoch, "pos": state.source.pos, "rows": len(state.source.rows)},
        "exhausted": state.source.exhausted,
        "finished": state.finished,
        "counters": dict(state.counters.__dict__),
        "staleness_histogram": {int(k): v for k, v in sorted(state.histogram.items())},
        "throughput": state.recent.rates(now),
        "nodes": {
            n.node_id: {
                "role": n.role,
                "name": n.name,
                "alive": n.alive,
                "seen_s_ago": round(now - n.last_seen, 3),
                "leases": len(n.leases),
                "groups_in_flight": n.in_flight,
                "meta": n.meta,
            }
            for n in state.nodes.values()
        },
        "nodes_alive": sum(n.alive for n in state.nodes.values()),
        # the model rollout nodes must serve (broker/membership.py); None: no trainer named one yet
        "trainer_model": state.run_model.model,
        "journal": {
            "path": str(journal.path) if journal else None,
            "bytes": journal.bytes_written if journal else 0,
            "packed_groups": state.packed_groups,
            "packed_bytes_saved": state.packed_bytes_saved,
            **(journal.disk() if journal else {}),
        },
    }
