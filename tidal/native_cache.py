"""Where tidal's compiled C code is cached, and which C compiler builds it (no torch needed here)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def cache_dir() -> Path:
    """``$TIDAL_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/tidal/kernels`` (``~/.cache/tidal/kernels``)."""
    root = os.environ.get("TIDAL_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tidal" / "kernels"


def compiler() -> str | None:
    """``$CC``, else the first of cc, gcc and clang on the path."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None
