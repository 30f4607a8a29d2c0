"""Which Python ran a benchmark, and how it was built: CPU figures of Python-bound paths depend on it.

An interpreter built with profile-guided optimization and link-time optimization (``--enable-optimizations
--with-lto``, as Debian and Ubuntu, the official Docker images and uv's standalone builds ship CPython) runs
pure-Python code faster than one built without (pyenv's default). Each CPU benchmark writes this record
into its JSON and prints :func:`describe` once, so a figure can be compared with one taken on the same kind
of interpreter (docs/BENCHMARKS.md, "Which interpreter").
"""

from __future__ import annotations

import platform
import sys
import sysconfig
from typing import Any


def interpreter_build() -> dict[str, Any]:
    """The running interpreter: implementation, version, executable, and whether it was built with PGO,
    with LTO and as a shared libpython (read from the compile flags it was built with)."""
    flags = " ".join(
        str(sysconfig.get_config_var(name) or "") for name in ("PY_CFLAGS_NODIST", "PY_LDFLAGS_NODIST")
    )
    return {
        "implementation": platform.python_implementation(),
        "version": platform.python_version(),
        "executable": sys.executable,
        "pgo": "-fprofile-use" in flags or "-fprofile-instr-use" in flags,
        "lto": "-flto" in flags,
        "shared": bool(sysconfig.get_config_var("Py_ENABLE_SHARED")),
    }


def describe(build: dict[str, Any] | None = None) -> str:
    """One line, e.g. ``CPython 3.12.1 (no PGO, no LTO, shared libpython) at /usr/bin/python3``."""
    b = build or interpreter_build()
    traits = [
        "PGO" if b["pgo"] else "no PGO",
        "LTO" if b["lto"] else "no LTO",
        "shared libpython" if b["shared"] else "static libpython",
    ]
    return f"{b['implementation']} {b['version']} ({', '.join(traits)}) at {b['executable']}"
