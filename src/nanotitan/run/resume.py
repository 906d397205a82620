"""What a resume changes, said before anything is loaded: every config key whose value differs from the checkpoint's
(`key: old -> new`), the data and tokenizer fingerprints the checkpoint recorded against this run's, and the learning
rate of the next step when a changed schedule key moves it (docs/checkpoint.md, "What a resume says").

A changed tokenizer is refused unless train.allow_data_change: the weights learned what each id meant under the old
one. Every rank reads the same files and takes the same decision, agreed before any rank loads a tensor.
"""

from __future__ import annotations

import copy
import json
import tomllib
from pathlib import Path
from typing import Callable

from ..config.changes import change_lines, config_changes, read_toml
from ..config.config import Config, to_toml
from ..parallel.comm import collectives as comm

FINGERPRINTS = ("data_fingerprint", "tokenizer_fingerprint")


def resume_changes(path: Path, cfg: Config, fingerprints: dict[str, str],
                   lr_at: Callable[[int, Config], float]) -> tuple[list[str], str]:
    """(the lines that say what resuming checkpoint `path` changes, for rank 0 to print (none: nothing did), the
    refusal or ''): refused, on every rank alike, when the tokenizer changed and train.allow_data_change is false."""
    try:
        info = json.loads((Path(path) / "state.json").read_text())
    except (OSError, ValueError):
        info = None  # resolve_resume verified it: a reader that fails here fails the load's checks too
    saved = read_toml(Path(path) / "config.toml")
    if info is None or saved is None:
        return [], ""
    changes = config_changes(saved, tomllib.loads(to_toml(cfg)))
    lines = change_lines(changes)
    prints, refusal = _fingerprint_lines(path, info, fingerprints, cfg.train.allow_data_change)
    lines += prints
    step = int(info["step"])
    old = _with_train(cfg, saved.get("train", {}))
    before, after = lr_at(step, old), lr_at(step, cfg)
    if abs(before - after) > 1e-9 * max(abs(before), abs(after)):
        lines.append(f"the learning rate of step {step + 1} moves from {before:.4g} to {after:.4g}: the schedule is a "
                     "function of the step and the new train keys (docs/checkpoint.md)")
    if not lines:
        return [], refusal
    return [f"resume from {path}: what differs from the run that saved it"] + [f"  {line}" for line in lines], refusal


def _fingerprint_lines(path: Path, info: dict, fingerprints: dict[str, str], allow_change: bool) -> tuple[list, str]:
    """(the changed fingerprints as lines, the refusal of a changed tokenizer unless allowed, agreed over the
    ranks, or '')."""
    if not all(k in info for k in FINGERPRINTS):
        return ["(the checkpoint records no data or tokenizer fingerprint: the data was not compared)"], ""
    old_tok, new_tok = info["tokenizer_fingerprint"], fingerprints["tokenizer_fingerprint"]
    err = ""
    if old_tok != new_tok and not allow_change:
        err = (f"resume from {path}: its run's tokenizer was {old_tok} and this run's data is prepared with another, "
               f"{new_tok}: an id would mean another token to the trained weights (the data.tokenizer or "
               "data.vocab_size it was trained with, or --train.allow_data_change true to go on)")
    err = comm.agree(err, "comparing the tokenizer on resume")
    lines = []
    for key in FINGERPRINTS:
        if info[key] != fingerprints[key]:
            name = key.replace("_", " ")
            lines.append(f"{name}: {info[key]} -> {fingerprints[key]}" + (
                " (train.allow_data_change=true)" if key == "tokenizer_fingerprint" and not err else ""))
    return lines, err


def _with_train(cfg: Config, saved_train: dict) -> Config:
    """`cfg` with the checkpoint's train keys (the ones the schedule reads), for its learning rate."""
    old = copy.deepcopy(cfg)
    for key, value in saved_train.items():
        if hasattr(old.train, key):
            setattr(old.train, key, value)
    return old
