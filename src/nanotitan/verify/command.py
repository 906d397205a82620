"""`nanotitan verify`'s command line (cli.py hands it its arguments): verify's own flags, then the config's.

    --layout dp=2,pp=2,ep=2   the layout to check (default: the config's own parallel.dp/pp/ep/tp/cp)
    --steps N                 steps to compare (default 3; the first is compared tensor by tensor)
    --json PATH               the whole comparison (every row) as JSON
    --fuzz N [--seed S] [--log PATH] [--chunk K]   N configurations drawn from the composition space (fuzz.py)
    --hf DIR [--hf-export]    a Hugging Face checkpoint's import (and export) against transformers (hf_check.py)
    --config FILE, --section.key VALUE   the config, as `nanotitan train` reads it
"""

from __future__ import annotations

import sys

from ..config.config import ConfigError, load_config

VALUED = {"--layout": str, "--steps": int, "--json": str, "--fuzz": int, "--seed": int, "--log": str, "--hf": str,
          "--config": str, "--chunk": int}
SWITCHES = ("--hf-export",)


def split_flags(argv: list[str]) -> tuple[dict, list[str]]:
    """({flag: value} of verify's own flags, the config's overrides)."""
    own: dict = {}
    rest, i = [], 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in SWITCHES:
            own[flag] = True
            i += 1
        elif flag in VALUED:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{flag} needs a value (nanotitan verify --help)")
                value, i = argv[i + 1], i + 1
            try:
                own[flag] = VALUED[flag](value)
            except ValueError:
                raise ConfigError(f"{flag}={value!r} must be {VALUED[flag].__name__} (nanotitan verify --help)") \
                    from None
            i += 1
        else:
            rest.append(argv[i])
            i += 1
    return own, rest


def main(argv: list[str]) -> int:
    own, overrides = split_flags(argv)
    if "--hf" in own:
        from .hf_check import check_hf

        return check_hf(own["--hf"], own.get("--hf-export", False), own.get("--json"))
    if own.get("--hf-export"):
        raise ConfigError("--hf-export checks the round trip of an import: it needs --hf DIR")
    if "--fuzz" in own:  # the flags given apply after each draw (the data, a key to pin)
        from .fuzz import fuzz_main

        return fuzz_main(own.get("--config"), overrides, own["--fuzz"], own.get("--seed", 0), own.get("--log"),
                         own.get("--steps", 2), own.get("--chunk", 0))
    cfg = load_config(own.get("--config"), overrides)
    from .check import parse_layout, report, verify, write_json

    outcome = verify(cfg, parse_layout(own["--layout"]) if "--layout" in own else None, own.get("--steps", 3))
    if outcome.detail:  # a run that did not finish: its failing rank's traceback, then the report
        print(outcome.detail, file=sys.stderr, flush=True)
    print("\n".join(report(outcome)), flush=True)
    if "--json" in own:
        write_json(own["--json"], outcome, cfg)
    return outcome.code
