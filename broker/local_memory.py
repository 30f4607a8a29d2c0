"""A batch's group frames copied straight out of the broker's memory, by a client on the broker's host.

The broker holds every group frame it accepted, as it came, until the batch holding it is reported
consumed (``docs/protocol.md``, "Limits"). A client on the broker's host that asks for it (``get_batch``
with ``host`` and ``memory: true``) gets, besides the journal's offsets, where those frames lie in the
broker's address space: ``memory: {pid, refs: [[address, length, crc], ...]}``. It copies them with one
``process_vm_readv`` system call per batch into memory it reuses, and checks each against ``crc`` (the
CRC-32 the group's journal record carries): the frames then cross loopback once and the journal's device
only writes. Reading them back from the journal had the consumer re-read every byte the broker had just
written; with the device's bandwidth shared between both directions that bounded the broker at 8K and
32K-token samples (docs/BENCHMARKS.md).

Anything unexpected (no such process, no permission to read it, a short read, a checksum that does not
match: a batch someone else already reported consumed, whose memory the broker reused) raises
:class:`MemoryUnavailable`; the client then reads the journal or asks for the frames on the wire.

Reading another process's memory needs the same user and, under Yama's ``ptrace_scope = 1``, the
target's consent: the broker gives it (``allow_memory_reads``) to processes of its own user, which can
read its journal file anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Any

import numpy as np

from tidal.broker import native_codec
from tidal.broker.journal_records import Kind, record_crc
from tidal.broker.local_journal import ReadMemory
from tidal.broker.submit_memory import SubmitMemoryUnavailable, open_ring

log = logging.getLogger(__name__)

_PR_SET_PTRACER = 0x59616D61  # prctl option (linux/prctl.h): Yama's exception for one tracer
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
IOV_MAX = 1024  # iovecs per process_vm_readv call (Linux's UIO_MAXIOV)
RING_IDLE_READS = 64  # a ring mapping no batch read used this many reads in a row is unmapped


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def allow_memory_reads() -> bool:
    """Let processes of this user read this process's memory where Yama restricts it to ancestors (the
    trainer is the broker's sibling, not its parent). False where the kernel has no Yama or refuses."""
    try:
        return _libc().prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def frame_address(frame: Any) -> int:
    """Where a bytes-like frame's bytes start in this process (a ``zmq.Frame``, bytes or a memoryview)."""
    buffer = getattr(frame, "buffer", frame)
    native = native_codec.function("address")
    return native(buffer) if native is not None else np.frombuffer(buffer, np.uint8).ctypes.data


def group_crc(payload: Any) -> int:
    """The checksum a memory reader checks a group frame against: its journal GROUP record's CRC."""
    return record_crc(Kind.GROUP, payload)


class MemoryUnavailable(Exception):
    """The broker's memory could not be read as it described it; read the journal or the wire."""


class MemoryReader:
    def __init__(self) -> None:
        self._libc = _libc()
        self._readv_call = self._libc.process_vm_readv
        self._readv_call.restype = ctypes.c_ssize_t
        self._readv_call.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_IOVec),
            ctypes.c_ulong,
            ctypes.POINTER(_IOVec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        self._memory = ReadMemory()
        self._reads = 0
        self.ring_frames = 0  # frames copied from this reader's mapping of a node's ring
        self._rings: dict[tuple[Any, ...], list[Any]] = {}  # (pid, fd, nonce) -> [mapping or None, last read]

    def read(
        self, pid: int, refs: list[list[int]], rings: list[dict[str, Any]] | None = None
    ) -> list[memoryview]:
        """The frames at ``refs`` of process ``pid``, copied into this process and checked, as read-only
        views (in the order of ``refs``). A ref is [address, length, crc], and for a frame in a rollout
        node's shared ring also [..., ring, offset] (``rings[ring]``: {fd, bytes, nonce}): such frames are
        copied from this reader's own mapping of the ring, ~3x faster than ``process_vm_readv`` reads
        the ring's small shared pages; where the ring cannot be mapped, they are read as the others."""
        total = sum(ref[1] for ref in refs)
        memory = self._memory.take(total)
        base = np.frombuffer(memory, np.uint8)
        self._reads += 1
        out, at, run = [], 0, []  # run: consecutive refs read with one process_vm_readv
        for ref in refs:
            length = ref[1]
            ring = self._ring(pid, rings[ref[3]]) if len(ref) == 5 and rings else None
            if ring is None:
                run.append(ref)
            else:
                self._readv(pid, run, base, at - sum(r[1] for r in run))
                run = []
                np.copyto(base[at : at + length], ring[ref[4] : ref[4] + length])
                self.ring_frames += 1
            out.append(memory[at : at + length])
            at += length
        self._readv(pid, run, base, at - sum(r[1] for r in run))
        for view, ref in zip(out, refs, strict=True):
            if group_crc(view) != ref[2]:
                raise MemoryUnavailable(
                    f"the broker's memory (pid {pid}) no longer holds the frame it named (checksum differs)"
                )
        self._forget_idle_rings()
        return [view.toreadonly() for view in out]

    def _readv(self, pid: int, refs: list[list[int]], base: np.ndarray, at: int) -> None:
        """Copy ``refs`` (consecutive in the output) from process ``pid`` into ``base`` from ``at``."""
        for i in range(0, len(refs), IOV_MAX):
            chunk = refs[i : i + IOV_MAX]
            size = sum(ref[1] for ref in chunk)
            local = (_IOVec * 1)(_IOVec(base.ctypes.data + at, size))
            remote = (_IOVec * len(chunk))(*(_IOVec(ref[0], ref[1]) for ref in chunk))
            done = self._readv_call(pid, local, 1, remote, len(chunk), 0)
            if done != size:
                err = ctypes.get_errno()
                reason = os.strerror(err) if done < 0 else f"{done} of {size} bytes"
                raise MemoryUnavailable(f"reading the broker's memory (pid {pid}): {reason}")
            at += size

    def _ring(self, pid: int, ring: dict[str, Any]) -> np.ndarray | None:
        """This reader's mapping of a node's ring (made once, checked against its nonce), or None."""
        key = (pid, ring.get("fd"), bytes(ring.get("nonce") or b""))
        if key not in self._rings:
            try:
                self._rings[key] = [np.frombuffer(open_ring(pid, ring, writable=False), np.uint8), 0]
            except SubmitMemoryUnavailable as exc:
                log.info("copying ring frames through the broker's memory: %s", exc)
                self._rings[key] = [None, 0]
        entry = self._rings[key]
        entry[1] = self._reads
        return entry[0]

    def _forget_idle_rings(self) -> None:
        """Unmap rings no batch used lately (their node left: the mapping would keep its memory)."""
        for key in [k for k, (_, used) in self._rings.items() if self._reads - used > RING_IDLE_READS]:
            del self._rings[key]
