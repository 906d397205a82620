"""The config rules of the keys that stand alone: training, data and the run dir. A leaf like config.py, which calls
`check_run` from `validate`."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import check as _check
from .parse import parse_steps


def check_run(cfg) -> None:
    """Training, data and run keys that stand alone."""
    t, p, d = cfg.train, cfg.parallel, cfg.data
    if cfg.run.profile_steps:
        parse_steps(cfg.run.profile_steps, t.steps)  # "A-B" inside 1..train.steps, or one line naming the fix
    if cfg.run.wandb:
        import importlib.util

        _check(importlib.util.find_spec("wandb") is not None,
               "run.wandb=true needs the wandb package: pip install 'nanotitan[wandb]' (or --run.wandb false)")
    _check(t.eval_every == 0 or t.eval_batches >= 1,
           f"train.eval_batches=0 with train.eval_every={t.eval_every}: eval needs >= 1 batch "
           "(--train.eval_batches 4, or --train.eval_every 0 to disable eval)")
    _check(0 < p.timeout_s <= 1e9,
           f"parallel.timeout_s={p.timeout_s} must be in (0, 1e9] seconds (--parallel.timeout_s)")
    for name, v in [("data.source", d.source), ("data.text_field", d.text_field), ("run.dir", cfg.run.dir)]:
        _check(v.strip() != "", f"{name} must not be empty (--{name})")
    blocker = run_dir_blocker(cfg.run.dir)
    _check(blocker is None, f"run.dir={cfg.run.dir!r} cannot be created: {blocker} (--run.dir DIR)")
    _check(0.0 < d.val_fraction < 0.5, f"data.val_fraction={d.val_fraction} must be in (0, 0.5) (--data.val_fraction)")
    _check(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1] (--train.min_lr_ratio)")
    _check(t.resume in ("", "auto", "never") or Path(t.resume).exists(),
           f"train.resume={t.resume!r}: no such checkpoint (use auto, never or an existing path; --train.resume)")


def run_dir_blocker(run_dir: str) -> str | None:
    """Why run_dir could never be created (None: nothing on its path is in the way): a file where a directory
    must be, or a directory this user cannot enter (Path.exists raises PermissionError below it: the nearest
    ancestor that can be looked up is the one that cannot be entered). os.stat, whose PermissionError is caught
    and named here (Path.exists raised it from inside validate: a traceback)."""
    p, denied = Path(run_dir), False
    for q in (p, *p.parents):
        try:
            mode = os.stat(q).st_mode
        except PermissionError:
            denied = True
            continue
        except OSError:  # not there (or a file on the way, named when the walk reaches it): look further up
            continue
        if denied:
            return f"{q} cannot be entered (permission denied)"
        return None if stat.S_ISDIR(mode) else f"{q} is a file, not a directory"
    return None
