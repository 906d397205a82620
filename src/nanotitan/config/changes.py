"""What changed between a checkpoint's config and this run's: every key whose value differs, as `key: old -> new`.

Both sides are the configs as TOML (a checkpoint's config.toml, and `to_toml` of this run's resolved config), read
back into {section: {key: value}}, so a key one side lacks (a checkpoint older than the key) shows as `(unset)`.
Standard library only: the launcher compares them before torch is imported (run/rundir.py), the ranks on resume.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

# Keys that say what to do with a run dir, not what is trained: they differ between a run and its resumption by
# design, so they neither make checkpoints "another config's" nor print as a change.
INTENT_KEYS = frozenset({"train.resume", "run.overwrite", "train.allow_data_change"})
UNSET = object()


def read_toml(path: Path) -> dict | None:
    """{section: {key: value}} of a config.toml; None when it is missing or unreadable."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    return {s: body for s, body in data.items() if isinstance(body, dict)}


def config_changes(old: dict, new: dict, skip: frozenset[str] = INTENT_KEYS) -> list[tuple[str, object, object]]:
    """[(section.key, old value, new value)] for every key whose value differs, in `new`'s order (then keys only
    `old` has); a side without the key gives UNSET, except that a key `old` lacks (a checkpoint older than the key)
    whose new value is its default is no change. Numbers compare by value (a TOML 3 is the 3.0 of a float key)."""
    from .config import Config, to_toml

    defaults = tomllib.loads(to_toml(Config()))
    out = []
    keys = [(s, k) for s, body in new.items() for k in body]
    keys += [(s, k) for s, body in old.items() for k in body if k not in new.get(s, {})]
    for section, key in keys:
        name = f"{section}.{key}"
        a, b = old.get(section, {}).get(key, UNSET), new.get(section, {}).get(key, UNSET)
        if a is UNSET and _same(defaults.get(section, {}).get(key, UNSET), b):
            continue
        if name not in skip and not _same(a, b):
            out.append((name, a, b))
    return out


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return float(a) == float(b)
    return a == b


def value_text(v) -> str:
    """A value as a user types it in TOML: true, 3, 0.001, "text", [1, 2]; (unset) for a key one side lacks."""
    if v is UNSET:
        return "(unset)"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(value_text(x) for x in v) + "]"
    return repr(v)


def change_lines(changes: list[tuple[str, object, object]]) -> list[str]:
    """One `key: old -> new` line per change."""
    return [f"{key}: {value_text(a)} -> {value_text(b)}" for key, a, b in changes]


def changes_in_brief(changes: list[tuple[str, object, object]], most: int = 4) -> str:
    """The first `most` changes on one line, `key old -> new`, and how many more."""
    shown = "; ".join(change_lines(changes[:most]))
    return shown + (f"; and {len(changes) - most} more" if len(changes) > most else "")
