"""Load typed configs from YAML files and dotted ``key=value`` overrides.

A config that does not validate raises :class:`tidal.errors.ConfigError` whose message names each
offending key, the value given and the rule it breaks, before any process starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tidal.errors import ConfigError


def parse_override(text: str) -> tuple[list[str], Any]:
    """``trainer.mesh.tp=2`` -> (["trainer", "mesh", "tp"], 2). Values are parsed as YAML scalars."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value {raw!r} is not valid YAML ({exc})") from exc
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for p in parts[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {p!r} holds {child!r}, not a section")
            node = child
        node[parts[-1]] = value
    return data


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping at the top level, got {type(data).__name__}"
        )
    return data


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<config>"
        value = err.get("input")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            lines.append(
                f"{key}: unknown key (value {value!r}); check the spelling against the documented keys"
            )
        elif err["type"] == "missing":
            lines.append(f"{key}: required key is missing")
        elif key == "<config>" or isinstance(value, dict):
            lines.append(f"{key}: {msg}")
        else:
            lines.append(f"{key}={value!r}: {msg}")
    return "invalid config:\n  " + "\n  ".join(lines)


def build[T: BaseModel](cls: type[T], data: dict[str, Any]) -> T:
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def load_config[T: BaseModel](
    cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None
) -> T:
    data = load_yaml(path) if path else {}
    apply_overrides(data, overrides or [])
    return build(cls, data)


def dump_config(cfg: BaseModel, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
