"""Search: every valid layout of a world size, predicted and ranked; the recommendation and why.

A layout (dp, pp, ep, schedule, M, m) of world N keeps the global batch B = dp*ep*M*m and passes
`config.validate` (docs/planner.md §1). Fitting layouts rank first, then by tokens/s, then by memory.
"""

from __future__ import annotations

import dataclasses

from ..config import Config, ConfigError, validate
from ..hardware import GiB, Hardware, detect_hardware
from .cost import PlanOptions, Prediction, predict
from .shape import Layout, ModelShape, layout_config


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(cfg: Config, world: int, global_batch: int = 0) -> list[Layout]:
    """Every layout of `world` ranks with dp*ep*M*m = B that config.validate accepts; both schedules when pp > 1."""
    B = global_batch or cfg.layout_batch
    out = []
    for pp in divisors(world):
        for ep in divisors(world // pp):
            dp = world // (pp * ep)
            if B % (dp * ep):
                continue
            b = B // (dp * ep)
            for M in divisors(b):
                for schedule in (("gpipe", "1f1b") if pp > 1 else (cfg.parallel.schedule,)):
                    layout = Layout(dp, pp, ep, schedule, M, b // M)
                    try:
                        validate(layout_config(cfg, layout), world_size=world)
                    except ConfigError:
                        continue  # ep does not divide the experts, pp > layers, torch_ddp with pp/ep...
                    out.append(layout)
    return out


def plan(cfg: Config, world: int, hardware: str | Hardware | None = None,
         opts: PlanOptions | None = None) -> list[Prediction]:
    """Every valid layout of `world`, best first: fitting ones by tokens/s, then less memory."""
    opts = opts or PlanOptions()
    hw = detect_hardware(hardware)
    if opts.nodes and world % opts.nodes:
        raise ConfigError(f"--ranks {world} must be a multiple of --nodes {opts.nodes}")
    shape = ModelShape.from_config(cfg, **opts.shape_extra)
    layouts = [lay for lay in enumerate_layouts(cfg, world, opts.global_batch)
               if not opts.micro_batch or lay.micro_batch == opts.micro_batch]
    preds = [predict(cfg, lay, hw, opts, shape) for lay in layouts]
    preds.sort(key=lambda p: (not p.fits, -p.tokens_per_sec, p.peak_mem))
    return preds


def recommend(cfg: Config, world: int, hardware: str | Hardware | None = None,
              opts: PlanOptions | None = None) -> tuple[int, int, int, str, int, int]:
    """(dp, pp, ep, schedule, microbatches, micro_batch) of the fastest layout that fits memory."""
    preds = plan(cfg, world, hardware, opts)
    if not preds:
        B = (opts and opts.global_batch) or cfg.layout_batch
        raise ConfigError(f"no layout of {world} ranks keeps global batch {B} with "
                          f"{cfg.model.num_experts} experts and {cfg.model.n_layers} layers "
                          f"(change --parallel.microbatches/--train.micro_batch or the world size)")
    if not preds[0].fits:
        p = min(preds, key=lambda q: q.peak_mem)
        raise ConfigError(f"no layout of {world} ranks fits memory: the smallest needs {p.peak_mem / GiB:.1f} GiB "
                          f"per rank > {p.mem_limit / GiB:.1f} GiB ({p.layout.short()}); use more ranks, "
                          f"--train.activation_checkpointing true or a smaller --train.micro_batch")
    return preds[0].layout.as_tuple()


def reason(preds: list[Prediction]) -> str:
    """One line: why the first prediction is the recommendation."""
    best = preds[0]
    if not best.fits:
        return "nothing fits memory; the table is ranked by speed anyway"
    line = (f"fastest layout that fits: {best.tokens_per_sec:,.0f} tok/s, {best.peak_mem / GiB:.2f} of "
            f"{best.mem_limit / GiB:.1f} GiB per rank, dominant cost {best.dominant}")
    faster_oom = [p for p in preds if not p.fits and p.tokens_per_sec > best.tokens_per_sec]
    same = lambda a, b: dataclasses.replace(a, schedule="") == dataclasses.replace(b, schedule="")
    nxt = next((p for p in preds[1:] if p.fits and not same(p.layout, best.layout)), None)  # not its other schedule
    if nxt:
        line += f"; next {nxt.layout.short()} is {100 * (1 - nxt.tokens_per_sec / best.tokens_per_sec):.0f}% slower ({nxt.dominant})"
    if faster_oom:
        line += f"; {faster_oom[0].layout.short()} would be faster but needs {faster_oom[0].peak_mem / GiB:.1f} GiB"
    return line


def format_table(preds: list[Prediction], top: int) -> str:
    lines = ["| # | dp | pp | ep | schedule | M | m | tokens/s | step (ms) | mem/rank (GiB) | fits | dominant cost |",
             "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for i, p in enumerate(preds[:top], 1):
        L = p.layout
        lines.append(f"| {i} | {L.dp} | {L.pp} | {L.ep} | {L.schedule if L.pp > 1 else '-'} | {L.microbatches} | "
                     f"{L.micro_batch} | {p.tokens_per_sec:,.0f} | {1e3 * p.step_time_s:,.1f} | "
                     f"{p.peak_mem / GiB:.2f} | {'yes' if p.fits else 'NO'} | {p.dominant} |")
    return "\n".join(lines)
