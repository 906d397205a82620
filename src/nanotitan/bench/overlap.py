"""`nanotitan bench overlap`: EP overlap against the same job without it, on emulated networks and on this machine,
measured side by side and against the planner.

    nanotitan bench overlap [--config configs/mid.toml] [--ep 2] [--pp 1] [--schedule 1f1b] [--chunks 2 4] [--lanes]
                            [--microbatches 1] [--steps 12] [--window 4 12] [--repeats 2]
                            [--topology configs/emulate/h100-100g.json:1 none] [--out FILE] [overrides ...]

`--interleaved N` instead runs off and lanes alternating step by step in one launch per topology (N steps each,
forwards and backwards only): what the machine's load moves, it moves for both, and each step's process CPU time
is reported beside its wall time.
Modes: off; `--chunks N ...`: parallel.ep_overlap with N groups of experts per trip (within one layer call);
`--lanes`: parallel.ep_overlap_microbatches (one microbatch's forward beside another's backward; needs
--microbatches >= 2). For each topology (PROFILE[:RANKS_PER_NODE] as `bench emulate`, or "none": no emulation),
each repeat runs the EP job (dp = 1; pp = 1, or `--pp` stages under `--schedule`) in every mode, in an order that
alternates between repeats, as real `nanotitan train` processes. Per run: the median over the window of the step
time and of the exposed EP wait (`comm_ep_wait_s` of rank 0, the first stage: time an EP call was pending and no
lane computed; with one lane, what the EP calls and waits held the rank). Reported: min and median over repeats, the ratios against off, and the planner's step time and
exposed EP time for the same run (`plan/cost.py`) under the emulated links (PlanOptions.links_idle). With "none"
among the topologies, each emulated mode also gets "step − free": its step less the same mode's step without
emulation, the link time it left exposed measured without the wait columns.
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


def mode_args(mode: str) -> list[str]:
    """The train overrides of a mode: "off", "N groups" (parallel.ep_overlap) or "lanes"."""
    if mode == "off":
        return []
    if mode == "lanes":
        return ["--parallel.ep_overlap_microbatches", "true"]
    return ["--parallel.ep_overlap", "true", "--parallel.ep_chunks", mode.split()[0]]


def _predict(cfg, ep: int, M: int, m: int, mode: str, links, hardware: str = "cpu-gloo", pp: int = 1,
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


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan bench overlap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/mid.toml")
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (the lanes run 1f1b and zb1 with pp > 1)")
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "zb1", "gpipe", "interleaved"])
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=1, help="parallel.microbatches M (--lanes needs >= 2)")
    ap.add_argument("--chunks", type=int, nargs="*", default=[2, 4], help="parallel.ep_chunks values to run")
    ap.add_argument("--lanes", action="store_true", help="also run parallel.ep_overlap_microbatches")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--window", type=int, nargs=2, default=[4, 12], help="median over steps (a, b]")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--topology", nargs="+", default=["configs/emulate/h100-100g.json:1", "none"])
    ap.add_argument("--hardware", default="cpu-gloo", help="profile pricing compute in the predictions (auto: detect)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="", help="also write the table (markdown) there")
    ap.add_argument("--interleaved", type=int, default=0, metavar="N",
                    help="instead: off and lanes alternating step by step, N steps each, in one launch per topology")
    args, overrides = ap.parse_known_args(argv)
    if args.interleaved:
        cfg = resolve_model(load_config(args.config, overrides))
        text = "\n".join(interleaved(cfg, args.pp, args.ep, args.schedule, args.microbatches, args.micro_batch,
                                      args.interleaved, topo, args.timeout) for topo in args.topology)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return 0
    if args.lanes and args.microbatches < 2:
        ap.error("--lanes runs a forward beside another microbatch's backward: --microbatches 2 or more")

    cfg = resolve_model(load_config(args.config, overrides))
    modes = ["off"] + [f"{n} groups" for n in args.chunks] + (["lanes"] if args.lanes else [])
    M, m = args.microbatches, args.micro_batch
    lines = [f"# EP overlap: `nanotitan bench overlap {' '.join(argv)}`", "",
             f"EP={args.ep}, PP={args.pp} ({args.schedule}), M={M} microbatches of m={m} sequences of {cfg.train.seq_len}, {cfg.model.num_experts} "
             f"experts (top {cfg.model.top_k}), d_model {cfg.model.d_model}, ffn {cfg.model.ffn_dim}, "
             f"{cfg.train.dtype}; median over steps ({args.window[0]}, {args.window[1]}] per run, min / median over "
             f"{args.repeats} repeats (order alternating). Predictions: `{args.hardware}` prices compute, "
             "uncalibrated on these runs.", ""]
    medians: dict[str, dict[str, tuple[float, float]]] = {}  # topology -> mode -> (step, EP wait) medians
    tables = []
    for topo in args.topology:
        emu_args, links = [], None
        if topo != "none":
            prof, node = parse_topology(topo)
            emu_args = ["--parallel.emulate", prof, "--parallel.emulate_node_size", str(node)]
            c = load_config(args.config, overrides + emu_args)
            links = emulate.link_model(c)  # the dilation, measured once here and passed to every run
            emu_args += ["--parallel.emulate_dilation", f"{links.dilation:.6g}"]
        runs: dict[str, list[dict]] = {k: [] for k in modes}
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.repeats):
                for i, mode in enumerate(modes if r % 2 == 0 else modes[::-1]):
                    base = ["--config", args.config, *overrides, *emu_args, *mode_args(mode)]
                    res = run_layout(1, args.pp, args.ep, args.schedule, M, m, args.steps, Path(tmp) / f"r{r}_{i}",
                                     base, args.timeout)
                    runs[mode].append(summarise(res, tuple(args.window)))
                    print(f"{topo} repeat {r} {mode}: step {runs[mode][-1]['step_time_s'] * 1e3:.0f} ms, "
                          f"EP wait {runs[mode][-1]['ep_wait_s'] * 1e3:.0f} ms", flush=True)
        med = {k: (statistics.median(x["step_time_s"] for x in runs[k]),
                   statistics.median(x["ep_wait_s"] for x in runs[k])) for k in modes}
        medians[topo] = med
        rows = []
        for k in modes:
            step_min = min(x["step_time_s"] for x in runs[k])
            wait_min = min(x["ep_wait_s"] for x in runs[k])
            pred_step, pred_ep = _predict(cfg, args.ep, M, m, k, links, args.hardware, args.pp, args.schedule)
            rows.append((k, step_min, wait_min, pred_step, pred_ep))
        tables.append((topo, links, rows))
    free = medians.get("none")
    for topo, links, rows in tables:
        med = medians[topo]
        title = "this machine, no emulation" if links is None else links.describe()
        with_free = free is not None and links is not None
        lines += [f"## {title}", "", "| mode | step ms min / med | EP wait ms min / med | step ÷ off (med) | "
                  "EP wait ÷ off (med) | " + ("step − free ms (÷ off) | " if with_free else "")
                  + "predicted step ms | predicted EP ms | step error | EP error |",
                  "|---|---:|---:|---:|---:|" + ("---:|" if with_free else "") + "---:|---:|---:|---:|"]
        for k, step_min, wait_min, pred_step, pred_ep in rows:
            extra = ""
            if with_free:
                gap, gap_off = med[k][0] - free[k][0], med["off"][0] - free["off"][0]
                extra = f"{gap * 1e3:.0f} ({gap / max(gap_off, 1e-9):.3f}) | "
            lines.append(f"| {k} | {step_min * 1e3:.0f} / {med[k][0] * 1e3:.0f} | {wait_min * 1e3:.0f} / "
                         f"{med[k][1] * 1e3:.0f} | {med[k][0] / med['off'][0]:.3f} | "
                         f"{med[k][1] / max(med['off'][1], 1e-9):.3f} | {extra}{pred_step * 1e3:.0f} | "
                         f"{pred_ep * 1e3:.0f} | {100 * (pred_step / med[k][0] - 1):+.0f}% | "
                         f"{100 * (pred_ep / max(med[k][1], 1e-9) - 1):+.0f}% |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


# --- `--interleaved N`: off and lanes step by step in one launch (what load moves, it moves for both) -----------------
def _interleaved_rank(rank: int, world: int, cfg, pp: int, ep: int, schedule: str, M: int, m: int, steps: int,
                      dilation: float) -> list[dict]:
    """One rank of `interleaved`: the stage (no DP, no optimizer: forwards and backwards only), stepped alternately
    without and with the lanes on the same model and batches; per step the wall time, this process's CPU time (all
    its threads, gloo's included) and the exposed EP wait (off: comm.py's EP wait; lanes: StepStats.ep_exposed_s)."""
    import time

    import torch

    from ..model.spec import build_shard_spec
    from ..model.transformer import Transformer
    from ..parallel import comm
    from ..parallel.dims import ParallelDims
    from ..parallel.ep import apply_ep
    from ..parallel.pp import pipeline_forward_backward
    from ..parallel.pp_comms import StageComms

    torch.set_num_threads(1)
    cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.schedule = pp, ep, schedule
    if cfg.parallel.emulate:
        cfg.parallel.emulate_dilation = dilation
        emulate.install(emulate.link_model(cfg, rank))
    dims = ParallelDims(1, pp, ep, rank=rank).build_groups(timeout_s=600).build_backward_ep_groups(timeout_s=600)
    model = apply_ep(Transformer(cfg.model, build_shard_spec(cfg, dims.pp_rank, dims.ep_rank), cfg.train.seed), dims,
                     lanes=True)
    g = torch.Generator().manual_seed(1 + dims.ep_rank)
    S, V, D = cfg.train.seq_len, cfg.model.vocab_size, cfg.model.d_model
    xs = [torch.randint(0, V, (m, S), generator=g) for _ in range(M)]
    comms = StageComms(dims, (m, S, D), torch.float32, "cpu")
    rows = []
    for step in range(2 * steps):
        lanes = step % 2 == 1
        comm.COMM.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        st = pipeline_forward_backward(model, dims, xs, xs, comms=comms, schedule=schedule, aux_weight=0.01,
                                       loss_scale=1.0 / M, before_backward=None, ep_lanes=lanes)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        model.zero_grad(set_to_none=True)
        rows.append({"lanes": lanes, "step_s": wall, "cpu_s": cpu,
                     "ep_exposed_s": comm.COMM.wait_s["ep"], "overlap_s": st.lanes_overlap_s})
    emulate.install(None)
    return rows


def interleaved(cfg, pp: int, ep: int, schedule: str, M: int, m: int, steps: int, topology: str,
                timeout: float) -> str:
    """Off and lanes alternating step by step in one launch of pp*ep ranks; a markdown table of min / median over
    the steps after the first pair: the slowest rank's wall per step, the CPU time summed over ranks, rank 0's
    exposed EP wait."""
    import statistics

    from ..spawn import run_ranks

    cfg = copy.deepcopy(cfg)
    dilation, title = 0.0, "this machine, no emulation"
    if topology != "none":
        prof, node = parse_topology(topology)
        cfg.parallel.emulate, cfg.parallel.emulate_node_size = prof, node
        links = emulate.link_model(cfg)
        dilation, title = links.dilation, links.describe()
    per_rank = run_ranks(_interleaved_rank, pp * ep, args=(cfg, pp, ep, schedule, M, m, steps, dilation),
                         timeout=timeout, pg_timeout=timeout)
    lines = [f"### {title}: PP{pp}·EP{ep} {schedule}, M={M}, m={m}, {steps} steps each, alternating", "",
             "| mode | step ms min / med | CPU s per step (all ranks) min / med | exposed EP wait ms min / med | "
             "F/B overlap ms med |", "|---|---:|---:|---:|---:|"]
    med = {}
    for lanes in (False, True):
        idx = [i for i, r in enumerate(per_rank[0]) if r["lanes"] == lanes][1:]  # the first of each: warm-up
        step = [max(rows[i]["step_s"] for rows in per_rank) for i in idx]
        cpu = [sum(rows[i]["cpu_s"] for rows in per_rank) for i in idx]
        wait = [per_rank[0][i]["ep_exposed_s"] for i in idx]
        over = [per_rank[0][i]["overlap_s"] for i in idx]
        med[lanes] = (min(step), statistics.median(step), min(cpu), statistics.median(cpu), min(wait),
                      statistics.median(wait))
        lines.append(f"| {'lanes' if lanes else 'off'} | {min(step) * 1e3:.0f} / {statistics.median(step) * 1e3:.0f}"
                     f" | {min(cpu):.2f} / {statistics.median(cpu):.2f} | {min(wait) * 1e3:.0f} / "
                     f"{statistics.median(wait) * 1e3:.0f} | {statistics.median(over) * 1e3:.0f} |")
    r = [a / max(b, 1e-12) for a, b in zip(med[True], med[False])]
    lines += ["", f"lanes ÷ off: step {r[0]:.3f} (min) / {r[1]:.3f} (med), CPU {r[2]:.3f} / {r[3]:.3f}, exposed EP "
              f"wait {r[4]:.3f} / {r[5]:.3f}", ""]
    return "\n".join(lines)
