"""Search: every valid layout of a world size, predicted and ranked, the recommendation first (table.py prints them).

A layout (dp, pp, ep, schedule, M, m, zero; tp and cp: plan/tp.py, plan/cp.py) of world N keeps the global batch
B = dp*ep*M*m and passes `config.validate` (docs/planner.md §1), asked once per candidate. Fitting layouts rank
first, then by tokens/s, then by memory; the
recommendation is the lowest CP degree, then zero level, within ZERO_SLACK of the fastest fitting layout, so a
split sequence and sharded DP are chosen only when memory binds (or they are clearly faster).
"""

from __future__ import annotations

import dataclasses
import itertools

from ..config.config import Config, ConfigError, validate
from ..config.hardware import Hardware, detect_hardware, fmt_bytes
from . import cp as cp_plan, tp as tp_plan
from .cost import PlanOptions, Prediction, predict_zero_levels
from .shape import Layout, ModelShape, layout_config


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


ZERO_SLACK = 0.03  # a CP or sharded-DP layout must beat the best with less of it by more than this to be recommended


def layout_candidates(cfg: Config, world: int, global_batch: int = 0, zeros: tuple[int, ...] = (0,),
                      schedules: tuple[str, ...] | None = None) -> list[Layout]:
    """Every (dp, pp, ep, schedule, M, m, zero) of `world` ranks with dp*ep*M*m = B, before the runtime's rules; when
    pp > 1 each of `schedules` (default gpipe, 1f1b, zb1, and interleaved when cfg.parallel.virtual_stages > 1: V is
    the config's), each of the `zeros` levels."""
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
                    out.append(Layout(dp, pp, ep, schedule, M, b // M, zero))
    return out


def refusal(cfg: Config, layout: Layout) -> str | None:
    """Why `layout` cannot run this model (None: it can): config.validate at the layout's world (ep does not divide
    the experts, pp > layers, torch_ddp with pp/ep, zero at dp*ep=1, heads over tp, 2*cp over the sequence ...)."""
    try:
        validate(layout_config(cfg, layout), world_size=layout.world)
    except ConfigError as e:
        return str(e)
    return None


def enumerate_layouts(cfg: Config, world: int, global_batch: int = 0, zeros: tuple[int, ...] = (0,),
                      schedules: tuple[str, ...] | None = None) -> list[Layout]:
    """Every layout of `world` ranks (tp = cp = 1) with dp*ep*M*m = B that config.validate accepts
    (`layout_candidates`; zero > 0 needs dp*ep > 1, zero 3 not with interleaved/zb1, ...)."""
    return [lay for lay in layout_candidates(cfg, world, global_batch, zeros, schedules) if refusal(cfg, lay) is None]


def search_layouts(cfg: Config, world: int, node: int, opts: PlanOptions, zeros: tuple[int, ...]) -> list[Layout]:
    """The layouts `plan` predicts: for each CP degree that splits the sequence (plan/cp.py) and each TP degree
    that divides a node of `node` ranks (plan/tp.py; `opts.cp`, `opts.tp`: that one), the candidates of the
    remaining world at `opts.micro_batch` (0: every m), each validated once, at its own tp and cp."""
    out = []
    for cp in [opts.cp] if opts.cp else cp_plan.degrees(world, cfg.train.seq_len):
        if world % cp:
            continue
        n = world // cp
        for tp in [opts.tp] if opts.tp else tp_plan.degrees(n, node):
            if n % tp or node % tp:  # a TP group stays inside one node
                continue
            for lay in layout_candidates(cfg, n // tp, opts.global_batch, zeros):
                lay = dataclasses.replace(lay, tp=tp, cp=cp)
                if (not opts.micro_batch or lay.micro_batch == opts.micro_batch) and refusal(cfg, lay) is None:
                    out.append(lay)
    return out


def plan(cfg: Config, world: int, hardware: str | Hardware | None = None,
         opts: PlanOptions | None = None) -> list[Prediction]:
    """Every valid layout of `world`, the recommendation first (`ZERO_SLACK`), then the fitting ones by tokens/s,
    then the rest; table.layout_rows makes the table of them."""
    opts = opts or PlanOptions()
    # an unmeasured CPU host is planned at its own bf16/fp32 GEMM ratio when the plan is for bf16
    hw = detect_hardware(hardware, dtype="bf16" if (opts.precision or cfg.train.dtype).startswith("bf16") else "fp32")
    if opts.nodes and world % opts.nodes:
        raise ConfigError(f"--ranks {world} must be a multiple of --nodes {opts.nodes}")
    shape = ModelShape.from_config(cfg, **opts.shape_extra)
    zeros = (0, 1, 2, 3) if opts.zero is None and not opts.zero1 else (1 if opts.zero is None else opts.zero,)
    node = opts.link_node_size or (world // opts.nodes if opts.nodes else min(world, hw.devices_per_node))
    # consecutive layouts that differ only in their zero level share their context (cost.predict_zero_levels)
    preds = [p for _, same in itertools.groupby(search_layouts(cfg, world, node, opts, zeros),
                                                key=lambda lay: dataclasses.replace(lay, zero=0))
             for p in predict_zero_levels(cfg, list(same), hw, opts, shape)]
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
