"""`nanotitan bench overlap`: EP overlap against the same job without it, on emulated networks and on this machine,
measured side by side and against the planner.

    nanotitan bench overlap [--config configs/mid.toml] [--ep 2] [--pp 1] [--schedule 1f1b] [--chunks 2 4] [--lanes]
                            [--microbatches 1] [--steps 12] [--window 4 12] [--repeats 2]
                            [--topology configs/emulate/h100-100g.json:1 none] [--out FILE] [overrides ...]

`--interleaved N` instead runs off and lanes alternating step by step in one launch per topology (N steps each,
forwards and backwards only): what the machine's load moves, it moves for both, and each step's process CPU time
is reported beside its wall time, with the planner's figures. `--modes off lanes lanes-nofill lanes-w3` picks what
alternates (lanes-nofill: the lanes without the backward lane's weight-gradient fill; lanes-w3: a lane window of at
least 3), `--breakdown` adds where each lanes mode's exposed EP wait goes (`ep_wait_breakdown`, docs/ep.md).
Modes: off; `--chunks N ...`: parallel.ep_overlap with N groups of experts per trip (within one layer call);
`--lanes`: parallel.ep_overlap_microbatches (one microbatch's forward beside another's backward; needs
--microbatches >= 2). For each topology (PROFILE[:RANKS_PER_NODE] as `bench emulate`, or "none": no emulation),
each repeat runs the EP job (dp = 1; pp = 1, or `--pp` stages under `--schedule`) in every mode, in an order that
alternates between repeats, as real `nanotitan train` processes. Per run: the median over the window of the step
time and of the exposed EP wait (`comm_ep_wait_s` of rank 0, the first stage: time an EP call was pending and no
lane computed; with one lane, what the EP calls and waits held the rank). Reported: min and median over repeats, the
ratios against off, and the planner's step time and exposed EP time for the same run (`plan/cost.py`) under the emulated
links (PlanOptions.links_idle). With "none" among the topologies, each emulated mode also gets "step − free": its step
less the same mode's step without emulation, the link time it left exposed measured without the wait columns.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
from pathlib import Path

from .layouts import run_layout
from ..config.config import load_config
from ..observe.runs import ep_wait_breakdown, summarise
from ..parallel.comm import emulate
from ..plan.fit.calibrate import overlap_prediction
from ..resolve import resolve_emulation, resolve_model
from .emulate import parse_topology


def mode_args(mode: str) -> list[str]:
    """The train overrides of a mode: "off", "N groups" (parallel.ep_overlap) or "lanes"."""
    if mode == "off":
        return []
    if mode == "lanes":
        return ["--parallel.ep_overlap_microbatches", "true"]
    return ["--parallel.ep_overlap", "true", "--parallel.ep_chunks", mode.split()[0]]



def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nanotitan bench overlap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/mid.toml")
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages")
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
    ap.add_argument("--modes", nargs="+", default=["off", "lanes"], choices=INTERLEAVED_MODES,
                    help="with --interleaved: the modes alternated (ratios against the first)")
    ap.add_argument("--breakdown", action="store_true",
                    help="with --interleaved: where the lanes' exposed EP wait goes (lane, call, unpaired ends, peer)")
    return ap


def _emit(text: str, out: str) -> int:
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 0


def main(argv: list[str]) -> int:
    ap = _parser()
    args, overrides = ap.parse_known_args(argv)
    if args.interleaved:
        if args.schedule == "interleaved" and not any(o.startswith("--parallel.virtual_stages") for o in overrides):
            overrides = overrides + ["--parallel.virtual_stages", "2"]  # the schedule's chunks per rank
        layout = ["--parallel.pp", str(args.pp), "--parallel.ep", str(args.ep), "--parallel.schedule", args.schedule,
                  "--parallel.microbatches", str(args.microbatches)]
        cfg = resolve_model(load_config(args.config, layout + overrides))
        return _emit("\n".join(interleaved(cfg, args.pp, args.ep, args.schedule, args.microbatches, args.micro_batch,
                                             args.interleaved, topo, args.timeout, tuple(args.modes), args.breakdown)
                                for topo in args.topology), args.out)
    if args.lanes and args.microbatches < 2:
        ap.error("--lanes runs a forward beside another microbatch's backward: --microbatches 2 or more")

    cfg = resolve_model(load_config(args.config, overrides))
    modes = ["off"] + [f"{n} groups" for n in args.chunks] + (["lanes"] if args.lanes else [])
    M, m = args.microbatches, args.micro_batch
    lines = [f"# EP overlap: `nanotitan bench overlap {' '.join(argv)}`", "",
             f"EP={args.ep}, PP={args.pp} ({args.schedule}), M={M} microbatches of m={m} sequences of "
             f"{cfg.train.seq_len}, {cfg.model.num_experts} experts (top {cfg.model.top_k}), "
             f"d_model {cfg.model.d_model}, ffn {cfg.model.ffn_dim}, "
             f"{cfg.train.dtype}; median over steps ({args.window[0]}, {args.window[1]}] per run, min / median over "
             f"{args.repeats} repeats (order alternating). Predictions: `{args.hardware}` prices compute, "
             "uncalibrated on these runs.", ""]
    medians: dict[str, dict[str, tuple[float, float]]] = {}  # topology -> mode -> (step, EP wait) medians
    tables = []
    for topo in args.topology:
        medians[topo], rows, links = _run_topology(args, cfg, overrides, topo, modes)
        tables.append((topo, links, rows))
    return _emit("\n".join(lines + _tables(tables, medians)), args.out)


def _run_topology(args, cfg, overrides: list[str], topo: str, modes: list[str]):
    """Every mode on one topology ("none": this machine as it is), repeats alternating the order: the medians
    {mode: (step s, EP wait s)}, the rows (mode, min step, min EP wait, predicted step, predicted EP) and the
    emulated links (None without emulation)."""
    M, m = args.microbatches, args.micro_batch
    emu_args, links = [], None
    if topo != "none":
        prof, node = parse_topology(topo)
        emu_args = ["--parallel.emulate", prof, "--parallel.emulate_node_size", str(node)]
        c = load_config(args.config, overrides + emu_args)
        links = emulate.link_model(resolve_emulation(c))  # the dilation, measured once here and passed to every run
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
    rows = []
    for k in modes:
        step_min = min(x["step_time_s"] for x in runs[k])
        wait_min = min(x["ep_wait_s"] for x in runs[k])
        pred_step, pred_ep = overlap_prediction(cfg, args.ep, M, m, k, links, args.hardware, args.pp, args.schedule)
        rows.append((k, step_min, wait_min, pred_step, pred_ep))
    return med, rows, links


def _tables(tables: list, medians: dict) -> list[str]:
    """One markdown table per topology: measured against off, against this machine without emulation (when it
    ran), and against the planner's prediction."""
    lines = []
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
    return lines


# --- `--interleaved N`: off and lanes step by step in one launch (what load moves, it moves for both) -----------------
# Modes of `--interleaved`: off; lanes (parallel.ep_overlap_microbatches as the trainer runs it: each backward's
# weight-gradient GEMMs fill its all-to-alls' flight, pp/runner.py `FillRunner`); lanes-nofill (the lanes with
# plain autograd backwards, as before the fill).
INTERLEAVED_MODES = ("off", "lanes", "lanes-nofill", "lanes-w3")  # lanes-w3: a lane window of at least 3


def _interleaved_rank(rank: int, world: int, cfg, pp: int, ep: int, schedule: str, M: int, m: int, steps: int,
                      dilation: float, modes: tuple = ("off", "lanes"), raw: bool = False) -> list[dict]:
    """One rank of `interleaved`: the stage (no DP, no optimizer: forwards and backwards only), stepped through
    `modes` in turn on the same model and batches; per step the wall time, this process's CPU time (all its threads,
    gloo's included) and the exposed EP wait (off: comm.py's EP wait; lanes: StepStats.ep_exposed_s). raw: also
    the lanes' F/B spans and EP records (`ep_wait_breakdown`)."""
    import time

    import torch

    from ..model.spec import build_chunk_specs
    from ..model.transformer import Transformer
    from ..parallel.comm import collectives as comm
    from ..parallel.dims import ParallelDims
    from ..parallel.ep import apply_ep
    from ..parallel.ep import lanes_of
    from ..parallel.pp.schedules import RunOptions, pipeline_forward_backward
    from ..parallel.pp.chunks import StageChunks
    from ..parallel.pp.comms import StageComms

    torch.set_num_threads(1)
    cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.schedule = pp, ep, schedule
    if cfg.parallel.emulate:
        cfg.parallel.emulate_dilation = dilation
        emulate.install(emulate.link_model(cfg, rank))
    dims = ParallelDims(1, pp, ep, rank=rank).build_groups(timeout_s=600).build_backward_ep_groups(timeout_s=600)
    # the stage: one Transformer, or under the interleaved schedule its V chunks (parallel.virtual_stages)
    chunks = [Transformer(cfg.model, spec, cfg.train.seed)
              for spec in build_chunk_specs(cfg, dims.pp_rank, dims.ep_rank)]
    model = apply_ep(chunks[0] if len(chunks) == 1 else StageChunks(chunks), dims, lanes=True)
    g = torch.Generator().manual_seed(1 + dims.ep_rank)
    S, V, D = cfg.train.seq_len, cfg.model.vocab_size, cfg.model.d_model
    xs = [torch.randint(0, V, (m, S), generator=g) for _ in range(M)]
    comms = StageComms(dims, (m, S, D), torch.float32, "cpu")
    rows = []
    for step in range(len(modes) * steps):
        mode = modes[step % len(modes)]
        lanes = mode != "off"
        comm.COMM.reset()
        timeline = [] if raw and lanes else None
        t0, c0 = time.perf_counter(), time.process_time()
        st = pipeline_forward_backward(model, dims, xs, xs, comms=comms, schedule=schedule, aux_weight=0.01,
                                       loss_scale=1.0 / M, before_backward=None,
                                       ep_lanes=lanes_of(model) if lanes else None,
                                       options=RunOptions(timeline=timeline, lanes_fill=mode != "lanes-nofill",
                                                          lanes_window=3 if mode == "lanes-w3" else 2))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        model.zero_grad(set_to_none=True)
        row = {"mode": mode, "lanes": lanes, "step_s": wall, "cpu_s": cpu,
               "ep_exposed_s": comm.COMM.wait_s["ep"], "overlap_s": st.lanes_overlap_s}
        if timeline is not None:
            row["spans"] = [e for e in timeline if e[0] in ("F", "B", "W")]
            row["waits"] = st.ep_waits
        rows.append(row)
    emulate.install(None)
    return rows



def _breakdown_table(per_rank: list[list[dict]], mode: str, M: int, ep: int) -> list[str]:
    """Median over the steps after the first of each rank-0 breakdown figure (rank 1 as the peer)."""
    import statistics

    idx = [i for i, r in enumerate(per_rank[0]) if r["mode"] == mode][1:]
    peer = per_rank[1] if ep == 2 and len(per_rank) > 1 else None
    rows = [ep_wait_breakdown(per_rank[0][i]["spans"], per_rank[0][i]["waits"],
                              peer[i]["waits"] if peer is not None else None, M) for i in idx]
    keys = sorted({k for r in rows for k in r})
    lines = [f"#### where rank 0's exposed EP wait goes ({mode}; median over {len(rows)} steps, ms)", "",
             "| figure | ms |", "|---|---:|"]
    lines += [f"| {k} | {statistics.median(r.get(k, 0.0) for r in rows) * 1e3:.0f} |" for k in keys]
    return lines + [""]


def interleaved(cfg, pp: int, ep: int, schedule: str, M: int, m: int, steps: int, topology: str,
                timeout: float, modes: tuple = ("off", "lanes"), breakdown: bool = False) -> str:
    """`modes` alternating step by step in one launch of pp*ep ranks; a markdown table of min / median over
    the steps after the first round: the slowest rank's wall per step, the CPU time summed over ranks, rank 0's
    exposed EP wait; ratios against the first mode; breakdown: where the lanes' exposed wait goes."""
    import statistics

    from ..run.spawn import run_ranks

    cfg = copy.deepcopy(cfg)
    dilation, title, links = 0.0, "this machine, no emulation", None
    if topology != "none":
        prof, node = parse_topology(topology)
        cfg.parallel.emulate, cfg.parallel.emulate_node_size = prof, node
        links = emulate.link_model(resolve_emulation(cfg))
        dilation, title = links.dilation, links.describe()
    plain = copy.deepcopy(cfg)
    plain.parallel.emulate = ""  # the planner prices the links itself (links.dilated)
    per_rank = run_ranks(_interleaved_rank, pp * ep, args=(cfg, pp, ep, schedule, M, m, steps, dilation, tuple(modes),
                                                           breakdown), timeout=timeout, pg_timeout=timeout)
    lines = [f"### {title}: PP{pp}·EP{ep} {schedule}, M={M}, m={m}, {steps} steps each, {' / '.join(modes)} "
             f"alternating", "",
             "| mode | step ms min / med | CPU s per step (all ranks) min / med | exposed EP wait ms min / med | "
             "F/B overlap ms med | predicted step / EP ms | error step / EP (med) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    med = {}
    for mode in modes:
        idx = [i for i, r in enumerate(per_rank[0]) if r["mode"] == mode][1:]  # the first of each: warm-up
        step = [max(rows[i]["step_s"] for rows in per_rank) for i in idx]
        cpu = [sum(rows[i]["cpu_s"] for rows in per_rank) for i in idx]
        wait = [per_rank[0][i]["ep_exposed_s"] for i in idx]
        over = [per_rank[0][i]["overlap_s"] for i in idx]
        med[mode] = (min(step), statistics.median(step), min(cpu), statistics.median(cpu), min(wait),
                     statistics.median(wait))
        p_step, p_ep = overlap_prediction(plain, ep, M, m, "off" if mode == "off" else "lanes", links, "cpu-gloo", pp,
                                          schedule)
        lines.append(f"| {mode} | {min(step) * 1e3:.0f} / {statistics.median(step) * 1e3:.0f}"
                     f" | {min(cpu):.2f} / {statistics.median(cpu):.2f} | {min(wait) * 1e3:.0f} / "
                     f"{statistics.median(wait) * 1e3:.0f} | {statistics.median(over) * 1e3:.0f} | "
                     f"{p_step * 1e3:.0f} / {p_ep * 1e3:.0f} | {100 * (p_step / statistics.median(step) - 1):+.0f}% / "
                     f"{100 * (p_ep / max(statistics.median(wait), 1e-9) - 1):+.0f}% |")
    lines.append("")
    for mode in modes[1:]:
        r = [a / max(b, 1e-12) for a, b in zip(med[mode], med[modes[0]])]
        lines.append(f"{mode} ÷ {modes[0]}: step {r[0]:.3f} (min) / {r[1]:.3f} (med), CPU {r[2]:.3f} / {r[3]:.3f}, "
                     f"exposed EP wait {r[4]:.3f} / {r[5]:.3f}")
    lines.append("")
    if breakdown:
        for mode in modes:
            if mode != "off":
                lines += _breakdown_table(per_rank, mode, M, ep)
    return "\n".join(lines)
