"""Are the planner's 80% intervals right? Fit the term sigmas on the calibration, then score layouts measured under
emulated networks: how many measured step times fall inside the predicted interval, and the median error
(docs/planner.md §7).

    python scripts/experiments/plan_intervals.py --runs docs/experiments/plan_intervals_nvlink.json ... \\
        [--noise OLD.json NEW.json] [--config configs/bench.toml]
    python scripts/experiments/plan_intervals.py --measure-skew docs/experiments/skew_check_bw.json --bandwidth-bound
    python scripts/experiments/plan_intervals.py --skew-check docs/experiments/skew_check_bw.json  # the table

Term sigmas (`plan.fit.interval.fit_sigmas`): leave-one-out over `--calibration` (the `bench layouts` rows cpu-gloo is
fitted to; each row predicted by a profile fitted to the others) and the emulator's per-call calibration
(`--emulate-cal`, `nanotitan bench emulate`'s JSON) for the collectives. The composition term (step bias and sigma,
`plan.fit.interval.fit_composition`) is fitted on whole emulated steps and scored by leave-one-layout-out
cross-validation: each (dp, pp, ep) grid's runs, under every topology and microbatch size, are predicted with a
composition fitted to the other grids' runs only. The sigmas file (`--sigmas-out`) holds the fit on all runs.
Each run file is a `nanotitan bench layouts --parallel.emulate ...` JSON: its rows are predicted as `bench layouts`
predicts them (this host's CPU profile for compute, the emulated links dilated), at the routing skew the run recorded
(`ep_recv_max_mean`, plan/skew.py) where it has one, else the default EXPERT_SKEW, and at skew 0 beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

from nanotitan.config.config import load_config
from nanotitan.config.hardware import detect_hardware
from nanotitan.parallel.comm import emulate
from nanotitan.plan import PlanOptions, calibration_rows, layout_config, predict
from nanotitan.plan.fit.calibrate import layout_of
from nanotitan.plan.fit.interval import Z80, fit_composition, fit_sigmas, run_noise, save_sigmas, score, terms_sd
from nanotitan.plan.memory import EXPERT_SKEW
from nanotitan.plan.skew import skew_of_ratio
from nanotitan.resolve import resolve_emulation


def _emulated(config: str, overrides: list[str]):
    """(config, the emulated hardware the planner predicts a run with, link node size) of one run's overrides."""
    cfg = load_config(config, overrides)
    links = emulate.link_model(resolve_emulation(cfg))
    return cfg, links.dilated(detect_hardware(None)), links.node_size


def _predict(cfg, hw, node_size: int, r: dict, skew: float | None = None):
    """(prediction at the row's recorded skew, or `skew`; at skew 0; the skew used) of one measured row."""
    lay = layout_of(r, cfg)
    if skew is None:
        ratio = r.get("ep_recv_max_mean")
        skew = skew_of_ratio(ratio, lay.ep, cfg.model.num_experts) if ratio and lay.ep > 1 else EXPERT_SKEW
    c = layout_config(cfg, lay)
    p, p0 = (predict(c, lay, hw, PlanOptions(link_node_size=node_size, links_idle=True, expert_skew=s))
             for s in (skew, 0.0))
    return p, p0, skew


def score_run(path: str, config: str, sig) -> list[dict]:
    """Each row of one `bench layouts` run file: predicted step (at the recorded skew and at 0), its terms' sd, the
    measured step and waits. The interval comes later (`score`), with a composition term."""
    data = json.loads(Path(path).read_text())
    em = data.get("emulate")
    run_args = em and ["--parallel.emulate", em["profile"], "--parallel.emulate_node_size", str(em["node_size"]),
                       "--parallel.emulate_dilation", repr(em["dilation"])]
    out, seen = [], {}
    for r in data["rows"]:  # a row with its own "overrides" (the skew check's) is predicted under them
        args = tuple(r.get("overrides") or run_args)
        cfg, hw, node = seen[args] = seen.get(args) or _emulated(config, list(args))
        p, p0, skew = _predict(cfg, hw, node, r)
        tag = f" {r['tag']}" if "tag" in r else ""
        out.append(dict(run=Path(path).stem.removeprefix("plan_intervals_").removeprefix("layouts_") + tag,
                        grid=(p.layout.dp, p.layout.pp, p.layout.ep), layout=p.layout.short(),
                        ratio=r.get("ep_recv_max_mean"), skew=skew, pred=p.step_time_s, pred0=p0.step_time_s,
                        sd=terms_sd(p, sig), meas=float(r["step_time_s"]), costs=p.costs,
                        waits={a: r.get(f"{a}_wait_s") for a in ("dp", "ep", "pp")}, p=p))
    return out


# The skew check (docs/planner.md §3 "Routing skew"): EP layouts of 8 ranks under the emulated h100-sxm, no balancing
# (aux_coef 0), dropless and with capacity factor 1.0 (which holds the busiest rank to the mean). Rows that carry
# their own "overrides" (the bandwidth-bound check, skew_check_bw.json) are predicted under those instead.
SKEW_EMULATE = ["--parallel.emulate", "h100-sxm", "--parallel.emulate_node_size", "8",
                "--parallel.emulate_dilation", "0.0006872649146099278", "--model.aux_coef", "0"]
SKEW_RUNS = {"cap1": ["--model.capacity_factor", "1.0"], "skew": []}
SKEW_LAYOUTS = ((2, 1, 4, 2), (4, 1, 2, 2), (1, 2, 4, 4))  # dp, pp, ep, M
# --bandwidth-bound: d 256 at m = 2 on the 100 Gb/s network in nodes of 2, so EP 4's all-to-all crosses the slow link
SKEW_BW = ["--parallel.emulate", "configs/emulate/h100-100g.json", "--parallel.emulate_node_size", "2",
           "--parallel.emulate_dilation", "0.0006872649146099278", "--model.aux_coef", "0",
           "--model.d_model", "256", "--model.ffn_dim", "512"]


def measure_skew(out: str, config: str, steps: int = 14, bandwidth_bound: bool = False) -> None:
    """Each SKEW_LAYOUTS layout dropless and capped, one after the other; rows carry their overrides."""
    from nanotitan.bench.layouts import run_layout
    from nanotitan.observe.runs import summarise

    emu, m, steps = (SKEW_BW, 2, 12) if bandwidth_bound else (SKEW_EMULATE, 1, steps)
    rows = []
    for dp, pp, ep, M in SKEW_LAYOUTS:
        for tag, extra in SKEW_RUNS.items():
            name = f"{'bw_' if bandwidth_bound else ''}{tag}_dp{dp}_pp{pp}_ep{ep}"
            res = run_layout(dp, pp, ep, "1f1b", M, m, steps, Path(out).parent / "runs" / name,
                             [f"--config={config}", *emu, *extra], 1800)
            rows.append({"tag": tag, "dp": dp, "pp": pp, "ep": ep, "schedule": "1f1b" if pp > 1 else "-", "M": M,
                         "m": m, "overrides": emu + extra, **summarise(res, (steps // 3, steps))})
            Path(out).write_text(json.dumps({"rows": rows}, indent=1))


def skew_check(path: str, config: str) -> str:
    """Predicted (at skew 0 and at each run's recorded skew) against measured step and EP wait, as markdown; then,
    per layout, what going dropless adds to a capped run, predicted and measured."""
    lines = ["| routing | layout | recorded busiest/mean | f | predicted step ms (σ 0) | predicted (recorded σ) | "
             "measured step ms | predicted EP ms (σ 0) | predicted EP ms (recorded σ) | measured EP wait ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by_layout: dict[str, dict] = {}
    for r in json.loads(Path(path).read_text())["rows"]:
        cfg, hw, node = _emulated(config, r.get("overrides") or SKEW_EMULATE + SKEW_RUNS[r["tag"]])
        lay = layout_of(r, cfg)
        p, p0, _ = _predict(cfg, hw, node, r, skew_of_ratio(r["ep_recv_max_mean"], lay.ep, cfg.model.num_experts))
        lines.append(f"| {'capacity 1.0' if r['tag'] == 'cap1' else 'dropless'} | {lay.short()} | "
                     f"{r['ep_recv_max_mean']:.2f} | {p.expert_time_factor:.2f} | {1e3 * p0.step_time_s:.0f} | "
                     f"{1e3 * p.step_time_s:.0f} | {1e3 * r['step_time_s']:.0f} | {1e3 * p0.costs['ep_a2a']:.0f} | "
                     f"{1e3 * p.costs['ep_a2a']:.0f} | {1e3 * r['ep_wait_s']:.0f} |")
        by_layout.setdefault(lay.short(), {})[r["tag"]] = (p, r)
    lines += ["", "| layout | dropless / capped step: predicted | measured | dropless − capped EP ms: predicted | "
                  "measured |", "|---|---:|---:|---:|---:|"]
    for name, d in by_layout.items():
        if {"cap1", "skew"} <= d.keys():
            (pc, rc), (ps, rs) = d["cap1"], d["skew"]
            lines.append(f"| {name} | {ps.step_time_s / pc.step_time_s:.3f} | {rs['step_time_s'] / rc['step_time_s']:.3f}"
                         f" | {1e3 * (ps.costs['ep_a2a'] - pc.costs['ep_a2a']):+.0f} | "
                         f"{1e3 * (rs['ep_wait_s'] - rc['ep_wait_s']):+.0f} |")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    lines = ["| run | layout | busiest EP rank / mean (recorded) | σ | predicted ms (σ 0) | predicted ms | "
             "bias-corrected ms | 80% interval ms | measured ms | error | inside |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        lines.append(f"| {r['run']} | {r['layout']} | {ratio} | {r['skew']:.2f} | {1e3 * r['pred0']:.0f} | "
                     f"{1e3 * r['pred']:.0f} | {1e3 * r['mid']:.0f} | {1e3 * r['lo']:.0f}-{1e3 * r['hi']:.0f} | "
                     f"{1e3 * r['meas']:.0f} | {100 * r['err']:+.1f}% | {'yes' if r['inside'] else 'NO'} |")
    inside = sum(r["inside"] for r in rows)
    raw = statistics.median(abs(r["pred"] / r["meas"] - 1) for r in rows)
    lines.append(f"\n{inside} of {len(rows)} measured steps inside the predicted 80% interval "
                 f"({100 * inside / max(len(rows), 1):.0f}%, leave one layout out); median |error| "
                 f"{100 * statistics.median(abs(r['err']) for r in rows):.1f}% bias-corrected, "
                 f"{100 * raw:.1f}% of the model alone")
    for run in dict.fromkeys(r["run"] for r in rows):
        sub = [r for r in rows if r["run"] == run]
        lines.append(f"- {run}: {sum(r['inside'] for r in sub)} of {len(sub)} inside, median |error| "
                     f"{100 * statistics.median(abs(r['err']) for r in sub):.1f}%")
    return "\n".join(lines)


def format_waits(rows: list[dict]) -> str:
    """Per row: measured step less its recorded waits (the rank's own work and what no wait column sees) against
    the predicted host terms, and each wait against its predicted terms (docs/planner.md §7 "Where the step goes")."""
    lines = ["| run | layout | measured step − waits ms | predicted compute+overhead+optimizer+grad norm ms | "
             "DP wait / predicted ms | EP wait / predicted ms | PP wait / predicted p2p+bubble ms |",
             "|---|---|---:|---:|---|---|---|"]
    for r in rows:
        c, w = r["costs"], r["waits"]
        if None in w.values():
            continue
        host = sum(c.get(k, 0.0) for k in ("compute", "overhead", "optimizer", "grad_norm"))
        lines.append(f"| {r['run']} | {r['layout']} | {1e3 * (r['meas'] - sum(w.values())):.0f} | {1e3 * host:.0f} | "
                     f"{1e3 * w['dp']:.0f} / {1e3 * c.get('dp_allreduce', 0):.0f} | {1e3 * w['ep']:.0f} / "
                     f"{1e3 * c.get('ep_a2a', 0):.0f} | {1e3 * w['pp']:.0f} / "
                     f"{1e3 * (c.get('pp_p2p', 0) + c.get('bubble', 0)):.0f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/experiments/plan_intervals.py")
    ap.add_argument("--runs", nargs="+", default=[], help="`bench layouts --parallel.emulate` JSON files")
    ap.add_argument("--noise", nargs=2, action="append", default=[], metavar=("OLD", "NEW"),
                    help="two measurements of the same layouts: the run-to-run noise")
    ap.add_argument("--measure-skew", default="", metavar="OUT_JSON", help="run the skew check's layouts")
    ap.add_argument("--skew-check", default="", metavar="JSON", help="the skew check's table of --measure-skew's rows")
    ap.add_argument("--bandwidth-bound", action="store_true", help="--measure-skew at d 256, m 2, EP over 100 Gb/s")
    ap.add_argument("--config", default="configs/bench.toml", help="the config the runs and the calibration ran")
    ap.add_argument("--calibration", default="docs/experiments/layouts.json")
    ap.add_argument("--emulate-cal", default="docs/experiments/emulate_calibration.json")
    ap.add_argument("--profile", default="cpu-gloo", help="the profile the calibration fits")
    ap.add_argument("--sigmas-out", default="docs/experiments/interval_sigmas.json")
    ap.add_argument("--out", default="", help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    if args.measure_skew:
        measure_skew(args.measure_skew, args.config, bandwidth_bound=args.bandwidth_bound)
    if args.skew_check or args.measure_skew:
        print(skew_check(args.skew_check or args.measure_skew, args.config))
        return 0
    cfg = load_config(args.config)
    em = json.loads(Path(args.emulate_cal).read_text()) if args.emulate_cal else None
    sig = fit_sigmas(calibration_rows(args.calibration), cfg, args.profile, em)
    rows = score([row for path in args.runs for row in score_run(path, args.config, sig)], sig)
    if rows:  # the composition fitted on every run: what `plan --what-if --sigmas` and FITTED carry
        bias, sd = fit_composition([math.log(r["meas"] / r["pred"]) for r in rows], [r["sd"] for r in rows])
        sig = dataclasses.replace(sig, step_bias=bias, step_sigma=sd, source=sig.source + f"; composition over "
                                  f"{len(rows)} emulated steps of {len({r['grid'] for r in rows})} layouts")
    save_sigmas(sig, args.sigmas_out)
    text = (f"sigmas ({sig.source}): host {sig.host:.3f}, peak {sig.mem:.3f}, "
            + ", ".join(f"{k} {v:.3f}" for k, v in sorted(sig.links.items()))
            + f"; step bias {sig.step_bias:+.3f}, step sigma {sig.step_sigma:.3f}; z = {Z80}")
    if args.noise:
        noise, logs = run_noise(args.noise)
        text += (f"\nrun-to-run noise: {len(logs)} layouts measured twice, sd of one measurement's log step "
                 f"{noise:.3f} (|log ratio| median {statistics.median(abs(x) for x in logs):.3f}, max "
                 f"{max(abs(x) for x in logs):.3f})")
    text += "\n\n" + format_table(rows) + "\n\n" + format_waits(rows) if rows else ""
    print(text)
    if args.out:
        cmd = " ".join(["python scripts/experiments/plan_intervals.py", *argv])
        Path(args.out).write_text(f"# The planner's 80% step intervals against emulated runs (docs/planner.md §7)\n\n"
                                  f"Written by `{cmd}`.\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
