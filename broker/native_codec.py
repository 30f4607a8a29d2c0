"""Building and loading the group codec's C hot paths (``native_codec.c``), a CPython extension.

The source is compiled on first use with the system C compiler against this interpreter's headers, cached
under :func:`tidal.native_cache.cache_dir` by a hash of source, flags, compiler and Python version (built
under a temporary name and renamed, as several processes may build at once), and imported from there.
Where it cannot be built (no compiler, no Python headers, a failed build) or ``TIDAL_NATIVE_CODEC=0``,
:func:`load` says why and the codec runs its Python code alone, which is also the reference: the C code
hands every case outside the common one back to it (docs/decisions.md, "A native group codec").
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from tidal.native_cache import cache_dir, compiler

ENV = "TIDAL_NATIVE_CODEC"
MODULE = "tidal_codec_native"
SOURCE = Path(__file__).with_name("native_codec.c")
FLAGS = ["-O3", "-fPIC", "-shared", "-fno-strict-aliasing"]


def _build(cc: str, include: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        cmd = [cc, *FLAGS, "-I", include, str(SOURCE), "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-600:]}")
        os.replace(out, target)


@functools.cache
def load() -> tuple[ModuleType | None, str]:
    """The compiled module, or None and why not (built once per machine and source, then cached)."""
    if os.environ.get(ENV, "1") == "0":
        return None, f"{ENV}=0"
    cc = compiler()
    if cc is None:
        return None, "no C compiler (cc, gcc or clang, or $CC) to build the native codec"
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        return None, f"no Python headers at {include} to build the native codec"
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    key = b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(), cc.encode(), sys.version.encode()])
    target = cache_dir() / f"{MODULE}-{hashlib.sha256(key).hexdigest()[:16]}{suffix}"
    try:
        if not target.exists():
            _build(cc, include, target)
        spec = importlib.util.spec_from_file_location(MODULE, target)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (OSError, ImportError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"building or loading the native codec failed: {exc}"
    return module, f"native codec at {target}"


@functools.cache
def function(name: str) -> Any:
    """The compiled module's function ``name``, or None where the module cannot be built (the caller then
    runs its Python code)."""
    module, _ = load()
    return None if module is None else getattr(module, name)
