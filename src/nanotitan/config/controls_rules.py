"""The config rules of the everyday controls: the learning-rate schedule, the data mixture and the export at the end
of training. A leaf like config.py, which calls it from `validate`."""

from __future__ import annotations

from .errors import check as _check
from .parse import parse_mix


def check_controls(cfg) -> None:
    t, d = cfg.train, cfg.data
    _check(0.0 < t.lr_decay_frac <= 1.0,
           f"train.lr_decay_frac={t.lr_decay_frac} must be in (0, 1]: the share of train.steps that train.lr_schedule="
           "wsd spends decaying (--train.lr_decay_frac 0.2)")
    if d.mix:
        parse_mix(d.mix)  # each entry SOURCE:WEIGHT, weights >= 0 summing to > 0, or one line naming the fix
        _check(d.loader == "indexed", "data.mix blends prepared sources by global index: --data.loader indexed "
               "(or --data.mix '')")
    if t.export_hf:
        _check(t.ckpt_at_end, f"train.export_hf={t.export_hf!r} exports the final checkpoint: --train.ckpt_at_end "
               "true (or --train.export_hf '')")
