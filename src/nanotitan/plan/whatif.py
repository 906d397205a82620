"""`nanotitan plan --what-if`: the question asked before renting a cluster, answered in one report (docs/planner.md
§8): does the config fit (the dry run's bytes of the best layout, the worst rank named), the best layouts with
tokens/s, step time and their 80% intervals (plan/fit/interval.py), what dominates the step and what to change; the same
as JSON (`whatif_json`).
"""

from __future__ import annotations

import dataclasses
import math

from ..config.config import Config, ConfigError
from ..config.hardware import GiB, Hardware
from ..parallel.dims import ParallelDims
from . import docs as docs_plan
from .cost import EXPERT_SKEW, PlanOptions, Prediction, predict
from .fit.interval import Sigmas, mem_interval, step_interval
from .advice import advise, format_advice
from .search import plan
from .table import SORTED_BY, Row, batch_changes, layout_rows, no_layout
from .shape import ModelShape, layout_config, trainer_precision
from .skew import rebalance_bytes, replica_sync_bytes
from . import dispatch as dispatch_plan

def _row(p: Prediction, sig: Sigmas, network: bool, row: Row | None = None) -> dict:
    """One layout of the report; with its table row: its place (`rank`), whether it is recommended, and how many
    (schedule, zero) variants it folds (`others`)."""
    lo, hi = step_interval(p, sig, network)
    mlo, mhi = mem_interval(p, sig)
    L = p.layout
    return dict(layout=L.short(), dp=L.dp, pp=L.pp, ep=L.ep, tp=L.tp, cp=L.cp, schedule=L.schedule,
                microbatches=L.microbatches,
                micro_batch=L.micro_batch, zero=L.zero, fits=p.fits, tokens_per_sec=p.tokens_per_sec,
                tokens_per_sec_interval=[p.tokens_per_sec * p.step_time_s / hi, p.tokens_per_sec * p.step_time_s / lo],
                step_time_s=p.step_time_s, step_time_interval_s=[lo, hi], peak_mem_bytes=p.peak_mem,
                peak_mem_interval_bytes=[mlo, mhi], mem_limit_bytes=p.mem_limit, dominant=p.dominant,
                costs_s=dict(p.costs), expert_time_factor=p.expert_time_factor,
                **(dict(rank=row.rank, recommended=row.recommended, others=len(row.others)) if row else {}))


def what_if(cfg: Config, world: int, hw: Hardware, opts: PlanOptions, sig: Sigmas, top: int = 5,
            dry_run: bool = True, log=None) -> dict:
    """The what-if report as a dict (the JSON): `fits`, `worst_rank` (the dry run of the best layout: its heaviest
    rank, its bytes, the planner's for the same rank), `layouts` (the best `top`, each with its intervals),
    `dominant` and `advice` (the best layout's causes of step time, largest first, and what to change), `skew` (what
    the routing skew costs it). With the dry run, options the code does not build fail first (`buildable`)."""
    if dry_run:
        buildable(cfg, opts)
    preds = plan(cfg, world, hw, opts)
    if not preds:
        return dict(world=world, hardware=hw.name, fits=False, layouts=[], worst_rank=None, dominant=[], advice=[],
                    error=no_layout(world, opts.global_batch or cfg.layout_batch, opts.micro_batch))
    best = preds[0]
    network = not hw.cores_per_node or opts.links_idle  # collectives on a network (else gloo: host work)
    rows = layout_rows(preds)
    shown = rows[:top] + [r for r in rows[top:] if r.recommended]
    out = dict(world=world, hardware=hw.name, nodes=opts.nodes, layouts_considered=len(rows),
               variants_considered=len(preds), layouts_fitting=sum(r.pred.fits for r in rows), fits=best.fits,
               best=_row(best, sig, network, next(r for r in rows if r.pred is best) if best.fits else None),
               layouts=[_row(r.pred, sig, network, r) for r in shown], sorted_by=SORTED_BY,
               interval_source=sig.source, micro_batch=opts.micro_batch or None,
               batch_changes=batch_changes(cfg, best.layout, opts))
    shares = sorted(((k, v / best.step_time_s) for k, v in best.costs.items() if v > 0), key=lambda kv: -kv[1])
    out["dominant"] = [dict(cause=k, share=s) for k, s in shares]
    out["advice_detail"] = advise(cfg, opts, best, hw, shares)
    out["advice"] = [format_advice(a) for a in out["advice_detail"]]
    if best.layout.ep > 1 and best.expert_time_factor != 1.0:  # the same layout under a balanced router
        flat = predict(layout_config(cfg, best.layout), best.layout, hw, dataclasses.replace(opts, expert_skew=0.0))
        out["skew"] = dict(expert_time_factor=best.expert_time_factor,
                           step_time_balanced_s=flat.step_time_s, cost=best.step_time_s / flat.step_time_s - 1)
    if best.layout.moe_ep > 1 and cfg.parallel.expert_placement == "static":
        out["placement"] = placement_saving(cfg, best, hw, opts)
    if best.layout.moe_ep > 1:
        out["dispatch"] = dispatch_report(cfg, best, hw, opts)
    if best.layout.cp > 1:  # why the sequence is split: the best layout that keeps it whole
        whole = next((p for p in preds if p.layout.cp == 1), None)
        out["without_cp"] = None if whole is None else dict(
            layout=whole.layout.short(), fits=whole.fits, tokens_per_sec=whole.tokens_per_sec,
            peak_mem_bytes=whole.peak_mem, smallest_peak_bytes=min(p.peak_mem for p in preds if p.layout.cp == 1))
    if opts.doc_len_mean or opts.doc_data:
        out["documents"] = documents_report(cfg, best, hw, opts)
    if cfg.train.fp8 != "off":  # the same layout without FP8: what the recipe buys
        plain = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fp8="off"))
        bf16 = predict(layout_config(plain, best.layout), best.layout, hw, opts)
        out["fp8"] = dict(recipe=cfg.train.fp8, step_time_s=best.step_time_s, step_time_off_s=bf16.step_time_s,
                          speedup=bf16.step_time_s / best.step_time_s)
    faster = next((p for p in preds if not p.fits and p.tokens_per_sec > best.tokens_per_sec), None)
    if faster is not None:
        out["faster_if_memory"] = dict(layout=faster.layout.short(), tokens_per_sec=faster.tokens_per_sec,
                                       peak_mem_bytes=faster.peak_mem, mem_limit_bytes=faster.mem_limit)
    out["worst_rank"] = _dry_run_worst(cfg, best, world, hw, opts, log) if dry_run else None
    if out["worst_rank"] is not None:
        out["fits"] = out["worst_rank"]["fits"]
    return out


def placement_saving(cfg: Config, best: Prediction, hw: Hardware, opts: PlanOptions) -> dict:
    """The best layout again under parallel.expert_placement=balanced (plan/skew.py: the placed load), with what the
    placement costs: each step the replicated experts' gradient sum (skew.replica_sync_bytes, two all-to-alls over
    EP; on the node's link, where the copies sit when a node holds R EP ranks), and its moves once per
    parallel.rebalance_every steps (skew.rebalance_bytes; the inter-node link when the EP group spans nodes)."""
    lay = best.layout
    placed_par = dataclasses.replace(cfg.parallel, expert_placement="balanced",
                                     expert_replicas=max(2, cfg.parallel.expert_replicas))
    placed_cfg = dataclasses.replace(cfg, parallel=placed_par)
    placed = predict(layout_config(placed_cfg, lay), lay, hw, opts)
    shape = ModelShape.from_config(cfg)
    link = hw.inter if lay.moe_ep > hw.devices_per_node else hw.intra
    move_s = rebalance_bytes(placed_cfg, lay, shape) / link.a2a_bw
    near = hw.intra if hw.devices_per_node >= placed_cfg.parallel.expert_replicas else hw.inter
    sync_s = replica_sync_bytes(placed_cfg, lay, shape) / near.a2a_bw + 2 * (lay.moe_ep - 1) * link.latency_s
    step = placed.step_time_s + sync_s + move_s / cfg.parallel.rebalance_every
    gain = best.step_time_s - placed.step_time_s - sync_s  # per step, before the moves
    return dict(expert_time_factor=placed.expert_time_factor, step_time_s=step, move_s=move_s, sync_s=sync_s,
                every=cfg.parallel.rebalance_every, saving=1 - step / best.step_time_s,
                saving_unmoved=gain / best.step_time_s, break_even_every=move_s / gain if gain > 0 else None)


def dispatch_report(cfg: Config, best: Prediction, hw: Hardware, opts: PlanOptions) -> dict:
    """The best layout under parallel.ep_dispatch static (at the config's ep_capacity, and at the capacity, of a
    few, whose expected step is least) against dynamic (plan/dispatch.py): the padded payload against dynamic's
    busiest rank's load, the chance a step overflows and its replay's expected seconds, the host reads each makes a
    step at `host_sync_s` each, whether static pays, and the price of a read above which it does."""
    lay, shape = best.layout, ModelShape.from_config(cfg)

    def at(dispatch: str, capacity: float | None = None) -> Prediction:
        par = dataclasses.replace(cfg.parallel, ep_dispatch=dispatch, ep_capacity=capacity or cfg.parallel.ep_capacity)
        return predict(layout_config(dataclasses.replace(cfg, parallel=par), lay), lay, hw, opts)

    cap = cfg.parallel.ep_capacity
    tried = {c: at("static", c) for c in sorted({1.0, 1.25, 1.5, 2.0, float(lay.moe_ep), cap}) if c <= lay.moe_ep}
    dyn, stat = at("dynamic"), tried.get(cap) or at("static")  # (the config's capacity predicted once)
    best_cap = min(tried, key=lambda c: tried[c].step_time_s)
    ac = cfg.train.activation_checkpointing if opts.activation_checkpointing is None else opts.activation_checkpointing
    moe_layers = sum(shape.is_moe(i) for i in range(shape.n_layers)) / lay.pp
    reads = {d: dispatch_plan.host_reads(lay, moe_layers, ac, d) for d in ("dynamic", "static")}
    price = opts.host_sync_s if opts.host_sync_s is not None else (0.0 if hw.cores_per_node
                                                                   else dispatch_plan.HOST_SYNC_S)
    totals = {d: p.step_time_s + reads[d] * price for d, p in (("dynamic", dyn), ("static", stat))}
    saved = reads["dynamic"] - reads["static"]
    skew = EXPERT_SKEW if opts.expert_skew is None else opts.expert_skew
    return dict(capacity=cap, payload=dispatch_plan.static_payload(cfg, lay, shape, cap),
                dynamic_load=dyn.expert_time_factor,
                overflow=dispatch_plan.overflow_probability(cfg, lay, shape, skew, cap),
                replay_s=stat.costs.get("ep_replay", 0.0), step_static_s=stat.step_time_s,
                step_dynamic_s=dyn.step_time_s, reads=reads, host_sync_s=price, total_s=totals,
                pays=totals["static"] < totals["dynamic"],
                break_even_host_sync_s=(stat.step_time_s - dyn.step_time_s) / saved if saved else None,
                best_capacity=best_cap, best_capacity_step_s=tried[best_cap].step_time_s)


def documents_report(cfg: Config, best: Prediction, hw: Hardware, opts: PlanOptions) -> dict:
    """Packed documents (plan/docs.py): their mean length, the attention work left by the document mask (its span
    over the window's), and at CP > 1 the slowest CP rank's share over the mean and the best layout's step under
    each split (parallel.cp_split zigzag and docs)."""
    S, cp, m = cfg.train.seq_len, best.layout.cp, best.layout.micro_batch
    mean = opts.doc_len_mean or docs_plan.mean_length(opts.doc_data)
    work = docs_plan.attention_span(S, 1, "zigzag", opts.doc_len_mean, opts.doc_data) / S
    out = dict(mean_length=mean, micro_batch=m, work_vs_causal=work, cp=cp)
    if cp > 1:
        for split in ("zigzag", "docs"):
            c = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cp_split=split))
            out[split] = dict(skew=docs_plan.attention_span(S, cp, split, opts.doc_len_mean, opts.doc_data, m)
                              / docs_plan.attention_span(S, 1, split, opts.doc_len_mean, opts.doc_data, m),
                              step_time_s=predict(layout_config(c, best.layout), best.layout, hw, opts).step_time_s)
    return out


def buildable(cfg: Config, opts: PlanOptions) -> None:
    """The dry run builds our trainer, so the planner must price what it builds, or the two answer different
    questions: a `--precision` of another stack (bf16-master: bf16 parameters and residual stream) priced the Mixtral
    plan's best layout at 62.4 GiB where the code holds 92.3 (the planner at the trainer's precision: 90.0), and
    shape options (--first-dense ...) describe a model the config does not build. One line each, before planning."""
    own = trainer_precision(cfg.train.dtype)
    if opts.precision and opts.precision != own:
        raise ConfigError(f"--precision {opts.precision}: the what-if's dry run builds our trainer, which runs "
                          f"train.dtype={cfg.train.dtype} ({own}); drop --precision, or add --no-dry-run for the "
                          f"planner alone at {opts.precision}")
    if opts.shape_extra:
        raise ConfigError(f"{', '.join(sorted(opts.shape_extra))}: the what-if's dry run builds the config's model; "
                          "set --model.first_k_dense, --model.dense_ffn_dim or --model.shared_experts instead, or "
                          "add --no-dry-run")


def _dry_run_worst(cfg: Config, best: Prediction, world: int, hw: Hardware, opts: PlanOptions, log=None) -> dict:
    """The best layout's heaviest ranks built by the dry run (plan/dryrun.py: real modules on fake tensors and a fake
    process group): the first rank of the planner's heaviest stage, of the first and of the last stage (at most 3
    builds, not every distinct rank: the what-if answers at 2,048 ranks in a minute); the heaviest of them, and
    whether it fits with the runtime's reserve. The config built is the one the planner priced (layout, checkpointing,
    the stages' layer split balanced on `hw`), at the trainer's precision (`buildable`). Each built rank is set beside
    the planner's tensor peak for its stage at a balanced router (the dry run's routing); the verdict adds the
    planner's routing-skew excess of the busiest EP rank (0 without EP), which a balanced dry run cannot see."""
    import time

    from .dryrun import launch_config, layout_errors, measure_rank  # real modules on fake tensors: only when asked

    t0 = time.perf_counter()
    c = layout_config(cfg, best.layout)
    if opts.activation_checkpointing is not None:  # what the plan assumed (--activation-checkpointing)
        c.train.activation_checkpointing = opts.activation_checkpointing
    c = launch_config(c, world, hw)  # pp_layers auto: the split the planner priced on hw, not this host's
    layout_errors(c, world)
    L = best.layout
    flat = predict(c, L, hw, dataclasses.replace(opts, expert_skew=0.0))  # what the dry run routes
    stages = dict.fromkeys((best.mem_by_stage.index(best.peak_mem), 0, L.pp - 1))
    dims = ParallelDims(L.dp, L.pp, L.ep, tp=L.tp, cp=L.cp)
    built = []
    for s in stages:  # replica 0, EP rank 0, TP rank 0 of stage s
        rb = measure_rank(c, dims.rank_of(0, s, 0, 0), world)
        planned = flat.mem_by_stage[s] - flat.mem_parts_by_stage[s]["reserved"]
        built.append(dict(rank=rb.rank, coords=list(rb.coords), stage=s, peak_bytes=rb.peak_bytes,
                          planned_peak_bytes=planned, gap=rb.peak_bytes / planned - 1,
                          skew_bytes=max(0.0, best.mem_by_stage[s] - flat.mem_by_stage[s])))
        if log:
            log(f"  dry run: stage {s} rank {rb.rank} peak {rb.peak_bytes / GiB:.2f} GiB (planner "
                f"{planned / GiB:.2f}) [{time.perf_counter() - t0:.0f} s]")
    worst = max(built, key=lambda b: b["peak_bytes"] + b["skew_bytes"])
    need = worst["peak_bytes"] + worst["skew_bytes"] + hw.mem_reserved_bytes
    return dict(worst, reserved_bytes=hw.mem_reserved_bytes, limit_bytes=best.mem_limit, fits=need <= best.mem_limit,
                built_ranks=[b["rank"] for b in built], built=built, seconds=time.perf_counter() - t0)


def _fp8_line(k: dict) -> str:
    return (f"  FP8 ({k['recipe']}): the step takes {k['step_time_s']:.3g} s against {k['step_time_off_s']:.3g} s "
            f"with --train.fp8 off on the same layout ({k['speedup']:.2f}x; GEMMs at the FP8 rate with their casts, "
            "the scores, router and head in bf16)")


def dispatch_line(k: dict) -> str:
    """`dispatch_report`'s verdict as one line of the report."""
    ms = lambda s: f"{1e3 * s:.4g} ms"  # noqa: E731
    even = k["break_even_host_sync_s"]
    where = ("" if even is None else f" (break-even: {1e6 * even:.3g} us a read)" if even > 0
             else " (faster even where a read costs nothing)")
    return (f"  EP dispatch: static (--parallel.ep_dispatch static, capacity {k['capacity']:g}) pads every rank's "
            f"payload to {k['payload']:.2f}x the mean (dynamic: the busiest rank {k['dynamic_load']:.2f}x) and "
            f"replays {100 * k['overflow']:.0f}% of steps (+{ms(k['replay_s'])} a step on average): step "
            f"{ms(k['step_static_s'])} against dynamic's {ms(k['step_dynamic_s'])}; dynamic reads the host "
            f"{k['reads']['dynamic']:.0f} times a step, static {k['reads']['static']:.0f}: at "
            f"{1e6 * k['host_sync_s']:.3g} us a read {ms(k['total_s']['static'])} against "
            f"{ms(k['total_s']['dynamic'])}, {'static pays' if k['pays'] else 'dynamic is faster'}{where}; static's "
            f"best capacity here {k['best_capacity']:g} (step {ms(k['best_capacity_step_s'])})")


def format_what_if(r: dict) -> str:
    """The report as text."""
    if not r["layouts"]:
        return f"error: {r['error']}"
    b = r["best"]
    m = f"m = {r['micro_batch']} as configured" if r.get("micro_batch") else "every m"
    lines = [f"What if: {r['world']} x {r['hardware']} ({r['layouts_considered']} layouts of "
             f"{r['variants_considered']} (layout, schedule, zero) variants, {r['layouts_fitting']} fit by the "
             f"planner; {m})"]
    w = r.get("worst_rank")
    if w:
        verdict = "FITS" if w["fits"] else "DOES NOT FIT"
        skew = f" + {w['skew_bytes'] / GiB:.2f} GiB routing skew" if w["skew_bytes"] else ""
        lines.append(f"{verdict}: the dry run of {b['layout']} (ranks {w['built_ranks']} built, {w['seconds']:.0f} s): "
                     f"worst rank {w['rank']} {tuple(w['coords'])} holds {w['peak_bytes'] / GiB:.2f} GiB (planner "
                     f"{w['planned_peak_bytes'] / GiB:.2f}, {100 * w['gap']:+.1f}%){skew} + "
                     f"{w['reserved_bytes'] / GiB:.1f} GiB reserved of {w['limit_bytes'] / GiB:.1f} GiB")
    else:
        lines.append(("FITS" if r["fits"] else "DOES NOT FIT") + f" (planner): {b['peak_mem_bytes'] / GiB:.2f} GiB "
                     f"per rank of {b['mem_limit_bytes'] / GiB:.1f} GiB")
    lines += ["", f"Sorted: {r['sorted_by']}; * = recommended; one row per layout, at its best schedule and zero "
              f"level ('others': the variants folded into it).", "",
              "| # | layout | tokens/s (80% interval) | step s (80% interval) | peak GiB (80%) | fits | dominant | "
              "others |", "|---:|---|---|---|---|---|---|---:|"]
    for x in r["layouts"]:
        t, s, m = x["tokens_per_sec_interval"], x["step_time_interval_s"], x["peak_mem_interval_bytes"]
        lines.append(f"| {x['rank']}{'*' if x['recommended'] else ''} | {x['layout']} | {x['tokens_per_sec']:,.0f} "
                     f"({t[0]:,.0f}-{t[1]:,.0f}) | "
                     f"{x['step_time_s']:.3g} ({s[0]:.3g}-{s[1]:.3g}) | {x['peak_mem_bytes'] / GiB:.1f} "
                     f"({m[0] / GiB:.1f}-{m[1] / GiB:.1f}) | {'yes' if x['fits'] else 'NO'} | {x['dominant']} | "
                     f"{x['others']} |")
    lines += ["", "Step of the best layout by cause: " + ", ".join(f"{d['cause']} {100 * d['share']:.0f}%"
                                                                  for d in r["dominant"])]
    lines += [f"  change: {a}" for a in r["advice"]]
    lines += [f"  the recommendation changes the config's batch: {c}" for c in r.get("batch_changes", [])]
    if "skew" in r:
        k = r["skew"]
        lines.append(f"  routing skew: the busiest EP rank receives {k['expert_time_factor']:.2f}x the mean; "
                     f"{100 * k['cost']:.1f}% of the step over a balanced router")
    if "placement" in r:
        k = r["placement"]
        lines.append(f"  balanced expert placement (--parallel.expert_placement balanced): the busiest EP rank "
                     f"{k['expert_time_factor']:.2f}x the mean ({100 * k['saving_unmoved']:.1f}% off the step, "
                     f"the copies' gradient sum of {1e3 * k['sync_s']:.1f} ms included), "
                     f"moves at most {1e3 * k['move_s']:.0f} ms every {k['every']} steps: {100 * k['saving']:.1f}% "
                     + (f"(pays from --parallel.rebalance_every {math.ceil(k['break_even_every'])})"
                        if k["break_even_every"] else ""))
    lines += [dispatch_line(r["dispatch"])] if "dispatch" in r else []
    if r.get("without_cp"):
        w = r["without_cp"]
        fastest = f"is {w['layout']} at {w['tokens_per_sec']:,.0f} tok/s" if w["fits"] else "fits"
        lines.append(f"  context parallel: {'the fastest' if w['fits'] else 'no'} layout with whole sequences "
                     f"{fastest}; the smallest of them needs {w['smallest_peak_bytes'] / GiB:.1f} GiB per rank")
    if r.get("documents"):
        d = r["documents"]
        lines.append(f"  documents (mean {d['mean_length']:,.0f} tokens): the document mask leaves "
                     f"{100 * d['work_vs_causal']:.0f}% of the window's causal attention work")
        if d["cp"] > 1:
            z, b = d["zigzag"], d["docs"]
            lines.append(f"  CP{d['cp']} over documents (microbatches of {d['micro_batch']} windows): the slowest "
                         f"rank's attention is {z['skew']:.2f}x the mean "
                         f"with zigzag (step {z['step_time_s']:.3g} s), {b['skew']:.2f}x with --parallel.cp_split "
                         f"docs (step {b['step_time_s']:.3g} s)")
    lines += [_fp8_line(r["fp8"])] if "fp8" in r else []
    if "faster_if_memory" in r:
        f = r["faster_if_memory"]
        lines.append(f"  {f['layout']} would run {f['tokens_per_sec']:,.0f} tok/s but needs "
                     f"{f['peak_mem_bytes'] / GiB:.1f} GiB of {f['mem_limit_bytes'] / GiB:.1f}")
    lines.append(f"\nIntervals: {r['interval_source']}")
    return "\n".join(lines)
