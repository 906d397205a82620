"""Calibration: score the planner against measured layouts (`calibrate`) and fit a hardware profile's free
constants to them (`fit_profile`, `nanotitan plan --calibrate`). Method and results: docs/planner.md §5,
docs/calibration.md.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import statistics
from pathlib import Path

from ...config.config import Config
from ...config.hardware import Hardware, detect_hardware, get_hardware
from ..cost import PlanOptions, predict
from ..shape import Layout, ModelShape, layout_config


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / den if den else float("nan")


def calibrate(measured_rows: list[dict], cfg: Config, hardware: str | Hardware | None = None,
              opts: PlanOptions | None = None) -> dict:
    """Predicted vs measured step time and peak memory for each measured layout.

    A row has dp, pp, ep, schedule, M (or microbatches), m (or micro_batch), step_time_s and
    peak_mem_bytes (one number = the max over ranks, or a list indexed by global rank).
    Returns {"rows": [...], "median_abs_err_step", "median_abs_err_mem", "spearman_rho",
    "median_time_ratio"}; the last (measured / predicted step time) is the factor to fold into the
    profile's compute_efficiency when the machine runs uniformly slower or faster than its profile.
    """
    hw = detect_hardware(hardware)
    opts = opts or PlanOptions()
    rows = []
    for r in measured_rows:
        lay = layout_of(r, cfg)
        pred = predict(layout_config(cfg, lay), lay, hw, opts)
        mem = r["peak_mem_bytes"]
        if isinstance(mem, (list, tuple)):  # per global rank: compare each with its stage's prediction
            pred_mem = [pred.mem_by_stage[(g // lay.ep) % lay.pp] for g in range(len(mem))]
            mem_err = statistics.median(abs(p / x - 1) for p, x in zip(pred_mem, mem))
            meas_mem, pred_peak = max(mem), max(pred_mem)
        else:
            meas_mem, pred_peak = float(mem), pred.peak_mem
            mem_err = abs(pred_peak / meas_mem - 1)
        rows.append(dict(layout=lay.short(), pred_step_s=pred.step_time_s, meas_step_s=float(r["step_time_s"]),
                         step_err=pred.step_time_s / float(r["step_time_s"]) - 1, pred_mem=pred_peak,
                         meas_mem=meas_mem, mem_err=mem_err, dominant=pred.dominant))
    return dict(rows=rows,
                median_abs_err_step=statistics.median(abs(x["step_err"]) for x in rows) if rows else float("nan"),
                median_abs_err_mem=statistics.median(abs(x["mem_err"]) for x in rows) if rows else float("nan"),
                spearman_rho=spearman([x["pred_step_s"] for x in rows], [x["meas_step_s"] for x in rows])
                if len(rows) > 1 else float("nan"),
                median_time_ratio=statistics.median(x["meas_step_s"] / x["pred_step_s"] for x in rows)
                if rows else float("nan"))


def layout_of(r: dict, cfg: Config) -> Layout:
    sched = r.get("schedule", cfg.parallel.schedule)
    return Layout(int(r["dp"]), int(r["pp"]), int(r["ep"]), cfg.parallel.schedule if sched in ("-", "") else sched,
                  int(r.get("M", r.get("microbatches", 1))), int(r.get("m", r.get("micro_batch", 1))))


def nelder_mead(f, x0: list[float], step: float = 0.5, iters: int = 400, xtol: float = 1e-6) -> list[float]:
    """Minimise f over R^n (deterministic Nelder-Mead; n is small: the profile's free time constants). Stops when
    the values agree to 1e-12 or the simplex is within `xtol` of its best point in every coordinate (the fits run
    on the constants' logs: 1e-6 is a relative 1e-6 on each)."""
    n = len(x0)
    pts = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    vals = [f(x) for x in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < 1e-12 or max(abs(a - b) for p in pts[1:] for a, b in zip(p, pts[0])) < xtol:
            break
        c = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        towards = lambda a: [cj + a * (w - cj) for cj, w in zip(c, pts[-1])]
        r = towards(-1.0)
        fr = f(r)
        if fr < vals[0]:
            e = towards(-2.0)
            fe = f(e)
            pts[-1], vals[-1] = (e, fe) if fe < fr else (r, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = r, fr
        else:
            k = towards(0.5)
            fk = f(k)
            if fk < vals[-1]:
                pts[-1], vals[-1] = k, fk
            else:  # shrink towards the best point
                pts = [pts[0]] + [[a + 0.5 * (b - a) for a, b in zip(pts[0], q)] for q in pts[1:]]
                vals = [vals[0]] + [f(q) for q in pts[1:]]
    return pts[min(range(n + 1), key=vals.__getitem__)]


# The time model's free constants on a CPU+gloo machine, and where a fit starts when the profile has 0.
FIT_TIME_FIELDS = {"compute_efficiency": 0.5, "a2a_call_s": 1e-4, "p2p_call_s": 1e-4, "step_overhead_s": 1e-3}


def fit_constants(hw: Hardware, fields: dict[str, float], measured_s: list[float], step_of) -> Hardware:
    """`hw` with the constants `fields` names (all positive; a 0 in `hw` starts from the field's value) fitted to
    `measured_s`: Nelder-Mead on their logs minimising the sum over rows i of log(step_of(h, i) / measured_s[i])^2,
    so every row weighs by its relative error."""
    x0 = [math.log(getattr(hw, k) or v) for k, v in fields.items()]

    def with_x(x):
        return dataclasses.replace(hw, **{k: math.exp(v) for k, v in zip(fields, x)})

    def loss(x):
        h = with_x(x)
        return sum(math.log(step_of(h, i) / y) ** 2 for i, y in enumerate(measured_s))

    return with_x(nelder_mead(loss, x0)) if fields else hw


def fit_profile(measured_rows: list[dict], cfg: Config, hardware: str | Hardware,
                opts: PlanOptions | None = None, fields: dict[str, float] | None = None) -> Hardware:
    """The profile with its free time constants fitted to measured step times, and its per-rank memory
    reserve fitted to measured peak memory (rows as `calibrate` takes them).

    Time: minimise the sum over rows of log(predicted / measured)^2 over the log of each constant in
    `fields` (all positive), so every row weighs by its relative error. Memory: the reserve becomes the
    median over ranks of (measured peak - predicted tensor bytes): what a process holds besides the model's
    tensors (interpreter, torch, gloo, checkpoint imports, data, allocator slack)."""
    hw = get_hardware(hardware)
    opts = opts or PlanOptions()
    fields = FIT_TIME_FIELDS if fields is None else fields
    lays = [layout_of(r, cfg) for r in measured_rows]
    cfgs = [layout_config(cfg, lay) for lay in lays]
    shape = ModelShape.from_config(cfg, **opts.shape_extra)
    meas = [float(r["step_time_s"]) for r in measured_rows]
    hw = fit_constants(hw, fields, meas, lambda h, i: predict(cfgs[i], lays[i], h, opts, shape).step_time_s)
    extra = []
    for r, c, lay in zip(measured_rows, cfgs, lays):
        pred = predict(c, lay, hw, opts, shape)
        mem = r["peak_mem_bytes"]
        if isinstance(mem, (list, tuple)):  # per global rank: its stage's prediction
            pairs = [(x, pred.mem_by_stage[(g // lay.ep) % lay.pp]) for g, x in enumerate(mem)]
        else:  # the max over ranks: the heaviest stage
            pairs = [(mem, pred.peak_mem)]
        extra += [float(x) - (t - hw.mem_reserved_bytes) for x, t in pairs]
    fitted = ", ".join(f"{k} {getattr(hw, k):.3g}" for k in fields)
    return dataclasses.replace(hw, mem_reserved_bytes=statistics.median(extra), name=f"{hw.name}-calibrated",
                               source=f"{hw.source}; calibrated on {len(measured_rows)} measured layouts "
                                      f"({fitted}, reserve {statistics.median(extra) / 2**20:.0f} MiB)")


def calibration_rows(path: str) -> list[dict]:
    """The rows of a `nanotitan bench layouts` JSON, with peak memory per global rank as `calibrate` takes it."""
    data = json.loads(Path(path).read_text())
    return [dict(r, peak_mem_bytes=r.get("peak_mem_per_rank", r.get("peak_mem_bytes", r.get("peak_mem_max"))))
            for r in data["rows"]]


def peak_tensor_check(measured_rows: list[dict], cfg: Config, hardware: str | Hardware | None = None,
                      opts: PlanOptions | None = None) -> list[dict]:
    """The planner's per-rank peak of live tensor bytes (its memory peak less the profile's reserve) against the
    measured step high-water mark (`peak_tensor_per_rank` of a `nanotitan bench layouts` row: summary.json's
    `peak_tensor_bytes`, memory.PeakTensorBytes), both the max over ranks. `pred_step` is the step's peak,
    `pred` the planner's peak with the checkpoint-save transient (what `fits` checks), less the reserve."""
    hw = detect_hardware(hardware)
    out = []
    for r in measured_rows:
        meas = r.get("peak_tensor_per_rank")
        if not meas or None in meas:
            continue
        lay = layout_of(r, cfg)
        pred = predict(_metered(layout_config(cfg, lay), r), lay, hw, opts or PlanOptions())
        step = [sum(p.values()) - p["reserved"] for p in pred.mem_parts_by_stage]
        peak = _tensor_peaks(pred)
        save = [c - p["reserved"] for c, p in zip(pred.ckpt_by_stage, pred.mem_parts_by_stage)]
        out.append(dict(layout=lay.short(), meas=max(meas), pred_step=max(step), pred_save=max(save), pred=max(peak),
                        err=max(peak) / max(meas) - 1))
    return out


def _tensor_peaks(pred) -> list[float]:
    """Each stage's predicted peak without the profile's reserve (not a tensor): what a step's meter measures."""
    return [m - p["reserved"] for m, p in zip(pred.mem_by_stage, pred.mem_parts_by_stage)]


def _metered(cfg: Config, row: dict) -> Config:
    """cfg with train.steps = the steps whose peak the row measured (its `metered_steps`; older rows: the
    config's steps): the busiest EP rank's expected peak is the highest of that many steps' routing draws."""
    if row.get("metered_steps"):
        cfg.train.steps = int(row["metered_steps"])
    return cfg


def fit_expert_skew(measured_rows: list[dict], cfg: Config, hardware: str | Hardware | None = None,
                    opts: PlanOptions | None = None) -> tuple[float, list[float]]:
    """The routing skew (PlanOptions.expert_skew) that makes the planner's peak equal each EP row's measured
    step high-water mark (`peak_tensor_per_rank`), found by bisection (the peak grows with the skew); returns
    (median over the EP rows, each row's). Rows the balanced router already over-predicts give 0."""
    hw = detect_hardware(hardware)
    opts = opts or PlanOptions()
    fits = []
    for r in measured_rows:
        lay = layout_of(r, cfg)
        if lay.ep == 1 or not r.get("peak_tensor_per_rank") or None in r["peak_tensor_per_rank"]:
            continue
        c, want = _metered(layout_config(cfg, lay), r), max(r["peak_tensor_per_rank"])

        def peak(skew: float) -> float:
            pred = predict(c, lay, hw, dataclasses.replace(opts, expert_skew=skew))
            return max(_tensor_peaks(pred))

        lo, hi = 0.0, 4.0
        if peak(lo) >= want:
            fits.append(0.0)
            continue
        for _ in range(30):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if peak(mid) < want else (lo, mid)
        fits.append((lo + hi) / 2)
    return (statistics.median(fits) if fits else float("nan")), fits


def format_peak_check(rows: list[dict]) -> str:
    lines = ["| layout | measured step peak (MiB) | predicted step peak (MiB) | predicted save transient (MiB) | "
             "predicted peak incl. save (MiB) | error |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['meas'] / 2**20:.1f} | {r['pred_step'] / 2**20:.1f} | "
                     f"{r['pred_save'] / 2**20:.1f} | {r['pred'] / 2**20:.1f} | {100 * r['err']:+.1f}% |")
    if rows:
        worst = max(rows, key=lambda r: abs(r["err"]))
        lines.append(f"\nmax |error| {100 * abs(worst['err']):.1f}% ({worst['layout']}), median "
                     f"{100 * statistics.median(abs(r['err']) for r in rows):.1f}% over {len(rows)} layouts")
    return "\n".join(lines)


def format_calibration(result: dict) -> str:
    lines = ["| layout | predicted step (ms) | measured step (ms) | error | predicted mem (MiB) | "
             "measured mem (MiB) | mem error | predicted dominant |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['layout']} | {1e3 * r['pred_step_s']:.1f} | {1e3 * r['meas_step_s']:.1f} | "
                     f"{100 * r['step_err']:+.0f}% | {r['pred_mem'] / 2**20:.0f} | {r['meas_mem'] / 2**20:.0f} | "
                     f"{100 * r['mem_err']:.0f}% | {r['dominant']} |")
    lines.append(f"\nmedian |error|: step {100 * result['median_abs_err_step']:.1f}%, memory "
                 f"{100 * result['median_abs_err_mem']:.1f}%; Spearman rho (step time) {result['spearman_rho']:.2f}; "
                 f"measured/predicted step time {result['median_time_ratio']:.2f}")
    return "\n".join(lines)


def emulated_predictions(rows: list[dict], cfg: Config, links, hardware: str) -> dict:
    """The planner's step time for each measured row on the emulated cluster, uncalibrated: this CPU's profile for
    compute (its time-shared cores included), the emulated links for communication, groups crossing the emulated
    nodes, and link time as waiting rather than CPU work (PlanOptions.links_idle). `calibrate`'s result.
    links: the emulated network (parallel/comm/emulate.LinkModel)."""
    hw = links.dilated(detect_hardware(None if hardware == "auto" else hardware))
    measured = [dict(r, peak_mem_bytes=r["peak_mem_per_rank"]) for r in rows]
    return calibrate(measured, cfg, hw, PlanOptions(link_node_size=links.node_size, links_idle=True))


def overlap_prediction(cfg, ep: int, M: int, m: int, mode: str, links, hardware: str = "cpu-gloo", pp: int = 1,
                       schedule: str = "1f1b") -> tuple[float, float]:
    """(step s, exposed EP s per step) the planner predicts for the run (links: the emulated network or None), with
    `hardware` pricing compute (uncalibrated on these runs, as `bench layouts`)."""
    cfg = copy.deepcopy(cfg)  # the caller's config stays as it is
    chunked = mode not in ("off", "lanes")
    cfg.parallel.ep_overlap, cfg.parallel.ep_chunks = chunked, int(mode.split()[0]) if chunked else 2
    cfg.parallel.ep_overlap_microbatches = mode == "lanes"
    hw = detect_hardware(None if hardware == "auto" else hardware)
    opts = PlanOptions()
    if links is not None:
        hw = links.dilated(hw)
        opts = PlanOptions(link_node_size=links.node_size, links_idle=True)
    p = predict(cfg, Layout(1, pp, ep, schedule, M, m), hw, opts)
    return p.step_time_s, p.costs["ep_a2a"]
