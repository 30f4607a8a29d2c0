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

from tidal.broker.journal import Kind, record_crc
from tidal.broker.local_journal import ReadMemory

log = logging.getLogger(__name__)

_PR_SET_PTRACER = 0x59616D61  # prctl option (linux/prctl.h): Yama's exception for one tracer
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
IOV_MAX = 1024  # iovecs per process_vm_readv call (Linux's UIO_MAXIOV)


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
    buffer = frame.buffer if hasattr(frame, "buffer") else frame
    return np.frombuffer(buffer, np.uint8).ctypes.data


def group_crc(payload: Any) -> int:
    """The checksum a memory reader checks a group frame against: its journal GROUP record's CRC."""
    return record_crc(Kind.GROUP, payload)


class MemoryUnavailable(Exception):
    """The broker's memory could not be read as it described it; read the journal or the wire."""


class MemoryReader:
    def __init__(self) -> None:
        self._libc = _libc()
        self._readv = self._libc.process_vm_readv
        self._readv.restype = ctypes.c_ssize_t
        self._readv.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_IOVec),
            ctypes.c_ulong,
            ctypes.POINTER(_IOVec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        self._memory = ReadMemory()

    def read(self, pid: int, refs: list[list[int]]) -> list[memoryview]:
        """The frames at ``refs`` ([address, length, crc] each) of process ``pid``, copied into this
        process and checked, as read-only views (in the order of ``refs``)."""
        total = sum(length for _, length, _ in refs)
        memory = self._memory.take(total)
        out, at = [], 0
        for i in range(0, len(refs), IOV_MAX):
            chunk = refs[i : i + IOV_MAX]
            size = sum(length for _, length, _ in chunk)
            local = (_IOVec * 1)(_IOVec(np.frombuffer(memory, np.uint8).ctypes.data + at, size))
            remote = (_IOVec * len(chunk))(*(_IOVec(address, length) for address, length, _ in chunk))
            done = self._readv(pid, local, 1, remote, len(chunk), 0)
            if done != size:
                err = ctypes.get_errno()
                reason = os.strerror(err) if done < 0 else f"{done} of {size} bytes"
                raise MemoryUnavailable(f"reading the broker's memory (pid {pid}): {reason}")
            for _, length, crc in chunk:
                view = memory[at : at + length]
                if group_crc(view) != crc:
                    raise MemoryUnavailable(
                        f"the broker's memory (pid {pid}) no longer holds the frame it named (checksum differs)"
                    )
                out.append(view.toreadonly())
                at += length
        return out
