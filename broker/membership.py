"""Whether a rollout node may join: it must serve the model the trainer trains.

Members say which model they hold in their register ``meta`` as ``model: {fingerprint, summary}``
(``tidal/model_identity.py`` computes it from the architecture). The broker only compares fingerprints:
the trainer's registration sets the run's model; a rollout node whose fingerprint differs is refused
(``model_mismatch``), and nodes already registered with another one are let go when the trainer
registers (their leases return to the queue; their next call registers again and is refused). A member
that sends no ``model`` is not checked (older clients, benchmarks, engines a node does not know).

One trainer at a time: a second trainer would be dispensed the same batches and publish versions of its
own. A trainer registering while another is alive (seen within ``node_timeout_s``; the trainer's feed
heartbeats) is refused with ``another_trainer``; the client waits for the other to leave or to be
forgotten, which is what a trainer restarted after a crash needs (its dead predecessor never left). A
trainer on the predecessor's host and in its PID namespace need not wait: its client checks that the
predecessor's process (``meta.process``, broker/process_identity.py) is gone and registers again with
``replaces`` naming it; the broker lets it take the place.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tidal.broker.process_identity import same_place
from tidal.broker.protocol import BAD_REQUEST, ProtocolError
from tidal.broker.state_records import Node

log = logging.getLogger("tidal.broker")


def model_of(meta: dict[str, Any]) -> dict[str, str] | None:
    """The ``model`` a register's meta names, checked; None when it names none."""
    model = meta.get("model")
    if model is None:
        return None
    if not (
        isinstance(model, dict)
        and isinstance(model.get("fingerprint"), str)
        and isinstance(model.get("summary"), str)
    ):
        raise ProtocolError(
            BAD_REQUEST,
            f"register: meta.model must be a map of strings fingerprint and summary, got {model!r}",
        )
    return model


def mismatch(name: str, model: dict[str, str] | None, trainer_model: dict[str, str] | None) -> str | None:
    """Why rollout node ``name`` serving ``model`` may not feed the trainer's; None when it may."""
    if model is None or trainer_model is None or model["fingerprint"] == trainer_model["fingerprint"]:
        return None
    return (
        f"rollout node {name!r} serves {model['summary']} (fingerprint {model['fingerprint']}), but the trainer "
        f"trains {trainer_model['summary']} (fingerprint {trainer_model['fingerprint']}); start the node with "
        "the trainer's model (model.path, or the same model.* settings)"
    )


def live_trainer(trainers: list[Node], now: float, node_timeout_s: float) -> Node | None:
    """One of ``trainers`` that is alive: seen within ``node_timeout_s``."""
    return next((t for t in trainers if now - t.last_seen <= node_timeout_s), None)


def second_trainer(name: str, other: Node, now: float, node_timeout_s: float) -> str:
    """Why trainer ``name`` may not register while ``other`` is alive."""
    return (
        f"trainer {name!r} cannot join: trainer {other.name!r} ({other.node_id}) is registered and was last "
        f"seen {now - other.last_seen:.1f}s ago; two trainers would be dispensed the same batches. Stop it "
        f"first; one that died without leaving is forgotten {node_timeout_s:g}s after it was last seen "
        "(broker.node_timeout_s)"
    )


def takes_over(name: str, meta: dict[str, Any], other: Node, replaces: Any) -> bool:
    """Whether trainer ``name`` may take live-seeming ``other``'s place: it says it ``replaces`` it, having
    found its process gone, and it runs where it could check that (the same host and PID namespace)."""
    if replaces is None:
        return False
    theirs = other.meta.get("process")
    if replaces != other.node_id or not same_place(theirs, meta.get("process")):
        why = (
            f"the live trainer is {other.node_id} ({other.name!r})"
            if replaces != other.node_id
            else f"it does not run where {other.name!r} ran (host and PID namespace), so it cannot know"
        )
        log.warning("trainer %r says it replaces %r, but %s: refused", name, replaces, why)
        return False
    log.info(
        "trainer %r takes the place of %s (%r): its process %s on this host is gone",
        name,
        other.node_id,
        other.name,
        theirs.get("pid"),
    )
    return True


@dataclass
class RunModel:
    """The model the trainer registered with, and whether any trainer registered since the journal began
    (until then nodes that name their model lease nothing). Both are journaled by the broker's state: a
    VERSION record with ``trainer_model`` when a trainer changes them, and the snapshot."""

    model: dict[str, str] | None = None
    known: bool = False

    def trainer_registers(self, model: dict[str, str] | None) -> bool:
        """A trainer's model becomes the run's; one registering without a model changes none (test
        consumers, benchmarks), but it too lets nodes lease. Returns whether anything changed (to journal)."""
        if self.known and (model is None or model == self.model):
            return False
        self.known = True
        if model is not None:
            self.model = model
        return True

    def load(self, d: dict[str, Any]) -> None:
        """From a VERSION record or a snapshot; one written before the check existed leaves it unknown."""
        if "trainer_model" in d:
            self.known, self.model = d.get("trainer_known", True), d["trainer_model"]
