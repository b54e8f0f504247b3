"""Tier table: maps request classes to SLO targets, read once at startup.

Format (``LLM_OTEL_TIERS_FILE`` = a file, or ``LLM_OTEL_TIERS`` = the same lines separated by
``;``), one rule per line, first matching rule wins, ``#`` starts a comment::

    # tier     match                      targets (seconds)
    premium    priority=high              ttft=0.3 tpot=0.05
    premium    tenant=acme                ttft=0.3 tpot=0.05
    free       tenant=free                ttft=1.2 e2e=30
    standard   *                          ttft=0.8

``match`` is ``*`` or ``dimension=value`` terms joined by ``&`` (all must hold); dimensions are
the request classes' (:data:`llm_otel.config.classes.CLASS_DIMENSIONS`: tenant, priority,
operation, revision). Targets:
``ttft``, ``tpot``, ``e2e`` (seconds, > 0); at least one per rule; a tier named on several lines
must give the same targets. A request no rule matches is tier ``default`` without targets.

Any mistake raises :class:`llm_otel.config.ConfigError` naming the source and the line. The table
is a setting (``SignalsConfig.tiers``); :class:`llm_otel.signals.Signals` looks requests up in it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

from llm_otel.config.classes import CLASS_DIMENSIONS
from llm_otel.config.parse import ConfigError

__all__ = ["Tier", "Rule", "TierTable", "DEFAULT_TIER", "TARGETS", "TIERS_VARIABLES", "tier_table"]

DEFAULT_TIER = "default"
TARGETS = ("ttft", "tpot", "e2e")
_NAME = re.compile(r"[A-Za-z0-9._\-]{1,64}")
_VALUE = re.compile(r"[A-Za-z0-9._:/@+\-]{1,64}")


@dataclasses.dataclass(frozen=True)
class Tier:
    """One SLO tier: ``targets`` maps ``ttft``/``tpot``/``e2e`` to a latency target in seconds."""

    name: str
    targets: Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class Rule:
    tier: Tier
    match: tuple[tuple[str, str], ...]  # () matches every request
    line: int


class TierTable:
    """Rules in order; :meth:`tier_for` returns the first tier whose match holds."""

    def __init__(self, rules: list[Rule]) -> None:
        self.rules = rules
        self.default = Tier(DEFAULT_TIER, {})

    @classmethod
    def parse(cls, text: str, source: str, separator: str = "\n") -> TierTable:
        """Parse rules; ``source`` names where they came from in error messages."""
        rules: list[Rule] = []
        tiers: dict[str, tuple[Tier, int]] = {}
        for number, raw in enumerate(text.split(separator), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            where = f"{source} line {number} ({raw.strip()!r})"
            parts = line.split()
            if len(parts) < 3:
                raise ConfigError(f"{where}: expected 'tier match target=seconds ...'")
            name, match_text, target_texts = parts[0], parts[1], parts[2:]
            if not _NAME.fullmatch(name):
                raise ConfigError(f"{where}: tier name {name!r} must be 1-64 of A-Z a-z 0-9 . _ -")
            match: list[tuple[str, str]] = []
            if match_text != "*":
                for term in match_text.split("&"):
                    dim, sep, value = term.partition("=")
                    if not sep or dim not in CLASS_DIMENSIONS:
                        raise ConfigError(
                            f"{where}: match term {term!r}: expected dimension=value with "
                            f"dimension one of {sorted(CLASS_DIMENSIONS)}, or '*'"
                        )
                    if not _VALUE.fullmatch(value):
                        raise ConfigError(
                            f"{where}: match value {value!r} can never occur (allowed: 1-64 "
                            "of A-Z a-z 0-9 . _ : / @ + -)"
                        )
                    match.append((dim, value))
            targets: dict[str, float] = {}
            for text_ in target_texts:
                key, sep, value = text_.partition("=")
                if not sep or key not in TARGETS:
                    raise ConfigError(f"{where}: target {text_!r}: expected one of {list(TARGETS)} = seconds")
                try:
                    seconds = float(value)
                except ValueError:
                    raise ConfigError(f"{where}: target {text_!r}: {value!r} is not a number") from None
                if not 0 < seconds < 86400:
                    raise ConfigError(f"{where}: target {text_!r}: seconds must be in (0, 86400)")
                if key in targets:
                    raise ConfigError(f"{where}: target {key!r} given twice")
                targets[key] = seconds
            tier = Tier(name, targets)
            if name in tiers and tiers[name][0].targets != targets:
                raise ConfigError(f"{where}: tier {name!r} has other targets on line {tiers[name][1]}")
            tiers.setdefault(name, (tier, number))
            rules.append(Rule(tiers[name][0], tuple(match), number))
        return cls(rules)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TierTable | None:
        """The table ``LLM_OTEL_TIERS_FILE`` or ``LLM_OTEL_TIERS`` defines, None when neither is set
        (:func:`tier_table`). Raises ConfigError for both set, an unreadable file or a bad line."""
        return tier_table(env)

    def tier_for(self, classes: Mapping[str, str]) -> Tier:
        """First tier whose every match term equals the request's (sanitised) class value."""
        for rule in self.rules:
            if all(classes.get(dim) == value for dim, value in rule.match):
                return rule.tier
        return self.default

    def reserved(self) -> dict[str, set[str]]:
        """Class values the table names, per dimension: they always keep their own metric label."""
        out: dict[str, set[str]] = {}
        for rule in self.rules:
            for dim, value in rule.match:
                out.setdefault(dim, set()).add(value)
        return out

    @property
    def tiers(self) -> list[Tier]:
        seen: dict[str, Tier] = {}
        for rule in self.rules:
            seen.setdefault(rule.tier.name, rule.tier)
        return list(seen.values())


TIERS_VARIABLES = ("LLM_OTEL_TIERS", "LLM_OTEL_TIERS_FILE")


def tier_table(
    env: Mapping[str, str] | None = None, names: tuple[str, str] = TIERS_VARIABLES, default: TierTable | None = None
) -> TierTable | None:
    """The :class:`TierTable` ``LLM_OTEL_TIERS_FILE`` or ``LLM_OTEL_TIERS`` defines, ``default``
    (None) when neither is set. Raises ConfigError for both set, an unreadable file or a bad line."""
    env = os.environ if env is None else env
    inline_name, file_name = names
    path = (env.get(file_name) or "").strip()
    inline = (env.get(inline_name) or "").strip()
    if path and inline:
        raise ConfigError(f"{inline_name} and {file_name} are both set; use one")
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file_name}={path!r}: cannot read it ({exc})") from None
        return TierTable.parse(text, f"{file_name} {path}")
    if inline:
        return TierTable.parse(inline, inline_name, separator=";")
    return default
