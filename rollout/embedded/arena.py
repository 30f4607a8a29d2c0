"""Re-lay the engine's weights once, so that given runs of checkpoint names lie back to back in one arena.

A weight sync receives a run of consecutive tensors straight into the engine with one broadcast only when
the run's targets lie back to back in one storage, in the run's order (``weights_sync.receiver.byte_span``).
After loading, every parameter has a storage of its own (only the fused Q/K/V and gate/up matrices hold
several targets), so most runs go through a receive buffer and a copy. :func:`relayout` copies the storages
("owners") that accepted runs cover into one new tensor per (device, dtype), owner after owner in run order,
and re-points every tensor that aliased an owner at its bytes' new place, in place: Python objects (the
parameters, ``qkv_weight``, the lean decoder's references) stay the same objects and views stay views
(``q_proj.weight`` still aliases ``qkv_weight``), so weight loads by name keep working unchanged.

Memory: the peak is the old storages plus the arenas, once; an old storage is freed when nothing refers to
it any more. Tensors the engine holds outside the model (scratch dicts, cached views) must be passed as
``extra`` or dropped before the call; the report says how many bytes of old storage were still referenced
when it returned. Run it where no forward pass or weight load runs (the scheduler thread, or while paused),
and afterwards call ``Scheduler.weights_moved()``: compiled steps and CUDA graphs read raw addresses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# start of each run in an arena (runs are not padded inside: their targets must stay back to back)
ALIGN_BYTES = 64

_Key = tuple[str, int]  # (device, storage address): identifies a storage while it lives


@dataclass
class RelayoutReport:
    """What :func:`relayout` did: the runs laid out, those skipped and why, and the bytes moved."""

    laid: list[list[str]] = field(default_factory=list)
    skipped: list[tuple[list[str], str]] = field(default_factory=list)
    bytes_relocated: int = 0
    arena_bytes: dict[str, int] = field(default_factory=dict)  # "device/dtype" -> arena size
    old_bytes_still_referenced: int = 0  # old storages something outside the candidates still holds

    def __str__(self) -> str:
        lines = [
            f"relayout: {len(self.laid)} run(s) laid out, {len(self.skipped)} skipped, "
            f"{self.bytes_relocated} bytes relocated into "
            + (", ".join(f"{k} ({n} bytes)" for k, n in self.arena_bytes.items()) or "no arena")
        ]
        if self.old_bytes_still_referenced:
            lines.append(f"  {self.old_bytes_still_referenced} bytes of old storage are still referenced")
        lines += [f"  skipped [{names[0] if names else ''} ...]: {why}" for names, why in self.skipped]
        return "\n".join(lines)


@dataclass
class _Owner:
    """A storage a run covers: its used byte extent and every known tensor that aliases it."""

    key: _Key
    start: int
    end: int
    aliases: list[torch.Tensor]
    arena_offset: int = 0  # in elements of the run's dtype, once placed


@dataclass
class _Run:
    names: list[str]
    owners: list[_Owner]
    device: torch.device
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(o.end - o.start for o in self.owners)


def relayout(
    lm: torch.nn.Module,
    runs: list[list[str]],
    resolve: Callable[[str], torch.Tensor],
    extra: Iterable[torch.Tensor] = (),
) -> RelayoutReport:
    """Move the storages each run of ``runs`` covers into one arena per (device, dtype), back to back in run
    order, so that the run's targets (``resolve(name)``) become one contiguous byte span.

    A run is laid out only if its targets, walked in order, are contiguous, share one device and dtype, and
    tile each storage they touch exactly (its whole used extent, in storage order, no gap), with no storage
    claimed by an earlier run; otherwise it is skipped with the reason (no exception). Values are bitwise
    unchanged. ``extra``: more tensors that may alias the weights; they are re-pointed too.
    """
    report = RelayoutReport()
    candidates = _candidates(lm, extra)
    by_storage = _by_storage(candidates)
    claimed: set[_Key] = set()
    accepted: list[_Run] = []
    for names in runs:
        planned = _plan_run(list(names), resolve, by_storage, claimed)
        if isinstance(planned, str):
            report.skipped.append((list(names), planned))
            continue
        claimed.update(o.key for o in planned.owners)
        accepted.append(planned)
        report.laid.append(planned.names)
    if not accepted:
        return report
    old = [StorageWeakRef(o.aliases[0].untyped_storage()) for r in accepted for o in r.owners]
    old_sizes = [o.aliases[0].untyped_storage().nbytes() for r in accepted for o in r.owners]
    with _mutation_mode(candidates):
        for (device, dtype), group in _by_arena(accepted).items():
            arena = _place(group, device, dtype)
            report.arena_bytes[f"{device}/{str(dtype).removeprefix('torch.')}"] = arena.nbytes
            for run in group:
                for owner in run.owners:
                    _move(owner, arena)
            report.bytes_relocated += sum(r.nbytes for r in group)
            del arena
    del accepted, by_storage, candidates
    report.old_bytes_still_referenced = sum(
        n for ref, n in zip(old, old_sizes, strict=True) if not ref.expired()
    )
    return report


def _candidates(lm: torch.nn.Module, extra: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor object that may alias a weight, once each: parameters, buffers, tensor attributes of
    modules (the fused ``qkv_weight``/``gate_up_weight``), and the caller's ``extra``."""
    seen: dict[int, torch.Tensor] = {}
    pools = [lm.parameters(), lm.buffers(), list(extra)]
    pools += [[v for v in vars(m).values() if isinstance(v, torch.Tensor)] for m in lm.modules()]
    for pool in pools:
        for t in pool:
            if t.untyped_storage().nbytes() > 0:
                seen.setdefault(id(t), t)
    return list(seen.values())


def _key(t: torch.Tensor) -> _Key:
    return (str(t.device), t.untyped_storage().data_ptr())


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a (possibly strided) tensor can reach: [start, end)."""
    start = t.storage_offset() * t.element_size()
    if t.numel() == 0:
        return start, start
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def _by_storage(tensors: list[torch.Tensor]) -> dict[_Key, list[torch.Tensor]]:
    groups: dict[_Key, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(_key(t), []).append(t)
    return groups


def _owner(key: _Key, aliases: list[torch.Tensor]) -> _Owner:
    ranges = [_byte_range(t) for t in aliases]
    return _Owner(key, min(s for s, _ in ranges), max(e for _, e in ranges), aliases)


def _plan_run(
    names: list[str],
    resolve: Callable[[str], torch.Tensor],
    by_storage: dict[_Key, list[torch.Tensor]],
    claimed: set[_Key],
) -> _Run | str:
    """The run's owners in order, or why it cannot be laid out. Keeps no target (a fresh view, e.g. an
    expert's slice, would keep its old storage alive)."""
    if not names:
        return "an empty run"
    owners: list[_Owner] = []
    device = dtype = None
    cursor = 0
    for name in names:
        try:
            t = resolve(name)
        except Exception as exc:  # noqa: BLE001 - an unknown name skips the run, with the reason
            return f"{name}: cannot resolve ({exc})"
        if device is None:
            device, dtype = t.device, t.dtype
        problem = _target_problem(name, t, device, dtype)
        if problem is not None:
            return problem
        key, (start, end) = _key(t), _byte_range(t)
        if owners and key == owners[-1].key:
            if start != cursor:
                return f"{name} does not follow the previous target in its storage (wrong order or a gap)"
        else:
            if owners and cursor != owners[-1].end:
                return f"the targets before {name} leave part of their storage uncovered (a partial fused matrix)"
            problem = _owner_problem(name, key, start, by_storage, claimed, owners, dtype)
            if problem is not None:
                return problem
            owners.append(_owner(key, by_storage[key]))
        cursor = end
    if cursor != owners[-1].end:
        return f"the run ends at byte {cursor} of its last storage, which is used up to {owners[-1].end}"
    return _Run(names, owners, device, dtype)


def _target_problem(name: str, t: torch.Tensor, device, dtype) -> str | None:
    if t.device != device:
        return f"{name} is on {t.device}, the run's first target on {device} (mixed devices)"
    if t.dtype != dtype:
        return f"{name} is {t.dtype}, the run's first target {dtype} (mixed dtypes cannot share an arena)"
    if not t.is_contiguous() or t.numel() == 0:
        return f"{name} is not contiguous" if t.numel() else f"{name} is empty"
    if t.untyped_storage().nbytes() == 0:
        return f"{name} has no memory (released: the engine is asleep)"
    return None


def _owner_problem(name, key, start, by_storage, claimed, owners, dtype) -> str | None:
    """Why the storage ``name`` enters cannot be taken as the run's next owner (None: it can)."""
    if key in claimed:
        return f"{name}'s storage is already laid out by an earlier run"
    if any(o.key == key for o in owners):
        return f"{name} returns to a storage the run already left (wrong order)"
    aliases = by_storage.get(key)
    if not aliases:
        return f"{name}'s storage is held by no parameter, buffer, module attribute or extra tensor"
    if any(a.dtype != dtype for a in aliases):
        return f"{name}'s storage is also viewed with another dtype"
    used = min(_byte_range(a)[0] for a in aliases)
    if start != used:
        return f"{name} starts at byte {start} of its storage, whose used part starts at {used} (partial coverage)"
    return None


def _by_arena(runs: list[_Run]) -> dict[tuple[torch.device, torch.dtype], list[_Run]]:
    groups: dict[tuple[torch.device, torch.dtype], list[_Run]] = {}
    for run in runs:
        groups.setdefault((run.device, run.dtype), []).append(run)
    return groups


def _place(runs: list[_Run], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Give each owner its offset (runs start at ALIGN_BYTES, owners follow each other) and allocate."""
    size = torch.empty((), dtype=dtype).element_size()
    align = max(1, ALIGN_BYTES // size)
    cursor = 0
    for run in runs:
        cursor = -(-cursor // align) * align
        for owner in run.owners:
            owner.arena_offset = cursor
            cursor += (owner.end - owner.start) // size
    return torch.empty(cursor, dtype=dtype, device=device)


def _move(owner: _Owner, arena: torch.Tensor) -> None:
    """Copy the owner's used bytes into the arena, then re-point each alias at the same bytes there."""
    size = arena.element_size()
    n = (owner.end - owner.start) // size
    source = torch.empty(0, dtype=arena.dtype, device=arena.device)
    source.set_(owner.aliases[0].untyped_storage(), owner.start // size, (n,))
    arena[owner.arena_offset : owner.arena_offset + n].copy_(source)
    del source
    storage = arena.untyped_storage()
    for t in owner.aliases:
        offset = owner.arena_offset + t.storage_offset() - owner.start // size
        t.set_(storage, offset, t.size(), t.stride())


def _mutation_mode(tensors: list[torch.Tensor]) -> contextlib.AbstractContextManager:
    """``set_`` on parameters needs no_grad; on inference tensors (a model built under inference_mode) it
    needs inference mode, where in-place changes of normal tensors are allowed too."""
    if any(t.is_inference() for t in tensors):
        return torch.inference_mode()
    return torch.no_grad()
