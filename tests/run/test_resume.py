"""What a resume says before it loads (run/resume.py): each config key that differs as `key: old -> new`, a changed
data fingerprint, the learning rate a changed schedule moves; another tokenizer refused unless allowed; a checkpoint
from before the fingerprints still resumes, saying they were not compared."""

import json
import re

from nanotitan.config.config import load_config, to_toml
from nanotitan.run.resume import resume_changes
from nanotitan.train import lr_at

PRINTS = {"data_fingerprint": "aaaaaaaaaaaa", "tokenizer_fingerprint": "tttttttttttt"}


def _saved(tmp_path, args, step, **state):
    d = tmp_path / "checkpoints" / f"step_{step}"
    d.mkdir(parents=True)
    (d / "config.toml").write_text(to_toml(load_config(None, args)))
    (d / "state.json").write_text(json.dumps({"format": 2, "step": step, "extra": {}, "layout": {}, **state}))
    return d


def test_a_resume_lists_what_changed(tmp_path):
    base = ["--train.steps", "40", "--train.warmup_steps", "4", "--run.dir", str(tmp_path)]
    path = _saved(tmp_path, base, 20, **PRINTS)
    same = load_config(None, base + ["--train.resume", "auto"])
    assert resume_changes(path, same, PRINTS, lr_at) == ([], "")  # nothing but the intent keys differ
    longer = load_config(None, base + ["--train.steps", "80", "--data.val_fraction", "0.1"])
    data = {**PRINTS, "data_fingerprint": "bbbbbbbbbbbb"}
    before, after = lr_at(20, same), lr_at(20, longer)
    assert resume_changes(path, longer, data, lr_at) == ([
        f"resume from {path}: what differs from the run that saved it",
        "  data.val_fraction: 0.05 -> 0.1",
        "  train.steps: 40 -> 80",
        "  data fingerprint: aaaaaaaaaaaa -> bbbbbbbbbbbb",
        f"  the learning rate of step 21 moves from {before:.4g} to {after:.4g}: the schedule is a function of the "
        "step and the new train keys (docs/checkpoint.md)"], "")
    assert after > before  # the cosine stretched over 80 steps is higher at step 21 than over 40


def test_another_tokenizer_is_refused_unless_allowed(tmp_path):
    args = ["--run.dir", str(tmp_path)]
    path = _saved(tmp_path, args, 5, **PRINTS)
    other = {**PRINTS, "tokenizer_fingerprint": "uuuuuuuuuuuu"}
    lines, refusal = resume_changes(path, load_config(None, args + ["--train.seed", "7"]), other, lr_at)
    assert re.fullmatch(r"resume from \S+step_5: its run's tokenizer was tttttttttttt and this run's data is prepared "
                        r"with another, uuuuuuuuuuuu: .*--train\.allow_data_change true to go on\)", refusal), refusal
    # what else changed is said before the refusal
    assert lines[1:] == ["  train.seed: 1337 -> 7", "  tokenizer fingerprint: tttttttttttt -> uuuuuuuuuuuu"]
    lines, refusal = resume_changes(path, load_config(None, args + ["--train.allow_data_change", "true"]), other,
                                    lr_at)
    assert refusal == "" and lines[1:] == ["  tokenizer fingerprint: tttttttttttt -> uuuuuuuuuuuu "
                                           "(train.allow_data_change=true)"]


def test_a_checkpoint_without_fingerprints_still_resumes(tmp_path):
    args = ["--run.dir", str(tmp_path)]
    path = _saved(tmp_path, args, 5)  # saved before the fingerprints were recorded
    lines, refusal = resume_changes(path, load_config(None, args), PRINTS, lr_at)
    assert refusal == "" and lines[1:] == ["  (the checkpoint records no data or tokenizer fingerprint: the data was "
                                           "not compared)"]
