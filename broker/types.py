"""The data that crosses the broker: prompt groups out to rollout nodes, scored groups in, batches out.

Arrays are numpy so that they travel as raw little-endian bytes and decode without copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class PromptRow:
    """One row of a verl-format data set."""

    index: int
    data_source: str
    prompt: Any  # list of chat messages [{"role", "content"}] or a plain string
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class PromptGroup:
    """A prompt to be sampled ``n`` times; GRPO needs the whole group back."""

    group_id: str  # "<epoch>:<row index>", unique within a run
    row: PromptRow
    n: int


@dataclass
class Lease:
    lease_id: str
    deadline: float  # unix time; heartbeats extend it
    groups: list[PromptGroup]


@dataclass
class Sample:
    prompt_ids: np.ndarray  # int32 [P]
    response_ids: np.ndarray  # int32 [R]
    logprobs: np.ndarray  # float32 [R], behaviour policy logprob of each response token
    versions: np.ndarray  # int32 [R], policy version that produced each response token
    reward: float
    finish_reason: str  # "stop" | "length" | "abort"
    loss_mask: np.ndarray | None = None  # uint8 [R]; None means all ones
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def min_version(self) -> int:
        return int(self.versions.min()) if self.versions.size else 0


@dataclass
class Group:
    group_id: str
    samples: list[Sample]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def min_version(self) -> int:
        return min(s.min_version for s in self.samples)

    @property
    def rewards(self) -> np.ndarray:
        return np.array([s.reward for s in self.samples], dtype=np.float32)


@dataclass
class Batch:
    batch_id: int  # consecutive from 0; the trainer reports the last one it consumed
    groups: list[Group]
    policy_version: int  # the broker's view of the trainer version when the batch was cut
