"""The environment parsers and :class:`ConfigError`; the leaf of :mod:`llm_otel.config`.

Imports nothing of llm-otel. A setting is declared once, as a dataclass field made by
:func:`setting`: the field holds the default, its metadata the variable and the parser, and
:func:`read_fields` reads every such field of a settings class from an environment. Each parser
has the signature ``read(env, name, default, **bounds)`` and raises :class:`ConfigError` naming
the variable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "ConfigError",
    "setting",
    "read_fields",
    "read_field",
    "env_fields",
    "field_default",
    "read_bool",
    "read_int",
    "read_optional_int",
    "read_float",
    "read_optional_float",
    "read_choice",
    "read_str",
]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigError(ValueError):
    """A configuration variable holds a value llm-otel cannot use. The message names the variable."""


Reader = Callable[..., Any]


def setting(
    env: str | tuple[str, ...],
    default: Any = dataclasses.MISSING,
    read: Reader | None = None,
    *,
    default_factory: Callable[[], Any] | None = None,
    **bounds: Any,
) -> Any:
    """A settings dataclass field read from variable ``env`` (a tuple: the variables one parser reads
    together) by ``read(env_mapping, env, default, **bounds)``. The field's default is the one
    default of that setting: parsers receive it, documentation is checked against it."""
    if read is None:
        raise TypeError("setting() needs a parser")
    metadata = {"env": env, "read": read, "bounds": bounds}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_default(field: dataclasses.Field[Any]) -> Any:
    """The default of a dataclass field (a fresh value for a ``default_factory`` field)."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def env_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of settings class ``cls`` that are read from the environment, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "env" in f.metadata]


def read_fields(cls: type, env: Mapping[str, str]) -> dict[str, Any]:
    """``{field name: value}`` for every :func:`setting` field of ``cls``, read from ``env`` in
    declaration order. Raises ConfigError naming the first invalid variable."""
    return {f.name: _read(f, env) for f in env_fields(cls)}


def read_field(cls: type, name: str, env: Mapping[str, str]) -> Any:
    """One :func:`setting` field of ``cls`` read from ``env``. Raises ConfigError."""
    return _read(next(f for f in env_fields(cls) if f.name == name), env)


def _read(field: dataclasses.Field[Any], env: Mapping[str, str]) -> Any:
    meta = field.metadata
    return meta["read"](env, meta["env"], field_default(field), **meta["bounds"])


def read_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off/(empty)``, any case; unset -> ``default``."""
    raw = env.get(name)
    if raw is None:
        return default
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r}: expected true or false")


def read_int(env: Mapping[str, str], name: str, default: int, lo: int, hi: int | None = None) -> int:
    """An integer in ``[lo, hi]``; unset or empty -> ``default``."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected an integer") from None
    if value < lo or (hi is not None and value > hi):
        raise ConfigError(f"{name}={raw!r}: expected an integer in [{lo}, {hi if hi is not None else 'inf'}]")
    return value


def read_optional_int(
    env: Mapping[str, str], name: str, default: int | None, lo: int, hi: int | None = None
) -> int | None:
    """:func:`read_int` for a setting that is off (``default``, None) when unset or blank."""
    if not (env.get(name) or "").strip():
        return default
    return read_int(env, name, lo, lo=lo, hi=hi)


def read_float(env: Mapping[str, str], name: str, default: float, lo: float, hi: float | None = None) -> float:
    """A number in ``[lo, hi]`` (NaN refused); unset or empty -> ``default``."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r}: expected a number") from None
    if not value >= lo or (hi is not None and not value <= hi):
        raise ConfigError(f"{name}={raw!r}: expected a number in [{lo}, {hi if hi is not None else 'inf'}]")
    return value


def read_optional_float(
    env: Mapping[str, str], name: str, default: float | None = None, lo: float = 0.0
) -> float | None:
    """A number >= ``lo``, or ``default`` (None: off) when unset or empty."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    return read_float(env, name, lo, lo=lo)


def read_choice(
    env: Mapping[str, str], name: str, default: str | None, choices: frozenset[str] | set[str]
) -> str | None:
    """One of ``choices`` (lower-cased); unset or empty -> ``default``."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ConfigError(f"{name}={raw!r}: expected one of {sorted(choices)}")
    return value


def read_str(env: Mapping[str, str], name: str, default: str) -> str:
    """The stripped value; unset or empty -> ``default``."""
    return (env.get(name) or default).strip()
