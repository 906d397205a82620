"""`nanotitan train --help`: every config key as `--section.key TYPE (default) — meaning`, grouped by section.

Generated from the config dataclasses themselves: the type and default from the field, the meaning from
the field's trailing `# comment` in config.py's source (read with inspect + tokenize), so the help cannot
fall out of date with the code. A field without a comment is a bug that tests/test_cli_help.py catches.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import tokenize
import types
import typing
from typing import Literal

from . import config


def field_comments(cls) -> dict[str, str]:
    """{field name: its comment} for a dataclass: the trailing `# ...` of the field's line (or, failing that,
    the comment lines right above it, up to a `# --- group ---` line, which heads a group and is no field's)."""
    src = inspect.getsource(cls)
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(src).readline) if tok.type == tokenize.COMMENT}
    lines = src.splitlines()
    out = {}
    (node,) = ast.parse(src).body
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        text = comments.get(stmt.end_lineno) or comments.get(stmt.lineno)
        if not text:  # a comment block directly above the field
            above, i = [], stmt.lineno - 1
            while i >= 1 and lines[i - 1].strip().startswith("#") and not lines[i - 1].strip().startswith("# ---"):
                above.insert(0, comments[i])
                i -= 1
            text = " ".join(above)
        out[stmt.target.id] = text
    return out


def type_name(typ) -> str:
    """int, float, str, bool, list[int], or {a,b} for a Literal's choices."""
    origin = typing.get_origin(typ)
    if origin is Literal:
        return "{" + ",".join(str(c) for c in typing.get_args(typ)) + "}"
    if origin is list:
        return f"list[{type_name(typing.get_args(typ)[0])}]"
    if origin in (typing.Union, types.UnionType):  # e.g. pp_layers: list[int] | "auto"
        return "|".join(type_name(a) for a in typing.get_args(typ))
    return getattr(typ, "__name__", str(typ))


def default_text(value) -> str:
    """The default as a user would type it on the command line or in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


def sections() -> dict[str, type]:
    """{section name: its dataclass}, in the order of `Config`'s fields."""
    hints = typing.get_type_hints(config.Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(config.Config)}


def section_keys(name: str, cls) -> list[tuple[str, str, str, str]]:
    """[(--section.key, TYPE, default, meaning)] for every field of one section."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    defaults = cls()
    return [(f"--{name}.{f.name}", type_name(hints[f.name]), default_text(getattr(defaults, f.name)),
             comments.get(f.name, "")) for f in dataclasses.fields(cls)]


def config_help(only: tuple[str, ...] | None = None) -> str:
    """All config keys (or those of the sections `only` names), one line each, grouped by section."""
    rows = {name: section_keys(name, cls) for name, cls in sections().items() if only is None or name in only}
    width = max(len(f"{k} {t} ({d})") for keys in rows.values() for k, t, d, _ in keys)
    out = ["Config keys (set them in a TOML file's [section] or as --section.key VALUE; later wins):"]
    for name, keys in rows.items():
        out.append(f"\n[{name}]")
        for key, typ, default, meaning in keys:
            out.append(f"  {f'{key} {typ} ({default})':<{width}}  — {meaning}")
    return "\n".join(out)
