"""Load, validate and generate code/docs from the semantic-conventions registry in ``semconv/model``.

The registry (OpenTelemetry semconv YAML, v1 group format) is the single source of every span,
event, attribute and metric name llm-otel emits. This module:

* ``load_registry(root)`` parses ``manifest.yaml`` and every group file into a :class:`Registry`;
* ``validate(registry)`` returns a list of human-readable problems (empty = valid): unique ids,
  attribute definitions only in ``registry.*`` groups, known types, ``examples`` for string types,
  requirement levels, resolvable ``ref``s, metric instrument and UCUM unit, span kinds;
* ``render_python(registry)`` / ``render_markdown(registry)`` return the generated files;
* ``main()`` (``python -m llm_otel._semconv_registry [--check]``) writes them, or with ``--check``
  exits 1 when the checked-in files are stale; exits 2 with one line on stderr when there is no
  registry (not a source checkout) or PyYAML is missing.

Requires PyYAML (a development/test dependency; the generated constants need nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import keyword
import pathlib
import re
import sys
from typing import Any

SCALAR_TYPES = {"string", "int", "double", "boolean"}
ARRAY_TYPES = {"string[]", "int[]", "double[]", "boolean[]"}
REQUIREMENT_LEVELS = {"required", "recommended", "opt_in"}
CONDITIONAL_LEVELS = {"conditionally_required", "recommended"}
GROUP_TYPES = {"attribute_group", "span", "event", "metric", "resource"}
SPAN_KINDS = {"client", "server", "producer", "consumer", "internal"}
INSTRUMENTS = {"counter", "updowncounter", "gauge", "histogram"}
STABILITIES = {"stable", "development", "alpha", "beta", "release_candidate"}
# UCUM units we accept: plain units or curly-brace annotations such as {token}.
UNIT_RE = re.compile(r"^(1|s|ms|us|ns|By|KiBy|MiBy|%|\{[a-z_]+\}(/s)?)$")
GENERATOR = "python -m llm_otel._semconv_registry"


@dataclasses.dataclass
class Attribute:
    id: str
    type: str  # one of SCALAR_TYPES | ARRAY_TYPES | "enum"
    brief: str
    stability: str
    examples: Any
    members: list[dict] | None
    origin: str  # "official" or "llm-otel"
    group: str
    # how a client reaches the value and its bound (annotations.client_input: {from, bound}), or None
    client_input: dict | None = None


@dataclasses.dataclass
class Registry:
    root: pathlib.Path
    manifest: dict
    groups: list[dict]
    attributes: dict[str, Attribute]

    def group_of_type(self, kind: str) -> list[dict]:
        return [g for g in self.groups if g.get("type") == kind]

    def attribute_python_type(self, attr_id: str) -> str:
        """The registry type of an attribute as the live check compares it (enums are strings)."""
        attr = self.attributes[attr_id]
        return "string" if attr.type == "enum" else attr.type

    def span_names(self) -> dict[str, dict]:
        """span name (or template) -> span group."""
        return {g["annotations"]["span_name"]: g for g in self.group_of_type("span")}

    def event_names(self) -> dict[str, dict]:
        return {g["name"]: g for g in self.group_of_type("event")}

    def metric_names(self) -> dict[str, dict]:
        return {g["metric_name"]: g for g in self.group_of_type("metric")}


def default_root() -> pathlib.Path:
    """The repository's ``semconv/model`` directory (this file lives in src/llm_otel/)."""
    return pathlib.Path(__file__).resolve().parents[2] / "semconv" / "model"


def load_registry(root: pathlib.Path | None = None) -> Registry:
    """Parse the registry under ``root``. Raises OSError/yaml.YAMLError on unreadable files."""
    import yaml

    root = pathlib.Path(root or default_root())
    manifest = yaml.safe_load((root / "manifest.yaml").read_text())
    groups: list[dict] = []
    for path in sorted(root.rglob("*.yaml")):
        if path.name == "manifest.yaml":
            continue
        doc = yaml.safe_load(path.read_text()) or {}
        for group in doc.get("groups", []):
            group = dict(group)
            group["_file"] = str(path.relative_to(root))
            groups.append(group)
    attributes: dict[str, Attribute] = {}
    for group in groups:
        if group.get("type") != "attribute_group":
            continue
        origin = (group.get("annotations") or {}).get("origin", "llm-otel")
        for raw in group.get("attributes", []):
            if "id" not in raw:
                continue
            typ = raw.get("type")
            members = None
            if isinstance(typ, dict):
                members = typ.get("members")
                typ = "enum"
            attributes.setdefault(
                raw["id"],
                Attribute(
                    raw["id"],
                    typ,
                    raw.get("brief", ""),
                    raw.get("stability", ""),
                    raw.get("examples"),
                    members,
                    origin,
                    group["id"],
                    (raw.get("annotations") or {}).get("client_input"),
                ),
            )
    return Registry(root, manifest, groups, attributes)


def validate(reg: Registry) -> list[str]:
    """Check the registry; returns a list of problems, empty when valid."""
    problems: list[str] = []
    for key in ("name", "description", "schema_url"):
        if not reg.manifest.get(key):
            problems.append(f"manifest.yaml: missing {key!r}")
    for i, item in enumerate(reg.manifest.get("client_input") or []):
        if not isinstance(item, dict) or not item.get("input"):
            problems.append(f"manifest.yaml: client_input[{i}] needs input, from and bound")
        else:
            problems.extend(_check_client_input(f"manifest.yaml: client_input {item['input']!r}", item, input_row=True))
    seen_groups: dict[str, str] = {}
    seen_attrs: dict[str, str] = {}
    # a span, event or metric name declared twice would silently replace the first generated constant
    seen_names: dict[tuple[Any, str], str] = {}
    for g in reg.groups:
        where = f"{g['_file']}:{g.get('id', '?')}"
        gid = g.get("id")
        if not gid:
            problems.append(f"{where}: group without id")
            continue
        if gid in seen_groups:
            problems.append(f"{where}: duplicate group id (also in {seen_groups[gid]})")
        seen_groups[gid] = g["_file"]
        gtype: Any = g.get("type")  # whatever the YAML holds: checked against GROUP_TYPES below
        emitted = {
            "span": (g.get("annotations") or {}).get("span_name"),
            "event": g.get("name"),
            "metric": g.get("metric_name"),
        }.get(gtype)
        if emitted:
            if (gtype, emitted) in seen_names:
                problems.append(f"{where}: {gtype} {emitted!r} already declared by {seen_names[gtype, emitted]}")
            seen_names[gtype, emitted] = where
        if gtype not in GROUP_TYPES:
            problems.append(f"{where}: unknown group type {gtype!r}")
        if not g.get("brief"):
            problems.append(f"{where}: missing brief")
        if gtype != "attribute_group" and g.get("stability") not in STABILITIES:
            problems.append(f"{where}: stability must be one of {sorted(STABILITIES)}")
        if gtype == "span":
            if g.get("span_kind") not in SPAN_KINDS:
                problems.append(f"{where}: span_kind must be one of {sorted(SPAN_KINDS)}")
            if not (g.get("annotations") or {}).get("span_name"):
                problems.append(f"{where}: span group needs annotations.span_name")
            for ev in g.get("events", []) or []:
                if ev not in {e.get("name") for e in reg.group_of_type("event")}:
                    problems.append(f"{where}: event {ev!r} is not defined by an event group")
        if gtype == "event" and not g.get("name"):
            problems.append(f"{where}: event group needs name")
        if gtype == "metric":
            if not g.get("metric_name"):
                problems.append(f"{where}: metric group needs metric_name")
            if g.get("instrument") not in INSTRUMENTS:
                problems.append(f"{where}: instrument must be one of {sorted(INSTRUMENTS)}")
            unit = g.get("unit")
            if not isinstance(unit, str) or not UNIT_RE.match(unit):
                problems.append(f"{where}: unit {unit!r} is not a UCUM unit we accept")
            bounds = (g.get("annotations") or {}).get("bucket_boundaries")
            if g.get("instrument") == "histogram":
                if not bounds or sorted(bounds) != bounds or len(set(bounds)) != len(bounds):
                    problems.append(f"{where}: histogram needs strictly increasing annotations.bucket_boundaries")
        for raw in g.get("attributes", []) or []:
            if "id" in raw:
                aid = raw["id"]
                awhere = f"{where}/{aid}"
                if gtype != "attribute_group" or not gid.startswith("registry."):
                    problems.append(f"{awhere}: attributes may only be defined in registry.* attribute groups")
                if aid in seen_attrs:
                    problems.append(f"{awhere}: duplicate attribute id (also in {seen_attrs[aid]})")
                seen_attrs[aid] = gid
                origin = (g.get("annotations") or {}).get("origin", "llm-otel")
                if origin != "official" and not aid.startswith("llm."):
                    problems.append(f"{awhere}: llm-otel's own attributes live under 'llm.'")
                if origin == "official" and aid.startswith("llm."):
                    problems.append(f"{awhere}: 'llm.' attributes cannot be marked official")
                typ = raw.get("type")
                if isinstance(typ, dict):
                    members = typ.get("members") or []
                    if not members:
                        problems.append(f"{awhere}: enum without members")
                    for m in members:
                        if not all(m.get(k) for k in ("id", "value", "brief", "stability")):
                            problems.append(f"{awhere}: enum member needs id, value, brief, stability")
                elif typ not in SCALAR_TYPES | ARRAY_TYPES:
                    problems.append(f"{awhere}: unknown type {typ!r}")
                if raw.get("stability") not in STABILITIES:
                    problems.append(f"{awhere}: stability must be one of {sorted(STABILITIES)}")
                if not raw.get("brief"):
                    problems.append(f"{awhere}: missing brief")
                if typ in ("string", "string[]") and not raw.get("examples"):
                    problems.append(f"{awhere}: string attributes need examples")
                if raw.get("examples") is not None:
                    problems.extend(_check_examples(awhere, typ, raw["examples"]))
                problems.extend(_check_client_input(awhere, (raw.get("annotations") or {}).get("client_input")))
            elif "ref" in raw:
                ref = raw["ref"]
                if ref not in reg.attributes:
                    problems.append(f"{where}: ref {ref!r} does not resolve to a registry attribute")
                if gtype == "attribute_group" and gid.startswith("registry."):
                    problems.append(f"{where}: registry groups define attributes, they do not ref them")
                problems.extend(_check_requirement(f"{where}/{ref}", raw.get("requirement_level")))
            else:
                problems.append(f"{where}: attribute entry needs 'id' or 'ref'")
    return problems


def _check_client_input(where: str, entry: Any, input_row: bool = False) -> list[str]:
    """``annotations.client_input`` of an attribute (or a ``client_input`` row of the manifest):
    absent, or ``from`` (how a client reaches the value) and ``bound`` (what bounds it), both text."""
    if entry is None:
        return []
    allowed = {"from", "bound"} | ({"input"} if input_row else set())
    if not isinstance(entry, dict) or set(entry) != allowed or not all(isinstance(entry[k], str) for k in allowed):
        return [f"{where}: client_input needs exactly {sorted(allowed)}, as text"]
    return []


def _check_requirement(where: str, level: Any) -> list[str]:
    if level is None:
        return [f"{where}: requirement_level missing"]
    if isinstance(level, str):
        return [] if level in REQUIREMENT_LEVELS else [f"{where}: unknown requirement_level {level!r}"]
    if isinstance(level, dict) and len(level) == 1:
        ((key, cond),) = level.items()
        if key in CONDITIONAL_LEVELS and isinstance(cond, str) and cond:
            return []
    return [f"{where}: requirement_level must be a level or {{conditionally_required: <condition>}}"]


def _check_examples(where: str, typ: Any, examples: Any) -> list[str]:
    if isinstance(typ, dict):
        values = {m.get("value") for m in typ.get("members") or []}
        ex = examples if isinstance(examples, list) else [examples]
        bad = [e for e in ex if e not in values]
        return [f"{where}: example {bad[0]!r} is not an enum value"] if bad else []
    check = {
        "string": lambda v: isinstance(v, str),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "double": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
    }
    ex = examples if isinstance(examples, list) else [examples]
    if typ in ARRAY_TYPES:
        elem = typ[:-2]
        ok = all(isinstance(e, list) and all(check[elem](x) for x in e) for e in ex)
    elif typ in check:
        ok = all(check[typ](e) for e in ex)
    else:
        return []
    return [] if ok else [f"{where}: examples do not match type {typ}"]


# --- generation -------------------------------------------------------------------------------


def _const(name: str) -> str:
    c = re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_").upper()
    return c + "_" if keyword.iskeyword(c.lower()) else c


def _header(kind: str) -> str:
    return f'"""{kind} - GENERATED by `{GENERATOR}` from semconv/model. Do not edit by hand."""\n\n# fmt: off\n'


def render_python(reg: Registry) -> dict[str, str]:
    """Return {relative file name: content} for src/llm_otel/semconv/."""
    out: dict[str, str] = {}
    lines = [_header("Attribute names")]
    for aid in sorted(reg.attributes):
        a = reg.attributes[aid]
        typ = "enum (string)" if a.type == "enum" else a.type
        lines.append(f'{_const(aid)} = {aid!r}\n"""{a.brief} Type: {typ}. Origin: {a.origin}."""\n')
    for aid in sorted(reg.attributes):
        a = reg.attributes[aid]
        if a.members:
            lines.append(f"\nclass {''.join(p.capitalize() for p in re.split(r'[._]', aid))}Values:")
            lines.append(f'    """Values of {aid}."""')
            for m in a.members:
                lines.append(f"    {_const(m['id'])} = {m['value']!r}")
            lines.append("")
    lines.append("\nATTRIBUTE_TYPES: dict[str, str] = {")
    for aid in sorted(reg.attributes):
        lines.append(f"    {aid!r}: {reg.attribute_python_type(aid)!r},")
    lines.append("}\n")
    out["attributes.py"] = "\n".join(lines)

    lines = [_header("Span and event names")]
    for name, g in sorted(reg.span_names().items(), key=lambda kv: kv[1]["id"]):
        const = _const(g["id"].removeprefix("span."))
        lines.append(f'{const} = {name!r}\n"""{g["brief"].strip()} Kind: {g["span_kind"]}."""\n')
    for name, g in sorted(reg.event_names().items()):
        lines.append(f'EVENT_{_const(name)} = {name!r}\n"""{g["brief"].strip()}"""\n')
    out["spans.py"] = "\n".join(lines)

    lines = [_header("Metric names, units and bucket boundaries")]
    for name, g in sorted(reg.metric_names().items()):
        c = _const(name)
        lines.append(f'{c} = {name!r}\n"""{g["brief"].strip()} Instrument: {g["instrument"]}, unit: {g["unit"]}."""')
        lines.append(f"{c}_UNIT = {g['unit']!r}")
        bounds = (g.get("annotations") or {}).get("bucket_boundaries")
        if bounds:
            lines.append(f"{c}_BUCKETS = {tuple(float(b) for b in bounds)!r}")
        lines.append("")
    out["metrics.py"] = "\n".join(lines)

    out["__init__.py"] = (
        _header("Semantic-convention name constants") + "from llm_otel.semconv import attributes, metrics, spans\n\n"
        f"SCHEMA_URL = {reg.manifest['schema_url']!r}\n\n"
        '__all__ = ["SCHEMA_URL", "attributes", "metrics", "spans"]\n'
    )
    return out


def render_markdown(reg: Registry) -> str:
    """The docs/semconv.md tables."""
    L = [
        f"<!-- GENERATED by `{GENERATOR}` from semconv/model. Do not edit by hand. -->",
        "# Semantic conventions of llm-otel",
        "",
        reg.manifest["description"].strip(),
        "",
        f"Schema URL: `{reg.manifest['schema_url']}`",
        "",
        "## Spans",
        "",
    ]
    for name, g in sorted(reg.span_names().items(), key=lambda kv: kv[1]["id"]):
        L += [f"### `{name}` ({g['span_kind']})", "", g["brief"].strip(), ""]
        if g.get("note"):
            L += [" ".join(g["note"].split()), ""]
        if g.get("events"):
            L += ["Events: " + ", ".join(f"`{e}`" for e in g["events"]), ""]
        L += _attr_table(reg, g)
    L += ["## Events", ""]
    for name, g in sorted(reg.event_names().items()):
        L += [f"### `{name}`", "", g["brief"].strip(), ""]
        if g.get("attributes"):
            L += _attr_table(reg, g)
    L += ["## Metrics", "", "| metric | instrument | unit | brief | buckets |", "|---|---|---|---|---|"]
    for name, g in sorted(reg.metric_names().items()):
        bounds = (g.get("annotations") or {}).get("bucket_boundaries")
        L.append(
            f"| `{name}` | {g['instrument']} | `{g['unit']}` | {g['brief'].strip()} | "
            f"{', '.join(str(b) for b in bounds) if bounds else ''} |"
        )
    L += _client_input_section(reg)
    L += ["", "## Attribute registry", "", "| attribute | type | origin | brief |", "|---|---|---|---|"]
    for aid in sorted(reg.attributes):
        a = reg.attributes[aid]
        typ = "enum: " + ", ".join(f"`{m['value']}`" for m in a.members) if a.members else a.type
        L.append(f"| `{aid}` | {typ} | {a.origin} | {a.brief} |")
    return "\n".join(L) + "\n"


def _client_input_section(reg: Registry) -> list[str]:
    """The table of every value a client can choose and what bounds it: the attributes with
    ``annotations.client_input``, then the manifest's ``client_input`` rows (inputs that are no
    attribute of their own: trace headers, baggage, request fields llm-otel does not read)."""
    L = ["", "## Values a client chooses", ""]
    intro = reg.manifest.get("client_input_note")
    if intro:
        L += [" ".join(str(intro).split()), ""]
    L += ["| value | where a client sets it | bound |", "|---|---|---|"]
    for aid in sorted(reg.attributes):
        ci = reg.attributes[aid].client_input
        if ci:
            L.append(f"| `{aid}` | {' '.join(ci['from'].split())} | {' '.join(ci['bound'].split())} |")
    for item in reg.manifest.get("client_input") or []:
        L.append(f"| {item['input']} | {' '.join(item['from'].split())} | {' '.join(item['bound'].split())} |")
    return L


def _attr_table(reg: Registry, g: dict) -> list[str]:
    rows = ["| attribute | type | requirement | brief |", "|---|---|---|---|"]
    for raw in g.get("attributes", []) or []:
        ref = raw.get("ref")
        if ref is None or ref not in reg.attributes:
            continue
        level = raw.get("requirement_level")
        if isinstance(level, dict):
            ((k, v),) = level.items()
            level = f"{k}: {v}"
        rows.append(f"| `{ref}` | {reg.attribute_python_type(ref)} | {level} | {reg.attributes[ref].brief} |")
    return rows + [""]


def generated_files(reg: Registry) -> dict[pathlib.Path, str]:
    repo = reg.root.parents[1]
    files = {repo / "src" / "llm_otel" / "semconv" / n: c for n, c in render_python(reg).items()}
    files[repo / "docs" / "semconv.md"] = render_markdown(reg)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Validate semconv/model and (re)generate code and docs.")
    parser.add_argument("--check", action="store_true", help="validate and fail if generated files are stale")
    parser.add_argument("--root", type=pathlib.Path, default=None, help="registry directory (semconv/model)")
    args = parser.parse_args(argv)
    root = pathlib.Path(args.root or default_root())
    if not (root / "manifest.yaml").is_file():
        print(
            f"semconv: no registry at {root}: the check validates semconv/model and the generated files of a "
            "source checkout of llm-otel (a git clone installed with pip install -e '.[test]', which also "
            "brings PyYAML); an installed package has nothing to check",
            file=sys.stderr,
        )
        return 2
    try:
        import yaml  # noqa: F401
    except ImportError:
        print("semconv: the check needs PyYAML, from the test extra: pip install -e '.[test]'", file=sys.stderr)
        return 2
    reg = load_registry(root)
    problems = validate(reg)
    for p in problems:
        print(f"semconv: {p}", file=sys.stderr)
    if problems:
        return 1
    stale = []
    for path, content in generated_files(reg).items():
        current = path.read_text() if path.exists() else None
        if current != content:
            stale.append(path)
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(content)
    if args.check and stale:
        for path in stale:
            print(f"semconv: stale generated file {path} - run `{GENERATOR}`", file=sys.stderr)
        return 1
    print(
        f"semconv: {len(reg.attributes)} attributes, {len(reg.groups)} groups OK"
        + ("" if args.check else f"; wrote {len(stale)} file(s)")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
