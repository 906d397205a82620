"""`nanotitan bench overlap`: parallel.ep_overlap against the same job without it, on emulated networks and on
this machine, measured side by side and against the planner.

    nanotitan bench overlap [--config configs/mid.toml] [--ep 2] [--chunks 2 4] [--steps 12] [--window 4 12]
                            [--repeats 2] [--topology configs/emulate/h100-100g.json:1 none] [--out FILE]
                            [overrides ...]

For each topology (PROFILE[:RANKS_PER_NODE] as `bench emulate`, or "none": no emulation), each repeat runs the
EP job (dp = pp = 1) without overlap and with each chunk count, in an order that alternates between repeats, as
real `nanotitan train` processes. Per run: the median over the window of the step time and of the exposed EP wait
(`comm_ep_wait_s`: what the EP calls and waits held the rank, i.e. what compute did not hide). Reported: min and
median over repeats, the ratios against no overlap, and the planner's step time and exposed EP time for the same
run (`plan/cost.py`, `ep_overlap_exposed`) under the emulated links (PlanOptions.links_idle).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
from pathlib import Path

from ..bench_layouts import run_layout, summarise
from ..config import load_config
from ..hardware import detect_hardware
from ..parallel import emulate
from ..plan import Layout, PlanOptions, predict
from ..resolve import resolve_model
from .emulate import parse_topology


def _predict(cfg, ep: int, m: int, chunks: int, links, hardware: str = "cpu-gloo") -> tuple[float, float]:
    """(step s, exposed EP s per step) the planner predicts for the run (links: the emulated network or None), with
    `hardware` pricing compute (uncalibrated on these runs, as `bench layouts`)."""
    cfg = copy.deepcopy(cfg)  # the caller's config stays as it is
    cfg.parallel.ep_overlap, cfg.parallel.ep_chunks = chunks > 1, max(chunks, 2)
    hw = detect_hardware(None if hardware == "auto" else hardware)
    opts = PlanOptions()
    if links is not None:
        hw = links.dilated(hw)
        opts = PlanOptions(link_node_size=links.node_size, links_idle=True)
    p = predict(cfg, Layout(1, 1, ep, "1f1b", 1, m), hw, opts)
    return p.step_time_s, p.costs["ep_a2a"]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan bench overlap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/mid.toml")
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--chunks", type=int, nargs="+", default=[2, 4], help="parallel.ep_chunks values to run")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--window", type=int, nargs=2, default=[4, 12], help="median over steps (a, b]")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--topology", nargs="+", default=["configs/emulate/h100-100g.json:1", "none"])
    ap.add_argument("--hardware", default="cpu-gloo", help="profile pricing compute in the predictions (auto: detect)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="", help="also write the table (markdown) there")
    args, overrides = ap.parse_known_args(argv)

    cfg = resolve_model(load_config(args.config, overrides))
    settings = [1] + args.chunks  # 1: no overlap
    lines = [f"# parallel.ep_overlap: `nanotitan bench overlap {' '.join(argv)}`", "",
             f"EP={args.ep}, m={args.micro_batch} sequences of {cfg.train.seq_len}, {cfg.model.num_experts} experts "
             f"(top {cfg.model.top_k}), d_model {cfg.model.d_model}, ffn {cfg.model.ffn_dim}, {cfg.train.dtype}; "
             f"median over steps ({args.window[0]}, {args.window[1]}] per run, min / median over {args.repeats} "
             f"repeats (order alternating). Predictions: `{args.hardware}` prices compute, uncalibrated on these runs.",
             ""]
    for topo in args.topology:
        emu_args, links = [], None
        if topo != "none":
            prof, node = parse_topology(topo)
            emu_args = ["--parallel.emulate", prof, "--parallel.emulate_node_size", str(node)]
            c = load_config(args.config, overrides + emu_args)
            links = emulate.link_model(c)  # the dilation, measured once here and passed to every run
            emu_args += ["--parallel.emulate_dilation", f"{links.dilation:.6g}"]
        runs: dict[int, list[dict]] = {n: [] for n in settings}
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.repeats):
                for n in (settings if r % 2 == 0 else settings[::-1]):
                    ov = ["--parallel.ep_overlap", "true", "--parallel.ep_chunks", str(n)] if n > 1 else []
                    base = ["--config", args.config, *overrides, *emu_args, *ov]
                    res = run_layout(1, 1, args.ep, "1f1b", 1, args.micro_batch, args.steps,
                                     Path(tmp) / f"r{r}_n{n}", base, args.timeout)
                    runs[n].append(summarise(res, tuple(args.window)))
                    print(f"{topo} repeat {r} chunks {n}: step {runs[n][-1]['step_time_s'] * 1e3:.0f} ms, "
                          f"EP wait {runs[n][-1]['ep_wait_s'] * 1e3:.0f} ms", flush=True)
        title = "this machine, no emulation" if links is None else links.describe()
        lines += [f"## {title}", "", "| ep_overlap | step ms min / med | EP wait ms min / med | step ÷ off (med) | "
                  "EP wait ÷ off (med) | predicted step ms | predicted EP ms | step error |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        med = {n: (statistics.median(x["step_time_s"] for x in runs[n]),
                   statistics.median(x["ep_wait_s"] for x in runs[n])) for n in settings}
        for n in settings:
            step_min = min(x["step_time_s"] for x in runs[n])
            wait_min = min(x["ep_wait_s"] for x in runs[n])
            pred_step, pred_ep = _predict(cfg, args.ep, args.micro_batch, n, links, args.hardware)
            lines.append(f"| {'off' if n == 1 else f'{n} groups'} | {step_min * 1e3:.0f} / {med[n][0] * 1e3:.0f} | "
                         f"{wait_min * 1e3:.0f} / {med[n][1] * 1e3:.0f} | {med[n][0] / med[1][0]:.3f} | "
                         f"{med[n][1] / max(med[1][1], 1e-9):.3f} | {pred_step * 1e3:.0f} | {pred_ep * 1e3:.0f} | "
                         f"{100 * (pred_step / med[n][0] - 1):+.0f}% |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0
