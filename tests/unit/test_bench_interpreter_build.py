"""benchmarks/interpreter_build.py: PGO, LTO and a shared libpython are read from the build's recorded flags,
and the interpreter's speed is timed."""

import sys
import sysconfig
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import interpreter_build  # noqa: E402

# the compile flags of two builds of CPython 3.12: pyenv's default and `--enable-optimizations --with-lto`
PYENV = {
    "PY_CFLAGS_NODIST": "-std=c11 -Wextra -I./Include/internal",
    "PY_LDFLAGS_NODIST": "",
    "Py_ENABLE_SHARED": 1,
}
OPTIMIZED = {
    "PY_CFLAGS_NODIST": "-fno-semantic-interposition -flto -fuse-linker-plugin -ffat-lto-objects "
    "-flto-partition=none -g -std=c11 -fvisibility=hidden -fprofile-use -fprofile-correction",
    "PY_LDFLAGS_NODIST": "-fno-semantic-interposition -flto -fuse-linker-plugin -g",
    "Py_ENABLE_SHARED": 0,
}


@pytest.mark.parametrize(
    ("config", "pgo", "lto", "shared", "traits"),
    [
        (PYENV, False, False, True, "(no PGO, no LTO, shared libpython;"),
        (OPTIMIZED, True, True, False, "(PGO, LTO, static libpython;"),
    ],
)
def test_the_build_traits_come_from_its_flags(monkeypatch, config, pgo, lto, shared, traits):
    monkeypatch.setattr(sysconfig, "get_config_var", config.get)
    build = interpreter_build.interpreter_build()
    assert (build["pgo"], build["lto"], build["shared"]) == (pgo, lto, shared)
    assert build["executable"] == sys.executable
    assert build["loop_us"] > 0
    assert interpreter_build.describe(build).endswith(
        f"; the loop {build['loop_us']:.1f} us) at {sys.executable}"
    )
    assert traits in interpreter_build.describe(build)


def test_the_running_interpreter_is_described_by_its_version():
    line = interpreter_build.describe()
    assert line.startswith(f"CPython {sys.version.split()[0]} (")
