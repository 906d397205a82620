"""`nanotitan bench dispatch`: parallel.ep_dispatch static against dynamic, side by side, under the network emulator.

    nanotitan bench dispatch [--layouts ep4 dp2ep4] [--topology h100-sxm:8 configs/emulate/h100-100g.json:2]
                             [--ep-dispatch both] [--capacity 1.25] [--steps 8] [--warmup 3] [--repeats 2]
                             [--micro-batch 2] [--dilation 0.000687...] [--config configs/bench.toml]
                             [--out docs/experiments/static_dispatch_emulated.json] [train overrides ...]

Each layout (`dpDepE`, dp 1 when left out) runs as `nanotitan train` jobs (bench layouts' `run_layout`) at the
config's global batch with m = --micro-batch, under each topology (PROFILE[:RANKS_PER_NODE], as bench emulate) at one
fixed dilation (default: the published layouts tables' one, this project's CPU fp32 GEMM peak over the H100's; 0
measures this host's). Both dispatches run the grouped experts (static needs them), so only the dispatch differs.
In each repeat the variants run one after another (dynamic, then static at each --capacity): their ratios come from
the same time window, which is what a busy machine can give.

Per run, over the steps (W, steps]: step time (median and min), the EP wait (comm_ep_wait_s) and the EP bytes this
rank sent (comm_ep_bytes, rank 0: on the steps that did not replay, one try, the padded payload; on those that did,
both tries, the replay's buffers at capacity EP), the steps replayed after an overflow (ep_replays) and the busiest EP
rank's received assignments over the mean (ep_recv_max_mean: the routing skew the padding must absorb). The table
gives, per layout and topology, each variant's figures (its fastest step; the median over repeats of each run's
median), static over dynamic, per repeat, as min / median, and the planner's static over dynamic for the same run at
the skew the dynamic runs measured (`planned`). --table-only re-reads the runs under OUT's runs/ and runs nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import statistics
from pathlib import Path

from ..config.config import Config, load_config
from ..config.hardware import detect_hardware
from ..observe.runs import run_results
from ..parallel.comm import emulate
from ..plan import Layout, ModelShape, PlanOptions, layout_config, predict
from ..plan.dispatch import overflow_probability
from ..plan.skew import skew_of_ratio
from ..resolve import resolve_emulation
from .emulate import parse_topology
from .layouts import run_layout

# the dilation of the published emulated tables (docs/emulate.md §4: this CPU's fp32 GEMM peak over the H100's)
DILATION = 0.0006872649146099278


def parse_layout(name: str, batch: int, m: int) -> tuple[int, int, int]:
    """(dp, ep, M) of a layout named dpDepE (or epE), at `batch` sequences a step in microbatches of m."""
    got = re.fullmatch(r"(?:dp(\d+))?ep(\d+)", name)
    if got is None:
        raise SystemExit(f"--layouts {name}: name a layout dpDepE or epE (e.g. ep4, dp2ep4)")
    dp, ep = int(got.group(1) or 1), int(got.group(2))
    if batch % (dp * ep * m):
        raise SystemExit(f"--layouts {name}: {batch} sequences a step do not split into dp*ep*M*m with m = {m} "
                         f"(--micro-batch, or --train.micro_batch/--parallel.* of the config's batch)")
    return dp, ep, batch // (dp * ep * m)


def variants(which: str, capacities: list[float]) -> dict[str, list[str]]:
    """The train arguments of each variant, by name."""
    grouped = ["--model.experts_impl", "grouped"]
    out = {"dynamic": grouped} if which in ("both", "dynamic") else {}
    if which in ("both", "static"):
        out |= {f"static {c:g}": [*grouped, "--parallel.ep_dispatch", "static", "--parallel.ep_capacity", str(c)]
                for c in capacities}
    return out


def planned(cfg: Config, dp: int, ep: int, M: int, m: int, topology: tuple[str, int], dilation: float,
            busiest: float, capacity: float, hardware: str = "cpu-gloo") -> dict:
    """The planner's static against dynamic for one run (as `bench layouts` predicts an emulated one, uncalibrated:
    `hardware` prices compute, the emulated links dilated price communication, link time is waiting), at the
    routing skew the dynamic runs measured (`busiest`: their busiest EP rank's load over the mean). CPU ranks:
    a host read costs nothing, so static can only cost (its padding and replays)."""
    c = copy.deepcopy(cfg)
    c.parallel.emulate, c.parallel.emulate_node_size, c.parallel.emulate_dilation = *topology, dilation
    links = emulate.link_model(resolve_emulation(c))
    c.model.experts_impl = "grouped"
    lay = Layout(dp, 1, ep, "1f1b", M, m)
    skew = skew_of_ratio(busiest, ep, c.model.num_experts)
    opts = PlanOptions(link_node_size=links.node_size, links_idle=True, expert_skew=skew)
    hw = links.dilated(detect_hardware(hardware))
    dyn = predict(layout_config(c, lay), lay, hw, opts)
    c.parallel.ep_dispatch, c.parallel.ep_capacity = "static", capacity
    stat = predict(layout_config(c, lay), lay, hw, opts)
    return {"dynamic_s": dyn.step_time_s, "static_s": stat.step_time_s, "ratio": stat.step_time_s / dyn.step_time_s,
            "overflow": overflow_probability(c, lay, ModelShape.from_config(c), skew), "skew": skew}


def run_row(res: dict, warmup: int, steps: int) -> dict:
    """One run's figures over the steps (warmup, steps] (rank 0's records, one a step)."""
    recs = [r for r in res["records"] if warmup < r["step"] <= steps] or res["records"][-1:]
    done = {r["step"]: r.get("ep_replays", 0) for r in res["records"]}  # steps replayed so far (static only)
    replays = [done[r["step"]] - done.get(r["step"] - 1, 0) for r in recs]
    clean = [r["comm_ep_bytes"] for r, n in zip(recs, replays) if not n]  # one try: the padded payload
    again = [r["comm_ep_bytes"] for r, n in zip(recs, replays) if n]  # both tries, the replay's at capacity EP
    skew = [r["ep_recv_max_mean"] for r in recs if "ep_recv_max_mean" in r]
    return {"step_s": statistics.median(r["step_time_s"] for r in recs),
            "step_min_s": min(r["step_time_s"] for r in recs),
            "ep_wait_s": statistics.median(r["comm_ep_wait_s"] for r in recs),
            "ep_bytes": statistics.median(clean) if clean else None,
            "ep_bytes_replayed": statistics.median(again) if again else None,
            "replays": sum(replays), "steps": len(recs),
            "skew": statistics.median(skew) if skew else None, "final_loss": res["records"][-1]["loss"]}


def ratios(runs: dict[str, list[dict]], key: str, name: str) -> tuple[float, float]:
    """(min, median) over repeats of variant `name`'s figure over dynamic's of the same repeat."""
    r = [s[key] / d[key] for s, d in zip(runs[name], runs["dynamic"]) if d[key] and s[key] is not None]
    return (min(r), statistics.median(r)) if r else (float("nan"), float("nan"))


def _mib(rows: list[dict], key: str) -> str:
    got = [r[key] for r in rows if r[key] is not None]
    return f"{statistics.median(got) / 2**20:.2f}" if got else "-"


def table(title: str, runs: dict[str, list[dict]], plans: dict[str, dict]) -> str:
    """One layout under one topology: each variant's figures (its fastest step, the median of its runs' median
    steps), static over dynamic (min / median over repeats of the same repeat's ratio) and the planner's static
    over dynamic with its overflow chance (`planned`)."""
    lines = [f"### {title}", "", "| variant | step ms: fastest / median | EP wait ms: min / median | EP MiB a step: "
             "one try / replayed | replayed steps | busiest/mean | median step ÷ dynamic | fastest step ÷ dynamic | "
             "EP wait ÷ dynamic | EP bytes ÷ dynamic (one try) | planned step ÷ dynamic, overflow |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        step, wait = [r["step_s"] for r in rs], [r["ep_wait_s"] for r in rs]
        skews = [r["skew"] for r in rs if r["skew"] is not None]
        line = (f"| {name} | {1e3 * min(r['step_min_s'] for r in rs):.0f} / {1e3 * statistics.median(step):.0f} | "
                f"{1e3 * min(wait):.0f} / {1e3 * statistics.median(wait):.0f} | {_mib(rs, 'ep_bytes')} / "
                f"{_mib(rs, 'ep_bytes_replayed')} | {sum(r['replays'] for r in rs)} of {sum(r['steps'] for r in rs)} | "
                f"{statistics.median(skews) if skews else float('nan'):.2f} | ")
        if name == "dynamic" or "dynamic" not in runs:
            line += "- | - | - | - |"
        else:
            pairs = [ratios(runs, k, name) for k in ("step_s", "step_min_s", "ep_wait_s", "ep_bytes")]
            line += " | ".join("-" if math.isnan(lo) else f"{lo:.3f} / {mid:.3f}" for lo, mid in pairs) + " |"
        plan = plans.get(name)
        lines.append(line + (f" {plan['ratio']:.3f}, {100 * plan['overflow']:.0f}% |" if plan else " - |"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan bench dispatch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", nargs="+", default=["ep4", "dp2ep4"], help="dpDepE each (default: ep4 dp2ep4)")
    ap.add_argument("--topology", nargs="+", default=["h100-sxm:8", "configs/emulate/h100-100g.json:2"],
                    help="PROFILE[:RANKS_PER_NODE] each (default: one NVLink node of 8; nodes of 2 over 100 Gb/s)")
    ap.add_argument("--ep-dispatch", default="both", choices=["both", "dynamic", "static"])
    ap.add_argument("--capacity", type=float, nargs="+", default=[1.25], help="parallel.ep_capacity of static runs")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3, help="steps not measured (the first compiles nothing, but "
                    "a fresh router skews most early)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=2, help="m, as bench layouts")
    ap.add_argument("--dilation", type=float, default=DILATION, help="parallel.emulate_dilation (0: this host's)")
    ap.add_argument("--config", default="configs/bench.toml")
    ap.add_argument("--out", default="docs/experiments/static_dispatch_emulated.json")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--table-only", action="store_true", help="re-read the runs under OUT's runs/, run nothing")
    args, overrides = ap.parse_known_args(argv)
    if not 0 <= args.warmup < args.steps:
        raise SystemExit(f"--warmup {args.warmup} must be in [0, --steps {args.steps})")
    cfg = load_config(args.config, overrides)
    out = Path(args.out)
    ran = [a for a in argv or [] if a != "--table-only"]  # the command that ran the runs
    results, text = {}, []
    for topo in args.topology:
        profile, size = parse_topology(topo)
        net = ["--parallel.emulate", profile, "--parallel.emulate_node_size", str(size)]
        cfg.parallel.emulate, cfg.parallel.emulate_node_size = profile, size
        dilation = args.dilation or emulate.link_model(resolve_emulation(cfg)).dilation
        net += ["--parallel.emulate_dilation", repr(dilation)]
        for name in args.layouts:
            dp, ep, M = parse_layout(name, cfg.layout_batch, args.micro_batch)
            key = f"{name} {topo}"
            runs: dict[str, list[dict]] = {}
            for rep in range(args.repeats):
                for var, extra in variants(args.ep_dispatch, args.capacity).items():
                    run_dir = out.parent / "runs" / f"dispatch_{name}_{Path(profile).stem}_{size}_" \
                        f"{var.replace(' ', '')}_{rep}"
                    res = run_results(run_dir) if args.table_only else run_layout(
                        dp, 1, ep, "1f1b", M, args.micro_batch, args.steps, run_dir,
                        [f"--config={args.config}", *net, *extra, *overrides], args.timeout)
                    runs.setdefault(var, []).append(run_row(res, args.warmup, args.steps))
                    print(f"[bench dispatch] {key} {var} repeat {rep}: {runs[var][-1]}", flush=True)
            busiest = [r["skew"] for r in runs.get("dynamic", []) if r["skew"] is not None]
            plans = {var: planned(cfg, dp, ep, M, args.micro_batch, (profile, size), dilation,
                                  statistics.median(busiest), float(var.split()[1]))
                     for var in runs if var != "dynamic" and busiest}
            results[key] = {"dp": dp, "ep": ep, "M": M, "m": args.micro_batch, "profile": profile, "node_size": size,
                            "dilation": dilation, "runs": runs, "planned": plans}
            text.append(table(f"dp{dp}·ep{ep} (M {M} × m {args.micro_batch}), {profile}, nodes of {size}, "
                              f"dilation {dilation:.3g}; {args.repeats} repeats of steps ({args.warmup}, {args.steps}]",
                              runs, plans))
            print(text[-1] + "\n", flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"argv": ran, "config": args.config, "overrides": overrides, "steps": args.steps,
                                       "warmup": args.warmup, "results": results}, indent=1))
    out.with_suffix(".md").write_text(f"Command: `nanotitan bench dispatch {' '.join(ran)}`\n\n"
                                      + "\n\n".join(text) + "\n")
    return 0
