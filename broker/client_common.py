"""What both broker clients share (broker/client.py, broker/blocking_client.py): their exceptions, the
DEALER socket, and reading a reply into its result."""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq

from tidal.broker import protocol as proto
from tidal.broker.codec import decode_group, lease_from_wire
from tidal.broker.curve import CurveClientKeys
from tidal.broker.types import Batch, Lease


class LeaseRejected(Exception):
    """Submit on an expired or unknown lease: the prompts were re-leased; drop these groups."""


class BrokerError(Exception):
    """The broker answered with an error; the message says why."""

    def __init__(self, message: str, code: str = ""):
        super().__init__(message)
        self.code = code


class BrokerTimeout(BrokerError):
    """No reply in time."""


def raise_for_reply(type_: str, body: dict[str, Any], what: str) -> None:
    if type_ == "ok":
        return
    code, message = body.get("code", "?"), body.get("message", repr(body))
    if code == proto.LEASE_REJECTED:
        raise LeaseRejected(message)
    raise BrokerError(f"broker refused {what} ({code}): {message}", code)


def batch_from_reply(body: dict[str, Any], frames: list[Any]) -> Batch | None:
    b = body.get("batch")
    if b is None:
        return None
    return Batch(b["batch_id"], [decode_group(f) for f in frames], b["policy_version"])


def release_body(lease_id: str, group_ids: list[str] | None, error: str | None) -> dict[str, Any]:
    """A ``release`` request's body; ``error`` only when the node failed to sample the groups."""
    body: dict[str, Any] = {"lease_id": lease_id, "group_ids": group_ids}
    if error is not None:
        body["error"] = error
    return body


def lease_from_reply(body: dict[str, Any]) -> Lease | None:
    return lease_from_wire(body["lease"]) if body.get("lease") else None


# A long wait for a batch is asked for in slices, so that a request lost in a broker restart is asked again.
GET_BATCH_SLICE_S = 10.0


def log_broker_wait(address: str, wait_s: float, deadline: float) -> None:
    """One line per unanswered registration while a client waits for its broker to come up."""
    left = max(0.0, deadline - time.monotonic())
    logging.getLogger("tidal.broker.client").warning(
        "no reply from the broker at %s yet; asking again (giving up in %.0f s of %.0f)",
        address,
        left,
        wait_s,
    )


def poll_slice_s(deadline: float | None) -> float:
    if deadline is None:
        return GET_BATCH_SLICE_S
    return max(0.0, min(GET_BATCH_SLICE_S, deadline - time.monotonic()))


def dealer_socket(ctx: zmq.Context, address: str, curve: CurveClientKeys | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # Queue only to a completed connection: a request sent while the broker is down (not started yet,
    # restarting) then waits for the connection and times out, instead of reaching the broker later,
    # after its caller gave up and asked again (a waiting node would register many times over).
    sock.setsockopt(zmq.IMMEDIATE, 1)
    if curve is not None:
        curve.apply(sock)
    sock.connect(address)
    return sock


def timeout_message(what: str, address: str, timeout: float) -> str:
    return (
        f"no reply to {what} from the broker at {address} within {timeout:.1f}s: is it running and "
        "reachable, and (with CURVE) is this client's public key in its allowed keys?"
    )
