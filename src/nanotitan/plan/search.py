"""Search: every valid layout of a world size, predicted and ranked; the recommendation and why.

A layout (dp, pp, ep, schedule, M, m, zero; tp and cp: plan/tp.py, plan/cp.py) of world N keeps the global batch
B = dp*ep*M*m and passes
`config.validate` (docs/planner.md §1). Fitting layouts rank first, then by tokens/s, then by memory; the
recommendation is the lowest CP degree, then zero level, within ZERO_SLACK of the fastest fitting layout, so a
split sequence and sharded DP are chosen only when memory binds (or they are clearly faster).
"""

from __future__ import annotations

import dataclasses
import itertools

from ..config.config import Config, ConfigError, validate
from ..config.hardware import GiB, Hardware, detect_hardware, fmt_bytes
from . import cp as cp_plan, tp as tp_plan
from .cost import PlanOptions, Prediction, predict
from .shape import Layout, ModelShape, layout_config


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


ZERO_SLACK = 0.03  # a CP or sharded-DP layout must beat the best with less of it by more than this to be recommended


def enumerate_layouts(cfg: Config, world: int, global_batch: int = 0, zeros: tuple[int, ...] = (0,),
                      schedules: tuple[str, ...] | None = None) -> list[Layout]:
    """Every layout of `world` ranks with dp*ep*M*m = B that config.validate accepts; when pp > 1 each of
    `schedules` (default gpipe, 1f1b, zb1, and interleaved when cfg.parallel.virtual_stages > 1: V is the config's);
    each of the `zeros` levels that it accepts there (zero > 0 needs dp*ep > 1; zero 3 not with interleaved/zb1)."""
    B = global_batch or cfg.layout_batch
    if schedules is None:
        schedules = ("gpipe", "1f1b", "zb1") + (("interleaved",) if cfg.parallel.virtual_stages > 1 else ())
    out = []
    for pp in divisors(world):
        for ep in divisors(world // pp):
            dp = world // (pp * ep)
            if B % (dp * ep):
                continue
            b = B // (dp * ep)
            for M in divisors(b):
                for schedule, zero in itertools.product(schedules if pp > 1 else (cfg.parallel.schedule,), zeros):
                    layout = Layout(dp, pp, ep, schedule, M, b // M, zero)
                    try:
                        validate(layout_config(cfg, layout), world_size=world)
                    except ConfigError:
                        # ep does not divide the experts, pp > layers, torch_ddp with pp/ep, zero at dp*ep=1...
                        continue
                    out.append(layout)
    return out


def plan(cfg: Config, world: int, hardware: str | Hardware | None = None,
         opts: PlanOptions | None = None) -> list[Prediction]:
    """Every valid layout of `world`, best first: fitting ones by tokens/s, then less memory."""
    opts = opts or PlanOptions()
    # an unmeasured CPU host is planned at its own bf16/fp32 GEMM ratio when the plan is for bf16
    hw = detect_hardware(hardware, dtype="bf16" if (opts.precision or cfg.train.dtype).startswith("bf16") else "fp32")
    if opts.nodes and world % opts.nodes:
        raise ConfigError(f"--ranks {world} must be a multiple of --nodes {opts.nodes}")
    shape = ModelShape.from_config(cfg, **opts.shape_extra)
    zeros = (0, 1, 2, 3) if opts.zero is None and not opts.zero1 else (1 if opts.zero is None else opts.zero,)
    node = opts.link_node_size or (world // opts.nodes if opts.nodes else min(world, hw.devices_per_node))
    def dp_pp_ep_tp(c: Config, n: int) -> list[Layout]:  # the layouts of n ranks at cp 1 (TP's search among them)
        return tp_plan.enumerate_tp(c, n, node, lambda c1, n1: enumerate_layouts(c1, n1, opts.global_batch, zeros),
                                    opts.tp)

    layouts = [lay for lay in cp_plan.enumerate_cp(cfg, world, dp_pp_ep_tp, opts.cp)
               if not opts.micro_batch or lay.micro_batch == opts.micro_batch]
    preds = [predict(cfg, lay, hw, opts, shape) for lay in layouts]
    preds.sort(key=lambda p: (not p.fits, -p.tokens_per_sec, p.peak_mem))
    if preds and preds[0].fits:  # the lowest zero level close to the fastest goes first (sharding costs traffic)
        near = [p for p in preds if p.fits and p.tokens_per_sec >= (1 - ZERO_SLACK) * preds[0].tokens_per_sec]
        # the fewest CP ranks first (the ring's block kernels and its exposed last hop are priced at the whole
        # layer's efficiency, so a near-tie is not a reason to split the sequence), then the lowest zero level;
        # min keeps the fastest of them (the list is sorted)
        pick = min(near, key=lambda p: (p.layout.cp, p.layout.zero))
        preds.remove(pick)
        preds.insert(0, pick)
    return preds


def recommend(cfg: Config, world: int, hardware: str | Hardware | None = None,
              opts: PlanOptions | None = None) -> tuple[int, int, int, str, int, int, int]:
    """(dp, pp, ep, schedule, microbatches, micro_batch, zero) of the fastest layout that fits memory, at the
    lowest zero level within ZERO_SLACK of it (its tp and cp: `best_layout`)."""
    return best_layout(cfg, world, hardware, opts).as_tuple()


def best_layout(cfg: Config, world: int, hardware: str | Hardware | None = None,
                opts: PlanOptions | None = None) -> Layout:
    """The Layout `recommend` describes, its TP degree included."""
    preds = plan(cfg, world, hardware, opts)
    if not preds:
        B = (opts and opts.global_batch) or cfg.layout_batch
        raise ConfigError(f"no layout of {world} ranks keeps global batch {B} with "
                          f"{cfg.model.num_experts} experts and {cfg.model.n_layers} layers "
                          f"(change --parallel.microbatches/--train.micro_batch or the world size)")
    if not preds[0].fits:
        p = min(preds, key=lambda q: q.peak_mem)
        # fmt_bytes: a small cap (a test's, a tiny model's) would read "0.0 GiB > 0.0 GiB" in GiB
        raise ConfigError(f"no layout of {world} ranks fits memory: the smallest needs {fmt_bytes(p.peak_mem)} "
                          f"per rank > {fmt_bytes(p.mem_limit)} ({p.layout.short()}); use more ranks, "
                          f"--train.activation_checkpointing true or a smaller --train.micro_batch")
    return preds[0].layout


def reason(preds: list[Prediction]) -> str:
    """One line: why the first prediction is the recommendation."""
    best = preds[0]
    if not best.fits:
        return "nothing fits memory; the table is ranked by speed anyway"
    line = (f"fastest layout that fits: {best.tokens_per_sec:,.0f} tok/s, {best.peak_mem / GiB:.2f} of "
            f"{best.mem_limit / GiB:.1f} GiB per rank, dominant cost {best.dominant}")
    faster_oom = [p for p in preds if not p.fits and p.tokens_per_sec > best.tokens_per_sec]
    same = lambda a, b: dataclasses.replace(a, schedule="", zero=0) == dataclasses.replace(b, schedule="", zero=0)
    # not its other schedule or zero level
    nxt = next((p for p in preds[1:] if p.fits and not same(p.layout, best.layout)), None)
    if nxt:
        d = 100 * (1 - nxt.tokens_per_sec / best.tokens_per_sec)
        line += (f"; next {nxt.layout.short()} is {d:.0f}% slower ({nxt.dominant})" if d >= 0 else
                 f"; {nxt.layout.short()} is {-d:.0f}% faster, within the {100 * ZERO_SLACK:.0f}% a lower CP degree "
                 f"or zero level is preferred by")
    if faster_oom:
        line += f"; {faster_oom[0].layout.short()} would be faster but needs {faster_oom[0].peak_mem / GiB:.1f} GiB"
    if best.layout.zero:
        lower = [p for p in preds if p.layout.zero < best.layout.zero]
        fit = [p for p in lower if p.fits]
        if not fit and lower:
            p = min(lower, key=lambda q: q.peak_mem)
            line += (f"; zero {best.layout.zero} needed to fit: the smallest below it ({p.layout.short()}) needs "
                     f"{p.peak_mem / GiB:.1f} GiB")
        elif fit:
            line += (f"; {100 * (best.tokens_per_sec / fit[0].tokens_per_sec - 1):.0f}% faster than zero "
                     f"{fit[0].layout.zero} ({fit[0].layout.short()})")
    return line


def format_table(preds: list[Prediction], top: int) -> str:
    lines = ["| # | dp | pp | ep | tp | cp | schedule | M | m | zero | tokens/s | step (ms) | mem/rank (GiB) | fits | "
             "dominant cost |", "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for i, p in enumerate(preds[:top], 1):
        L = p.layout
        lines.append(f"| {i} | {L.dp} | {L.pp} | {L.ep} | {L.tp} | {L.cp} | {L.schedule if L.pp > 1 else '-'} | "
                     f"{L.microbatches} | {L.micro_batch} | {L.zero} | {p.tokens_per_sec:,.0f} | "
                     f"{1e3 * p.step_time_s:,.1f} | "
                     f"{p.peak_mem / GiB:.2f} | {'yes' if p.fits else 'NO'} | {p.dominant} |")
    return "\n".join(lines)
