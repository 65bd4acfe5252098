"""Typed configuration: TOML or `key=value` overrides, decoded into msgspec Structs.

Every component owns a small keyword-only Struct config; this module only turns
user input into those Structs, with errors that name the key (`at $.sampler.n`).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")


class ConfigError(ValueError):
    """A user mistake in a config file or override; the text says where."""


def parse_overrides(pairs: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """`["a.b=1", "c=x"]` -> `{"a": {"b": "1"}, "c": "x"}` (values stay strings; the
    typed decode converts them)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {pair!r} is not key=value")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {pair!r} conflicts with an earlier one")
        node[parts[-1]] = _parse_scalar(value)
    return out


def _parse_scalar(value: str) -> Any:
    """Read a TOML scalar or array if it is one (`3`, `true`, `[1, 2]`), else the string."""
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def convert(data: dict[str, Any], cls: type[T], *, where: str = "") -> T:
    """Decode a dict into `cls`, converting strings to the declared types."""
    try:
        return msgspec.convert(data, cls, strict=False)
    except msgspec.ValidationError as exc:
        prefix = f"{where}: " if where else ""
        raise ConfigError(f"{prefix}{exc}") from None


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
