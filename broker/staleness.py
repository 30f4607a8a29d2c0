"""The staleness rule (AReaL's), in one place.

Admission: a new lease of ``k`` groups is granted only while ``leased + accepted + k <= (eta + version + 1)
* batch_groups``, where ``leased`` counts groups out on leases now and ``accepted`` counts every group
accepted since the start of the run that was not dropped (buffered or already in a batch). Since batch
``b`` is trained at version ``b``, a group admitted at version ``v`` lands in a batch ``<= v + eta``:
nothing trained is older than eta, and eta = 0 is synchronous on-policy training.

A group's staleness is the trainer version when its batch is cut minus the oldest token version in it.
"""

from __future__ import annotations


def admission_limit(version: int, max_staleness: int, batch_groups: int) -> int:
    return (max_staleness + version + 1) * batch_groups


def admission_capacity(
    *, leased: int, accepted: int, version: int, max_staleness: int, batch_groups: int
) -> int:
    """How many more groups may be leased now (never negative)."""
    return max(0, admission_limit(version, max_staleness, batch_groups) - leased - accepted)


def staleness(trainer_version: int, min_token_version: int) -> int:
    return trainer_version - min_token_version


def too_stale(trainer_version: int, min_token_version: int, max_staleness: int) -> bool:
    return staleness(trainer_version, min_token_version) > max_staleness
