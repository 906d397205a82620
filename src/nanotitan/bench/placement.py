"""`nanotitan bench placement`: experts placed by load (parallel.expert_placement) against the static placement and
the capacity-capped router, side by side, under the network emulator.

    nanotitan bench placement [--dp 2 --ep 4 --microbatches 2 --micro-batch 2] [--steps 12] [--repeats 2]
                              [--warmup 4] [--every 3] [--replicas 2] [--balanced-router [--router-bias 0.05]]
                              [--trained N]
                              [--out docs/experiments/placement.json]
                              [train overrides ...]

Default shape: the bandwidth-bound skew check (scripts/experiments/plan_intervals.py --bandwidth-bound,
docs/planner.md §3): configs/bench.toml at d_model 256, ffn 512, EP over the emulated 100 Gb/s network in nodes of 2
(configs/emulate/h100-100g.json), no aux loss, dropless, so a fresh router collapses and the busiest EP rank
receives ~2x the mean. Variants, run in turn in each repeat (the same time window for their ratios):
    static    dropless, expert e on rank e // (E/EP)
    balanced  dropless, parallel.expert_placement=balanced (rebalance_every --every, expert_replicas --replicas)
    capped    static with model.capacity_factor 1.0: the busiest rank held to the mean by dropping tokens
--trained N: every variant resumes from the model trained N steps (static, dropless, without the emulator; made once
    under OUT's runs/), and measures steps (N + W, N + steps]: a settled router, whose hot experts persist over
    windows as a trained model's do (docs/ep.md "5 Dec"), instead of a fresh one still collapsing.
--warmup W: the steps (0, W] are not measured (default steps // 3): a fresh router collapses over its first steps;
    the measured window (W, steps] is the collapsed router, the skew check's shape ("a skewed router"), not the
    collapse itself.
--balanced-router: static and balanced again on a router balanced by construction: top-k = E (model.top_k set to
model.num_experts), every token to every expert, so every EP rank receives the mean whatever the logits (twice
the assignments of the top-2 shape): the overhead of the placement's bookkeeping and moves where there is nothing
to balance. --router-bias RATE instead keeps top-2 and balances with the aux-loss-free bias (model.bias_update_rate;
at 0.05 it did not balance this collapsing router in 15 steps, nor did the Switch loss at aux 1.0 in 12). The static
row's busiest/mean says how balanced the router was.
Per run: medians over the steps (W, steps] of step time, EP wait (comm_ep_wait_s) and the busiest EP rank's
received assignments over the mean (ep_recv_max_mean under the static mapping; ep_placed_max_mean under the
placement in force); then medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tomllib
from pathlib import Path

from ..observe.runs import run_results, summarise
from .layouts import run_layout

SHAPE = ["--model.aux_coef", "0", "--model.d_model", "256", "--model.ffn_dim", "512"]
BANDWIDTH_BOUND = ["--parallel.emulate", "configs/emulate/h100-100g.json", "--parallel.emulate_node_size", "2",
                   "--parallel.emulate_dilation", "0.0006872649146099278", *SHAPE]


def trained(args, overrides: list[str], out: Path) -> list[str]:
    """--trained N: the shape's model trained N steps (static, dropless, no emulation: the same maths, faster) once
    under OUT's runs/, and the arguments that resume every variant from its checkpoint (a router whose skew has
    settled: the hot experts persist over windows, as in a trained model, instead of a fresh router's collapse)."""
    run_dir = out.parent / "runs" / f"placement_trained_{args.trained}"
    ckpt = run_dir / "checkpoints" / f"step_{args.trained}"
    if not ckpt.exists():
        run_layout(args.dp, 1, args.ep, "1f1b", args.microbatches, args.micro_batch, args.trained, run_dir,
                   [f"--config={args.config}", *SHAPE, "--train.ckpt_every", str(args.trained), *overrides],
                   args.timeout)
    return ["--train.resume", str(ckpt), "--train.ckpt_every", "0"]


def variants(every: int, replicas: int, balanced_router: list[str] | None) -> dict[str, list[str]]:
    placed = ["--parallel.expert_placement", "balanced", "--parallel.rebalance_every", str(every),
              "--parallel.expert_replicas", str(replicas)]
    if balanced_router is not None:
        how = " ".join(balanced_router).replace("--model.", "")
        return {f"static ({how})": balanced_router, f"balanced ({how})": [*balanced_router, *placed]}
    return {"static": [], "balanced": placed, "capped": ["--model.capacity_factor", "1.0"]}


def row(res: dict, warmup: int, steps: int) -> dict:
    s = summarise(res, (warmup, steps))
    window = [r["step_time_s"] for r in res["records"] if warmup < r["step"] <= steps]
    return {"step_time_s": s["step_time_s"], "step_mean_s": statistics.mean(window), "ep_wait_s": s["ep_wait_s"],
            "dp_wait_s": s["dp_wait_s"],
            "recv_max_mean": s.get("ep_recv_max_mean"), "placed_max_mean": s.get("ep_placed_max_mean"),
            "final_loss": s["final_loss"]}


def table(runs: dict[str, list[dict]]) -> str:
    med = lambda rs, k: statistics.median(r[k] for r in rs) if all(r[k] is not None for r in rs) else None  # noqa
    lines = ["| variant | step time, median (s) | step time, mean (s) | EP wait (s) | DP wait (s) | busiest/mean | "
             "median ÷ first row's | repeats |", "|---|---|---|---|---|---|---|---|"]
    first = None
    for name, rs in runs.items():
        step = med(rs, "step_time_s")
        first = first or step
        ratio = med(rs, "placed_max_mean") or med(rs, "recv_max_mean")
        lines.append(f"| {name} | {step:.2f} | {med(rs, 'step_mean_s'):.2f} | {med(rs, 'ep_wait_s'):.2f} | "
                     f"{med(rs, 'dp_wait_s'):.2f} | {ratio:.2f} | {step / first:.3f} | {len(rs)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan bench placement", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--every", type=int, default=3, help="parallel.rebalance_every of the balanced runs")
    ap.add_argument("--replicas", type=int, default=2, help="parallel.expert_replicas of the balanced runs")
    ap.add_argument("--warmup", type=int, default=None, help="steps not measured (default steps // 3)")
    ap.add_argument("--balanced-router", action="store_true",
                    help="the overhead rows: a router balanced by top-k = E (or --router-bias)")
    ap.add_argument("--router-bias", type=float, default=0.0, help="--balanced-router by the aux-free bias at RATE")
    ap.add_argument("--trained", type=int, default=0, help="resume every variant from the model trained N steps "
                    "(static, no emulation; made once under OUT's runs/): a settled router's persistent skew")
    ap.add_argument("--config", default="configs/bench.toml")
    ap.add_argument("--out", default="docs/experiments/placement.json")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--table-only", action="store_true", help="re-read the runs under OUT's runs/, run nothing")
    args, overrides = ap.parse_known_args(argv)
    out = Path(args.out)
    warmup = args.steps // 3 if args.warmup is None else args.warmup
    if not 0 <= warmup < args.steps:
        raise SystemExit(f"--warmup {warmup} must be in [0, --steps {args.steps}) (--warmup {args.steps // 3})")
    bias = None
    if args.balanced_router:
        experts = tomllib.loads(Path(args.config).read_text())["model"]["num_experts"]
        if "--model.num_experts" in overrides:
            experts = overrides[overrides.index("--model.num_experts") + 1]
        bias = (["--model.bias_update_rate", str(args.router_bias)] if args.router_bias
                else ["--model.top_k", str(experts)])
    runs: dict[str, list[dict]] = {}
    resume = trained(args, overrides, out) if args.trained and not args.table_only else []
    first, last = args.trained + warmup, args.trained + args.steps  # the measured steps (first, last]
    for rep in range(args.repeats):
        for name, extra in variants(args.every, args.replicas, bias).items():
            tag = name.split()[0] + ("_aux" if args.balanced_router else "") + \
                (f"_trained{args.trained}" if args.trained else "")
            if args.table_only:
                runs.setdefault(name, []).append(row(run_results(out.parent / "runs" / f"placement_{tag}_{rep}"),
                                                     first, last))
                continue
            res = run_layout(args.dp, 1, args.ep, "1f1b", args.microbatches, args.micro_batch, last,
                             out.parent / "runs" / f"placement_{tag}_{rep}",
                             [f"--config={args.config}", *BANDWIDTH_BOUND, *extra, *resume, *overrides], args.timeout)
            runs.setdefault(name, []).append(row(res, first, last))
            out.write_text(json.dumps({"layout": vars(args), "overrides": overrides, "runs": runs}, indent=1))
            print(f"{name} repeat {rep}: {runs[name][-1]}", flush=True)
    print(table(runs))
    return 0
