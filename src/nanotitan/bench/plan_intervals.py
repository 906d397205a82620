"""Are the planner's 80% intervals right? Fit the term sigmas on the calibration, then score layouts measured under
emulated networks that the calibration never predicted: how many measured step times fall inside the predicted
interval, and the median error (docs/planner.md §7).

    python -m nanotitan.bench.plan_intervals \\
        --runs docs/experiments/layouts_nvlink.json docs/experiments/layouts_100g.json [--config configs/bench.toml]
    python -m nanotitan.bench.plan_intervals --measure-skew docs/experiments/skew_check.json   # runs 6 layouts
    python -m nanotitan.bench.plan_intervals --skew-check docs/experiments/skew_check.json     # the table

Sigmas (`plan.interval.fit_sigmas`): leave-one-out over `--calibration` (the `bench layouts` rows cpu-gloo is
fitted to; each row predicted by a profile fitted to the others) and the emulator's per-call calibration
(`--emulate-cal`, `nanotitan bench emulate`'s JSON) for the collectives; written to `--sigmas-out`. Each run file is
a `nanotitan bench layouts --parallel.emulate ...` JSON: its rows are predicted as `bench layouts` predicts them
(this host's CPU profile for compute, the emulated links dilated), at the routing skew the run recorded
(`ep_recv_max_mean`, plan/skew.py) where it has one, else the default EXPERT_SKEW, and at skew 0 beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from ..config.config import load_config
from ..config.hardware import detect_hardware
from ..parallel import emulate
from ..plan import PlanOptions, calibration_rows, layout_config, predict
from ..plan.calibrate import layout_of
from ..plan.interval import Z80, fit_sigmas, save_sigmas, step_interval
from ..plan.memory import EXPERT_SKEW
from ..plan.skew import skew_of_ratio
from ..resolve import resolve_emulation


def score_run(path: str, config: str, sig, hardware: str = "auto") -> list[dict]:
    """Each row of one `bench layouts` run file: predicted step (at the recorded skew and at 0), its interval and
    the measured step."""
    data = json.loads(Path(path).read_text())
    em = data["emulate"]
    cfg = load_config(config, ["--parallel.emulate", em["profile"], "--parallel.emulate_node_size",
                               str(em["node_size"]), "--parallel.emulate_dilation", repr(em["dilation"])])
    links = emulate.link_model(resolve_emulation(cfg))
    hw = links.dilated(detect_hardware(None if hardware == "auto" else hardware))
    out = []
    for r in data["rows"]:
        lay = layout_of(r, cfg)
        ratio = r.get("ep_recv_max_mean")
        skew = skew_of_ratio(ratio, lay.ep, cfg.model.num_experts) if ratio and lay.ep > 1 else EXPERT_SKEW
        opts = PlanOptions(link_node_size=links.node_size, links_idle=True, expert_skew=skew)
        c = layout_config(cfg, lay)
        p = predict(c, lay, hw, opts)
        p0 = predict(c, lay, hw, PlanOptions(link_node_size=links.node_size, links_idle=True, expert_skew=0.0))
        lo, hi = step_interval(p, sig)
        meas = float(r["step_time_s"])
        out.append(dict(run=Path(path).stem, layout=lay.short(), ratio=ratio, skew=skew, pred=p.step_time_s,
                        pred0=p0.step_time_s, lo=lo, hi=hi, meas=meas, err=p.step_time_s / meas - 1,
                        inside=lo <= meas <= hi, dominant=p.dominant))
    return out


# The skew check (docs/planner.md §3 "Routing skew"): EP layouts of 8 ranks under the emulated h100-sxm, no balancing
# (aux_coef 0), dropless and with capacity factor 1.0 (which holds the busiest rank to the mean).
SKEW_EMULATE = ["--parallel.emulate", "h100-sxm", "--parallel.emulate_node_size", "8",
                "--parallel.emulate_dilation", "0.0006872649146099278", "--model.aux_coef", "0"]
SKEW_RUNS = {"cap1": ["--model.capacity_factor", "1.0"], "skew": []}
SKEW_LAYOUTS = ((2, 1, 4, 2), (4, 1, 2, 2), (1, 2, 4, 4))  # dp, pp, ep, M at m = 1


def measure_skew(out: str, config: str, steps: int = 14) -> None:
    from .layouts import run_layout, summarise

    rows = []
    for tag, extra in SKEW_RUNS.items():
        for dp, pp, ep, M in SKEW_LAYOUTS:
            res = run_layout(dp, pp, ep, "1f1b", M, 1, steps, Path(out).parent / "runs" / f"{tag}_dp{dp}_pp{pp}_ep{ep}",
                             [f"--config={config}", *SKEW_EMULATE, *extra], 1800)
            rows.append({"tag": tag, "dp": dp, "pp": pp, "ep": ep, "schedule": "1f1b" if pp > 1 else "-", "M": M,
                         "m": 1, **summarise(res, (steps // 3, steps))})
            Path(out).write_text(json.dumps({"rows": rows}, indent=1))


def skew_check(path: str, config: str) -> str:
    """Predicted (at skew 0 and at each run's recorded skew) against measured step and EP wait, as markdown."""
    lines = ["| routing | layout | recorded busiest/mean | f | predicted step ms (skew 0) | predicted (recorded) | "
             "measured step ms | predicted EP ms (skew 0) | predicted EP ms (recorded) | measured EP wait ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in json.loads(Path(path).read_text())["rows"]:
        cfg = load_config(config, SKEW_EMULATE + SKEW_RUNS[r["tag"]])
        links = emulate.link_model(resolve_emulation(cfg))
        hw = links.dilated(detect_hardware(None))
        lay = layout_of(r, cfg)
        c = layout_config(cfg, lay)
        p0, p = (predict(c, lay, hw, PlanOptions(link_node_size=links.node_size, links_idle=True, expert_skew=s))
                 for s in (0.0, skew_of_ratio(r["ep_recv_max_mean"], lay.ep, cfg.model.num_experts)))
        lines.append(f"| {'capacity 1.0' if r['tag'] == 'cap1' else 'dropless'} | {lay.short()} | "
                     f"{r['ep_recv_max_mean']:.2f} | {p.expert_time_factor:.2f} | {1e3 * p0.step_time_s:.0f} | "
                     f"{1e3 * p.step_time_s:.0f} | {1e3 * r['step_time_s']:.0f} | {1e3 * p0.costs['ep_a2a']:.0f} | "
                     f"{1e3 * p.costs['ep_a2a']:.0f} | {1e3 * r['ep_wait_s']:.0f} |")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    lines = ["| run | layout | busiest EP rank / mean (recorded) | sigma | predicted ms (skew 0) | predicted ms | "
             "80% interval ms | measured ms | error | inside |", "|---|---|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        lines.append(f"| {r['run']} | {r['layout']} | {ratio} | {r['skew']:.2f} | {1e3 * r['pred0']:.0f} | "
                     f"{1e3 * r['pred']:.0f} | {1e3 * r['lo']:.0f}-{1e3 * r['hi']:.0f} | {1e3 * r['meas']:.0f} | "
                     f"{100 * r['err']:+.0f}% | {'yes' if r['inside'] else 'NO'} |")
    inside = sum(r["inside"] for r in rows)
    lines.append(f"\n{inside} of {len(rows)} measured steps inside the predicted 80% interval "
                 f"({100 * inside / max(len(rows), 1):.0f}%); median |error| "
                 f"{100 * statistics.median(abs(r['err']) for r in rows):.1f}%")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanotitan.bench.plan_intervals")
    ap.add_argument("--runs", nargs="+", default=[], help="`bench layouts --parallel.emulate` JSON files")
    ap.add_argument("--measure-skew", default="", metavar="OUT_JSON", help="run the skew check's layouts")
    ap.add_argument("--skew-check", default="", metavar="JSON", help="the skew check's table of --measure-skew's rows")
    ap.add_argument("--config", default="configs/bench.toml", help="the config the runs and the calibration ran")
    ap.add_argument("--calibration", default="docs/experiments/layouts.json")
    ap.add_argument("--emulate-cal", default="docs/experiments/emulate_calibration.json")
    ap.add_argument("--profile", default="cpu-gloo", help="the profile the calibration fits")
    ap.add_argument("--sigmas-out", default="docs/experiments/interval_sigmas.json")
    ap.add_argument("--out", default="", help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    if args.measure_skew:
        measure_skew(args.measure_skew, args.config)
    if args.skew_check or args.measure_skew:
        print(skew_check(args.skew_check or args.measure_skew, args.config))
        return 0
    cfg = load_config(args.config)
    em = json.loads(Path(args.emulate_cal).read_text()) if args.emulate_cal else None
    sig = fit_sigmas(calibration_rows(args.calibration), cfg, args.profile, em)
    save_sigmas(sig, args.sigmas_out)
    print(f"sigmas ({sig.source}): host {sig.host:.3f}, peak {sig.mem:.3f}, "
          + ", ".join(f"{k} {v:.3f}" for k, v in sorted(sig.links.items())) + f"; z = {Z80}")
    rows = [row for path in args.runs for row in score_run(path, args.config, sig)]
    text = format_table(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
