"""What to change, computed from the command (`--what-if`, docs/planner.md §8): for each cause that dominates the
best layout's step, the config changes that act on it which the search does not already vary (the layout, its
schedule and zero level are already the best the planner found). Each change is offered only where the command
does not already make it and config.validate accepts it: applied to the config and options the plan was made
with, the best layout is predicted again under it, and the advice says by how much it is faster or slower and
whether it still fits. A change of train.micro_batch trains a different model and says so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config.config import Config, ConfigError, validate
from ..config.hardware import GiB, Hardware
from .cost import PlanOptions, Prediction, predict
from .shape import Layout, layout_config


@dataclass
class Change:
    """One candidate: the flags that make it, what it is, and how it changes the config, the options or the layout."""
    flags: str
    what: str
    cfg: Config
    opts: PlanOptions
    layout: Layout
    different_model: bool = False


def _with(cfg: Config, section: str, **fields) -> Config:
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **fields)})


def candidates(cause: str, cfg: Config, opts: PlanOptions, lay: Layout) -> list[Change]:
    """The changes that act on `cause` and that this command does not already make."""
    ac = cfg.train.activation_checkpointing if opts.activation_checkpointing is None else opts.activation_checkpointing
    out = []
    same = lambda flags, what, c=cfg, o=opts: Change(flags, what, c, o, lay)  # noqa: E731
    if cause == "compute":
        if cfg.train.dtype != "bf16" and not opts.precision:
            out.append(same("--train.dtype bf16", "bf16 compute", _with(cfg, "train", dtype="bf16")))
        if ac:
            out.append(same("--train.activation_checkpointing false", "no activation checkpointing",
                            o=dataclasses.replace(opts, activation_checkpointing=False)))
    if cause == "ep_a2a" and lay.moe_ep > 1:
        if not cfg.parallel.ep_overlap:
            out.append(same("--parallel.ep_overlap true", "the all-to-all overlapped with the experts' compute",
                            _with(cfg, "parallel", ep_overlap=True)))
        if not cfg.parallel.ep_overlap_microbatches and lay.microbatches > 1:
            out.append(same("--parallel.ep_overlap_microbatches true", "one microbatch's all-to-all beside another's "
                            "compute", _with(cfg, "parallel", ep_overlap_microbatches=True)))
    if cause == "dp_allreduce" and cfg.parallel.reduce_dtype != "bf16":
        out.append(same("--parallel.reduce_dtype bf16", "bf16 gradient reduction",
                        _with(cfg, "parallel", reduce_dtype="bf16")))
    if cause == "tp" and lay.tp > 1 and not cfg.parallel.sp:
        out.append(same("--parallel.sp true", "sequence parallel", _with(cfg, "parallel", sp=True)))
    if cause == "cp" and lay.cp > 1:
        other = "a2a" if cfg.parallel.cp_impl == "ring" else "ring"
        out.append(same(f"--parallel.cp_impl {other}", f"CP by {other}", _with(cfg, "parallel", cp_impl=other)))
    m, M = lay.micro_batch, lay.microbatches
    if cause in ("overhead", "bubble") and opts.micro_batch:  # m held (a free m: the search already chose it)
        # overhead: fewer, larger microbatches; bubble: more, smaller ones; the global batch kept
        m2, M2 = (m * 2, M // 2) if cause == "overhead" else (m // 2, M * 2)
        if m2 >= 1 and m2 * M2 == m * M:
            out.append(Change(f"--train.micro_batch {m2} --parallel.microbatches {M2}",
                              f"microbatches of {m2} sequences", cfg, dataclasses.replace(opts, micro_batch=m2),
                              dataclasses.replace(lay, micro_batch=m2, microbatches=M2), different_model=True))
    return out


def _valid(ch: Change, world: int) -> bool:
    try:
        validate(layout_config(ch.cfg, ch.layout), world_size=world)
    except ConfigError:
        return False
    return True


def advise(cfg: Config, opts: PlanOptions, best: Prediction, hw: Hardware, shares: list[tuple[str, float]],
           top: int = 2, min_share: float = 0.05) -> list[dict]:
    """For each of the `top` largest causes of the best layout's step (`shares`: (cause, share of the step), largest
    first) above `min_share`: each candidate change predicted on the best layout. Returns dicts with cause, share,
    flags, what, tokens_per_sec, gain (fraction, + = faster), fits, peak_mem_bytes, different_model; a cause with no
    candidate gets one entry with flags None, saying that no change the planner prices acts on it here."""
    out = []
    for cause, share in shares[:top]:
        if share < min_share:
            continue
        found = False
        for ch in candidates(cause, cfg, opts, best.layout):
            if not _valid(ch, best.layout.world):
                continue
            p = predict(layout_config(ch.cfg, ch.layout), ch.layout, hw, ch.opts)
            out.append(dict(cause=cause, share=share, flags=ch.flags, what=ch.what, tokens_per_sec=p.tokens_per_sec,
                            gain=p.tokens_per_sec / best.tokens_per_sec - 1, fits=p.fits, peak_mem_bytes=p.peak_mem,
                            mem_limit_bytes=p.mem_limit, different_model=ch.different_model))
            found = True
        if not found:
            out.append(dict(cause=cause, share=share, flags=None, what=None))
    return out


def format_advice(a: dict) -> str:
    """One line of advice."""
    head = f"{a['cause']} {100 * a['share']:.0f}%"
    if a["flags"] is None:
        return (f"{head}: no config change the planner prices acts on it beyond what this command already sets (the "
                f"layout, schedule and zero level are the best found)")
    verdict = "faster" if a["gain"] > 0 else "slower"
    fit = ("fits" if a["fits"] else
           f"does NOT fit: {a['peak_mem_bytes'] / GiB:.1f} GiB of {a['mem_limit_bytes'] / GiB:.1f}")
    model = "; a DIFFERENT MODEL (the balance loss is per microbatch)" if a["different_model"] else ""
    return (f"{head}: {a['what']} ({a['flags']}): {a['tokens_per_sec']:,.0f} tok/s on the same layout, "
            f"{100 * abs(a['gain']):.1f}% {verdict}, {fit}{model}")
