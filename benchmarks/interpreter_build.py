"""Which Python ran a benchmark, and how it was built: CPU figures of Python-bound paths depend on it.

An interpreter built with profile-guided optimization and link-time optimization (``--enable-optimizations
--with-lto``, as Debian and Ubuntu, the official Docker images and uv's standalone builds ship CPython) runs
pure-Python code faster than one built without (pyenv's default). Each CPU benchmark writes this record
into its JSON and prints :func:`describe` once, so a figure can be compared with one taken on the same kind
of interpreter (docs/BENCHMARKS.md, "Which interpreter").

The flags are those the build recorded (``sysconfig``). Debian and Ubuntu record the configure of their
shared-library build, not the profile-guided build of their ``/usr/bin/python3.X``, so theirs may read
"no PGO, no LTO" whatever their interpreter is; the record therefore also times a small pure-Python loop
(``loop_us``), the interpreter's own speed on this host, which is what to compare between two runs.
"""

from __future__ import annotations

import platform
import sys
import sysconfig
import timeit
from typing import Any

LOOP = "for i in range(1000): d[i] = i * 2"


def loop_us(repeats: int = 5, number: int = 200) -> float:
    """Microseconds of one pass of :data:`LOOP` (1,000 dict stores), the best of ``repeats`` timings."""
    return min(timeit.repeat(LOOP, setup="d = {}", repeat=repeats, number=number)) / number * 1e6


def interpreter_build() -> dict[str, Any]:
    """The running interpreter: implementation, version, executable, whether its recorded build flags
    include PGO and LTO and a shared libpython, and the time of one pass of :data:`LOOP`."""
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
        "loop_us": round(loop_us(), 1),
    }


def describe(build: dict[str, Any] | None = None) -> str:
    """One line, e.g. ``CPython 3.12.1 (no PGO, no LTO, shared libpython; the loop 57.7 us) at /usr/bin/python3``."""
    b = build or interpreter_build()
    traits = [
        "PGO" if b["pgo"] else "no PGO",
        "LTO" if b["lto"] else "no LTO",
        "shared libpython" if b["shared"] else "static libpython",
    ]
    return (
        f"{b['implementation']} {b['version']} ({', '.join(traits)}; the loop {b['loop_us']:.1f} us) "
        f"at {b['executable']}"
    )
