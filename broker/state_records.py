"""The records the broker's state keeps (broker/state.py): members, leases, buffered groups, cut batches,
and its counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tidal.broker.codec import GroupInfo
from tidal.broker.types import PromptGroup


@dataclass
class Node:
    node_id: str
    role: str
    name: str
    meta: dict[str, Any]
    peer: bytes
    joined: float
    last_seen: float
    alive: bool = True
    leases: set[str] = field(default_factory=set)
    in_flight: int = 0  # groups pending on its leases, counted as they come and go (BrokerState._unlease)
    # Standing lease request (``stream_leases``): groups the node wants in flight, at most
    # ``stream_max`` per pushed lease; 0 = not streaming. ``told_finished``: the end of the data was pushed.
    credit: int = 0
    stream_max: int = 0
    stream_id: int = 0
    told_finished: bool = False
    # The ring of memory shared with the broker for its submits (submit_memory.SubmitArena), if on its host.
    arena: Any = None
    model: dict[str, str] | None = None  # the model it said it holds (broker/membership.py), if it said


@dataclass
class LeaseState:
    lease_id: str
    node_id: str
    deadline: float
    pending: dict[str, PromptGroup]  # group id -> prompt group, not yet submitted


@dataclass
class StoredGroup:
    info: GroupInfo
    frame: Any  # bytes-like: the group frame exactly as it came (journaled and forwarded as is)
    # (journal file id, offset, length) of its journal record's payload (a PACKED one is not the frame's)
    loc: tuple[str, int, int] | None = None
    crc: int | None = None  # its GROUP record's CRC-32, once computed (local memory readers check it)


@dataclass
class CutBatch:
    batch_id: int
    group_ids: list[str]
    policy_version: int


@dataclass
class Counters:
    accepted_groups: int = 0
    accepted_samples: int = 0
    accepted_bytes: int = 0
    filtered_groups: int = 0
    dropped_stale_groups: int = 0
    failed_groups: int = 0  # dropped after broker.max_group_failures failed attempts
    expired_leases: int = 0
    released_groups: int = 0
    rejected_submissions: int = 0
    nodes_timed_out: int = 0
    refused_nodes: int = 0  # rollout nodes serving another model than the trainer's (refused or let go)
    refused_trainers: int = 0  # trainer registrations refused while another trainer was alive
    trainer_takeovers: int = 0  # trainers that took the place of one whose process was gone
    bad_frames: int = 0
    batches_cut: int = 0
