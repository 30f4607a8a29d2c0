"""Compiling the engine's C kernels once with the system C compiler and loading them with ctypes.

The CPU decode kernels (``native_attention.py``, ``native_step.py``) are C source held in Python strings.
On first use they are compiled together into one shared object per instruction set: ``avx512`` (AVX-512
F/VL/BW/DQ, where torch reports an AVX-512 CPU) or ``avx2`` (AVX2 + FMA). The object is cached in
``$TIDAL_KERNEL_CACHE`` (default ``~/.cache/tidal/kernels``) under a hash of source and flags, written to a
temporary name and renamed (engines may build at the same time), and loaded with ctypes, which releases the
GIL for each call. ``TIDAL_NATIVE_ISA=avx2`` picks the AVX2 build on an AVX-512 machine (how its tests and
benchmarks reach the fallback build there). Where nothing can be built (not x86-64, no AVX2, no compiler, a
failed build) :func:`load` says why and the engine runs PyTorch's ops.

``-ffast-math`` is a compile flag only: a shared object LINKED with it gets crtfastmath's constructor, which
at load sets flush-to-zero and denormals-are-zero for the whole process (every float op of the engine, and
of a test process: hypothesis then refuses its float strategies).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from tidal.native_cache import cache_dir, compiler

ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mavx2", "-mfma"],
    "avx2": ["-mavx2", "-mfma"],
}
_COMPILE_FLAGS = ["-O3", "-ffast-math", "-fPIC", "-c"]
_LINK_FLAGS = ["-shared"]
ISA_ENV = "TIDAL_NATIVE_ISA"


def host_isa() -> tuple[str | None, str]:
    """The instruction set to build for on this machine (None and why where there is none)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the native kernels are x86-64 (AVX2 / AVX-512) code; this is {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return None, f"this CPU has no AVX2 (torch reports {capability})"
    best = "avx512" if capability == "AVX512" else "avx2"
    asked = os.environ.get(ISA_ENV)
    if asked:
        if asked not in ISA_FLAGS:
            return None, f"{ISA_ENV}={asked!r}: choose one of {list(ISA_FLAGS)}"
        if asked == "avx512" and best != "avx512":
            return None, f"{ISA_ENV}=avx512 on a CPU without AVX-512 (torch reports {capability})"
        return asked, f"{asked} (from {ISA_ENV})"
    return best, best


def _build(cc: str, source: str, isa: str, target: Path) -> None:
    """Compile into a temporary directory beside ``target`` and rename the result there."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "kernels.c"
        src.write_text(source)
        obj = Path(tmp) / "kernels.o"
        out = Path(tmp) / target.name
        for cmd in (
            [cc, *_COMPILE_FLAGS, *ISA_FLAGS[isa], str(src), "-o", str(obj)],
            [cc, *_LINK_FLAGS, str(obj), "-o", str(out), "-lm"],
        ):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-600:]}")
        os.replace(out, target)


@cache
def _load(source: str, isa: str, cc: str) -> tuple[ctypes.CDLL | None, str]:
    flags = " ".join([*_COMPILE_FLAGS, *ISA_FLAGS[isa], "|", *_LINK_FLAGS])
    digest = hashlib.sha256((source + flags).encode()).hexdigest()[:16]
    target = cache_dir() / f"tidal_kernels-{isa}-{digest}.so"
    try:
        if not target.exists():
            _build(cc, source, isa, target)
        return ctypes.CDLL(str(target)), f"{isa} build at {target}"
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"building or loading the native kernels failed: {exc}"


def load(source: str, isa: str | None = None) -> tuple[ctypes.CDLL | None, str]:
    """The compiled library of ``source`` for ``isa`` (None: this machine's best, falling back to the AVX2
    build if the AVX-512 one fails), or None and why not."""
    best, how = host_isa()
    if best is None:
        return None, how
    if isa is not None and (
        isa not in ISA_FLAGS or (isa == "avx512" and torch.backends.cpu.get_cpu_capability() != "AVX512")
    ):
        return None, f"no {isa} build on this CPU (torch reports {torch.backends.cpu.get_cpu_capability()})"
    cc = compiler()
    if cc is None:
        return None, "no C compiler (cc, gcc or clang, or $CC) to build the native kernels"
    if isa is not None:
        return _load(source, isa, cc)
    lib, how = _load(source, best, cc)
    if lib is None and best == "avx512":
        fallback, fallback_how = _load(source, "avx2", cc)
        if fallback is not None:
            return fallback, f"{fallback_how} (the avx512 build failed: {how})"
    return lib, how
