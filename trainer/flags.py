"""``--name value`` / ``--name=value`` flags of the trainer's subcommands into a dataclass of options."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from tidal.errors import ConfigError


def parse_flags[T](
    args: list[str],
    options: T,
    command: str,
    usage: str,
    types: dict[str, Callable[[str], Any]] | None = None,
) -> T:
    """Set ``options``' fields from ``args``; ``types`` converts the named fields (others stay strings)."""
    types = types or {}
    known = {f.name for f in fields(options)}
    it = iter(args)
    for arg in it:
        key, eq, value = arg.partition("=")
        name = key.lstrip("-").replace("-", "_")
        if not key.startswith("--") or name not in known:
            raise ConfigError(f"{command}: unknown argument {arg!r} (flags: {usage})")
        if not eq:
            value = next(it, "")
        if not value:
            raise ConfigError(f"{command}: {key} needs a value")
        try:
            setattr(options, name, types.get(name, str)(value))
        except ValueError:
            raise ConfigError(f"{command}: {key}={value!r} is not a {types[name].__name__}") from None
    return options
