"""TOML values and `--section.key VALUE` overrides as the config fields' declared types (load_config's parsing), and
the spec-valued fields' parsers (run.profile_steps, parallel.pp_layers, elastic.nodes, data.mix).

Each refusal is one ConfigError line naming the key and the fix; a value from a TOML file names the file.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import sys
import types
import typing
from dataclasses import fields
from fractions import Fraction
from typing import Literal

from .errors import ConfigError


def section_types(section_cls) -> dict[str, object]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in fields(section_cls)}


TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")


def coerce(value, typ, name: str, where: str | None = None):
    """The value as the field's declared type, or a one-line ConfigError.

    where=None: a CLI override, a string by nature, parsed here ("1e-3" -> 0.001). Otherwise `where` is the
    TOML file the value came from: TOML values are typed, so a string where a number belongs (lr = "0.001")
    is refused, and the message names the file and key instead of a flag.
    """
    from_cli = where is None

    def bad(expected: str, example: str, hint: str = "") -> ConfigError:
        if from_cli:
            return ConfigError(f"{name} must be {expected}, got {value!r} (--{name} {example})")
        return ConfigError(f"{where}: {name} must be {expected}, got {value!r}{hint}")

    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):  # list[int] | Literal["auto"]: a later member, else the first
        members = typing.get_args(typ)
        for member in members[1:]:
            try:
                return coerce(value, member, name, where)
            except ConfigError:
                pass
        return coerce(value, members[0], name, where)
    if origin is Literal:
        choices = typing.get_args(typ)
        if value not in choices:
            raise ConfigError(f"{name}={value!r} is not one of {list(choices)} (--{name})" if from_cli
                              else f"{where}: {name}={value!r} is not one of {list(choices)}")
        return value
    if origin is list:
        (inner,) = typing.get_args(typ)
        if from_cli and isinstance(value, str):
            value = [v.strip() for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
        if not isinstance(value, list):
            raise bad("a list", "1,2,3")
        return [coerce(v, inner, name, where) for v in value]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in TRUE + FALSE:
            return value.lower() in TRUE
        raise bad("true or false", "true")
    if typ is int or typ is float:
        expected, example = ("an integer", "N") if typ is int else ("a number", "X")
        if isinstance(value, (int, float) if typ is float else int) and not isinstance(value, bool):
            return typ(value)
        if isinstance(value, str):
            try:
                parsed = typ(value)
            except ValueError:
                parsed = None
            if parsed is not None and from_cli:
                return parsed
            if parsed is not None:
                raise bad(expected, example, f" (drop the quotes: {name.split('.', 1)[1]} = {value.strip()})")
        raise bad(expected, example)
    if typ is str:
        if isinstance(value, str):
            return value
        raise bad("a string", "TEXT")
    raise AssertionError(f"unsupported config type {typ} for {name}")


def set_value(cfg, section: str, key: str, value, where: str | None = None) -> None:
    """cfg.section.key = value; `where` is the TOML file the value came from (None: a CLI override)."""
    at = f"{where}: " if where else ""
    sections = [f.name for f in fields(cfg)]
    if section not in sections:
        raise ConfigError(f"{at}unknown config section [{section}]{did_you_mean(cfg, section, key)} "
                          f"(valid: {', '.join(sections)})")
    sec = getattr(cfg, section)
    types = section_types(type(sec))
    if key not in types:
        raise ConfigError(f"{at}unknown config key {section}.{key}{did_you_mean(cfg, section, key)} "
                          f"(valid keys in [{section}]: {', '.join(types)})")
    if (section, key) in RENAMED_VALUES and value in RENAMED_VALUES[section, key]:
        old, value = value, RENAMED_VALUES[section, key][value]
        if os.environ.get("RANK", "0") == "0":  # once per job, not once per rank
            print(f"nanotitan: {section}.{key}={old} is deprecated; use {value}", file=sys.stderr)
    setattr(sec, key, coerce(value, types[key], f"{section}.{key}", where))


def did_you_mean(cfg, section: str, key: str) -> str:
    """"; did you mean train.lr?" naming the closest keys to section.key (difflib's ratio >= 0.8 on the dotted
    name, or the same key under another section), or "" when none is close."""
    names = [f"{f.name}.{k}" for f in fields(cfg) for k in section_types(type(getattr(cfg, f.name)))]
    close = difflib.get_close_matches(f"{section}.{key}", names, n=3, cutoff=0.8)
    close += [n for n in names if n.split(".", 1)[1] == key and n not in close]
    return f"; did you mean {' or '.join(close[:3])}?" if close else ""


# Old values kept as aliases: (section, key) -> {old: new}.
RENAMED_VALUES = {("parallel", "dp_impl"): {"nanotitan": "bucketed"}}


def parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """['--model.n_layers', '4', '--train.lr=1e-3'] -> [('model', 'n_layers', '4'), ('train', 'lr', '1e-3')]."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or "." not in a.split("=")[0]:
            raise ConfigError(f"unexpected argument {a!r}: overrides look like --section.key VALUE")
        if "=" in a:
            k, v = a[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"{a} needs a value ({a} VALUE)")
            k, v = a[2:], args[i + 1]
            i += 2
        section, key = k.split(".", 1)
        out.append((section, key, v))
    return out


def parse_steps(spec: str, steps: int | None = None) -> tuple[int, int] | None:
    """run.profile_steps: 'A-B' (or 'A') -> (A, B), 1-based and inclusive; '' -> None (profiling off)."""
    if not spec:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+))?\s*", spec)
    first, last = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if not m or not 1 <= first <= last:
        raise ConfigError(f"run.profile_steps={spec!r} must be A-B with 1 <= A <= B (--run.profile_steps 5-7)")
    if steps is not None and last > steps:
        raise ConfigError(f"run.profile_steps={spec!r} ends after train.steps={steps} (--run.profile_steps "
                          f"{min(first, steps)}-{steps})")
    return first, last


def tidy_counts(counts) -> list[float]:
    """Layer counts (parallel.pp_layers) as ints where whole (2 rather than 2.0), halves as floats."""
    return [int(c) if float(c).is_integer() else float(c) for c in counts]


def elastic_nodes(spec: str) -> tuple[int, int]:
    """elastic.nodes "MIN:MAX" or "N" -> (MIN, MAX)."""
    lo, _, hi = spec.partition(":")
    try:
        lo_n, hi_n = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"elastic.nodes={spec!r} must be MIN:MAX or N (--elastic.nodes 2:4)") from None
    if not 1 <= lo_n <= hi_n:
        raise ConfigError(f"elastic.nodes={spec!r} needs 1 <= MIN <= MAX (--elastic.nodes 2:4)")
    return lo_n, hi_n


MIX_EXAMPLE = "--data.mix 'corpus_a:0.7,corpus_b:0.3'"


def parse_mix(spec: str) -> list[tuple[str, Fraction]]:
    """data.mix: "SRC:W,SRC:W" -> [(source, weight)], each weight the exact fraction its decimal writes (0.7 is 7/10),
    >= 0, summing to > 0; a source is what data.source takes. '' -> [] (no mix)."""
    out: list[tuple[str, Fraction]] = []
    if ";" in spec:
        raise ConfigError(f"data.mix={spec!r}: separate the entries with commas ({MIX_EXAMPLE})")
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        source, sep, text = item.rpartition(":")
        source = source.strip()
        if not sep or not source:
            raise ConfigError(f"data.mix entry {item!r} needs a source and a weight, SOURCE:WEIGHT ({MIX_EXAMPLE})")
        try:
            weight = Fraction(text.strip())
        except (ValueError, ZeroDivisionError):
            raise ConfigError(f"data.mix weight {text.strip()!r} of {source!r} is not a number ({MIX_EXAMPLE})") \
                from None
        if weight < 0:
            raise ConfigError(f"data.mix weight {text.strip()} of {source!r} must be >= 0 ({MIX_EXAMPLE})")
        if any(source == s for s, _ in out):
            raise ConfigError(f"data.mix names {source!r} twice: give each source once ({MIX_EXAMPLE})")
        out.append((source, weight))
    if spec.strip() and sum(w for _, w in out) == 0:
        raise ConfigError(f"data.mix={spec!r}: the weights sum to 0; give a source a weight > 0 ({MIX_EXAMPLE})")
    if out and sum(mix_counts([w for _, w in out])) > MIX_PERIOD_MAX:
        raise ConfigError(f"data.mix={spec!r}: the weights' common denominator exceeds 2**31; write them with fewer "
                          f"decimal digits ({MIX_EXAMPLE})")
    return out


MIX_PERIOD_MAX = 2**31  # keeps data/mix.py's integer arithmetic inside int64 (a product of two counts < 2**62)


def mix_counts(weights: list[Fraction]) -> list[int]:
    """The smallest integers a_i in the weights' exact proportions: a period of sum(a_i) samples holds a_i of source i
    (data/mix.py). [7/10, 3/10] -> [7, 3]; [2, 1] -> [2, 1]; [1/3, 1/6] -> [2, 1]."""
    total = sum(weights)
    shares = [w / total for w in weights]
    period = math.lcm(*(s.denominator for s in shares))
    return [int(s * period) for s in shares]
