"""Planner vs reality: fit the hardware profile's free constants to measured layouts and report the
prediction errors in sample and out of sample, with Spearman's rho of the ranking.

    nanotitan plan --measure --out docs/experiments/cpu_profile.json     # this machine's profile
    nanotitan bench layouts --gpus 2 4 8 --steps 40 --window 10 40 --micro-batch 2 --config configs/bench.toml
    python scripts/experiments/calibrate_planner.py                               # -> docs/calibration.md + calibrated profile
    python scripts/experiments/calibrate_planner.py --new-schedules docs/experiments/layouts_schedules.json  # table only

Three fits, all by `plan.fit_profile` (least squares on log(predicted/measured) step time; memory reserve =
median of measured RSS minus predicted tensor bytes):
  1. on the N = 2 rows only (3 layouts, so only 3 time constants: compute_efficiency, a2a_call_s,
     p2p_call_s; step_overhead_s keeps the profile's value), evaluated on N = 4 and N = 8 (out of sample);
  2. leave-one-out over all rows: each row predicted by a profile fitted to the other rows;
  3. on all rows (in sample): the profile written to --out, which `--hardware FILE` uses for planning.
"""

import argparse
import copy
import statistics
import sys
from pathlib import Path

from nanotitan.config.config import load_config
from nanotitan.config.hardware import get_hardware, save_hardware
from nanotitan.plan import FIT_TIME_FIELDS, calibrate, calibration_rows, fit_profile, format_calibration, spearman


def _summary(res: dict) -> str:
    return (f"step {100 * res['median_abs_err_step']:.1f}%, memory {100 * res['median_abs_err_mem']:.1f}%, "
            f"rho {res['spearman_rho']:.2f} ({len(res['rows'])} layouts)")


def leave_one_out(rows: list[dict], cfg, profile) -> dict:
    """Each row predicted by a profile fitted on every other row."""
    out = []
    for i, r in enumerate(rows):
        hw = fit_profile(rows[:i] + rows[i + 1:], cfg, profile)
        out += calibrate([r], cfg, hw)["rows"]
    return dict(rows=out, median_abs_err_step=statistics.median(abs(x["step_err"]) for x in out),
                median_abs_err_mem=statistics.median(abs(x["mem_err"]) for x in out),
                spearman_rho=spearman([x["pred_step_s"] for x in out], [x["meas_step_s"] for x in out]),
                median_time_ratio=statistics.median(x["meas_step_s"] / x["pred_step_s"] for x in out))


def new_schedules(rows: list[dict], cfg, profile) -> dict:
    """Rows under schedules the profile was not fitted on (zb1, interleaved), predicted by that profile as it is:
    each row with its own virtual_stages (cfg.parallel.virtual_stages, which layout_config keeps for interleaved)."""
    out = []
    for r in rows:
        c = copy.deepcopy(cfg)
        c.parallel.virtual_stages = int(r.get("virtual_stages", 1))
        out += [dict(x, layout=x["layout"] + (f" V{c.parallel.virtual_stages}" if r["schedule"] == "interleaved"
                                               else "")) for x in calibrate([r], c, profile)["rows"]]
    return dict(rows=out, median_abs_err_step=statistics.median(abs(x["step_err"]) for x in out),
                median_abs_err_mem=statistics.median(abs(x["mem_err"]) for x in out),
                spearman_rho=spearman([x["pred_step_s"] for x in out], [x["meas_step_s"] for x in out])
                if len(out) > 1 else float("nan"),
                median_time_ratio=statistics.median(x["meas_step_s"] / x["pred_step_s"] for x in out))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="docs/experiments/layouts.json")
    ap.add_argument("--profile", default="docs/experiments/cpu_profile.json")
    ap.add_argument("--config", default="configs/bench.toml")
    ap.add_argument("--out", default="docs/calibration.md")
    ap.add_argument("--profile-out", default="docs/experiments/cpu_profile_calibrated.json")
    ap.add_argument("--new-schedules", default=None, metavar="LAYOUTS_JSON",
                    help="only print the table of these rows predicted by --profile-out as it is (no refit, no writes)")
    args = ap.parse_args()
    cfg = load_config(args.config)
    if args.new_schedules:
        print(format_calibration(new_schedules(calibration_rows(args.new_schedules), cfg,
                                               get_hardware(args.profile_out))))
        return 0
    rows = calibration_rows(args.layouts)
    base = get_hardware(args.profile)
    small = min(r["world"] for r in rows)
    train, test = [r for r in rows if r["world"] == small], [r for r in rows if r["world"] != small]
    n2_fields = {k: v for k, v in FIT_TIME_FIELDS.items() if k != "step_overhead_s"}  # 3 rows: 3 constants
    hw_small = fit_profile(train, cfg, base, fields=n2_fields)
    uncal = calibrate(rows, cfg, base)
    in_small, out_small = calibrate(train, cfg, hw_small), calibrate(test, cfg, hw_small)
    loo = leave_one_out(rows, cfg, base)
    hw_all = fit_profile(rows, cfg, base)
    save_hardware(hw_all, args.profile_out)
    all_in = calibrate(rows, cfg, hw_all)
    const = lambda hw: (f"compute_efficiency {hw.compute_efficiency:.3f}, a2a_call_s {1e3 * hw.a2a_call_s:.2f} ms, "
                        f"p2p_call_s {1e3 * hw.p2p_call_s:.2f} ms, step_overhead_s {1e3 * hw.step_overhead_s:.2f} ms, "
                        f"mem_reserved {hw.mem_reserved_bytes / 2**20:.0f} MiB")
    text = f"""# Planner calibration against measured layouts

Produced by `python scripts/experiments/calibrate_planner.py` (the same fit as `nanotitan plan --calibrate
{args.layouts} --config {args.config} --hardware {args.profile} --out {args.profile_out}`).
Measurements `{args.layouts}`: `nanotitan bench layouts --gpus 2 4 8 --steps 40 --window 10 40 --micro-batch 2
--config {args.config}` on the 2-core CPU machine, 1 torch thread per rank (N = 4 and 8 oversubscribe the cores),
median step time over steps 10-40, peak RSS per rank. Base profile `{args.profile}` (`nanotitan plan --measure`).

Method (`plan.fit_profile`): the time constants minimise the sum of squared log(predicted / measured) step
times (Nelder-Mead on their logs); the memory reserve is the median of measured peak RSS minus predicted tensor
bytes. The planner models core sharing explicitly: with more ranks than cores, the step is at least the node's
total CPU work (compute, gloo collectives, per-call and per-step host costs, optimizer, on every rank) divided
by its cores, because a rank idling in a pipeline bubble or waiting on a peer lends its core to another rank.

| evaluation | fitted on | evaluated on | median abs error: step | memory | Spearman rho |
|---|---|---|---:|---:|---:|
| uncalibrated measured profile | - | all {len(rows)} | {100 * uncal['median_abs_err_step']:.1f}% | {100 * uncal['median_abs_err_mem']:.1f}% | {uncal['spearman_rho']:.2f} |
| in sample | N = {small} ({len(train)}) | N = {small} | {100 * in_small['median_abs_err_step']:.1f}% | {100 * in_small['median_abs_err_mem']:.1f}% | {in_small['spearman_rho']:.2f} |
| **out of sample** | N = {small} ({len(train)}) | N > {small} ({len(test)}) | **{100 * out_small['median_abs_err_step']:.1f}%** | **{100 * out_small['median_abs_err_mem']:.1f}%** | **{out_small['spearman_rho']:.2f}** |
| **leave-one-out** | the other {len(rows) - 1} | each of {len(rows)} | **{100 * loo['median_abs_err_step']:.1f}%** | **{100 * loo['median_abs_err_mem']:.1f}%** | **{loo['spearman_rho']:.2f}** |
| in sample | all {len(rows)} | all {len(rows)} | {100 * all_in['median_abs_err_step']:.1f}% | {100 * all_in['median_abs_err_mem']:.1f}% | {all_in['spearman_rho']:.2f} |

Fitted constants. N = {small} only: {const(hw_small)}. All rows (written to `{args.profile_out}`):
{const(hw_all)}.

## Out of sample: fitted on N = {small}, predicting N > {small}

{format_calibration(out_small)}

## Leave-one-out over all layouts

{format_calibration(loo)}

## In sample: fitted on all layouts (the calibrated profile)

{format_calibration(all_in)}

## Before calibration: the measured profile as `--measure` wrote it

{format_calibration(uncal)}
"""
    Path(args.out).write_text(text)
    print(text)
    print(f"uncalibrated {_summary(uncal)}; out of sample {_summary(out_small)}; leave-one-out {_summary(loo)}; "
          f"in sample {_summary(all_in)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
