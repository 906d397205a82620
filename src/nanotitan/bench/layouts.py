"""`nanotitan bench layouts`: the seed's experiment — every DP x PP x EP layout of N ranks at the same
tokens per step, averaged over a window after warm-up, as a markdown table and PNG plots.

    nanotitan bench layouts --ranks 2 4 --steps 60 --window 20 60 [--config FILE] [overrides...]
    nanotitan bench layouts --ranks 2 4 --schedules zb1 interleaved --virtual-stages 2 --pp-only --tag schedules
    nanotitan bench layouts --ranks 8 --parallel.emulate h100-sxm --parallel.emulate_node_size 8 --tag nvlink

Each layout runs as its own `nanotitan train` job (real processes, gloo on CPU); results land in
`docs/experiments/layouts.md`, `memory.md`, `throughput_memory.png`, `memory_per_rank.png`,
`loss_curves.png` and `layouts.json` (`--tag T` names them `layouts_T.json`, ...). `--schedules` runs the
PP layouts under each schedule in turn (pp = 1 layouts once); a layout a schedule cannot run (interleaved needs
M % pp == 0 and n_layers >= pp * V) is skipped with a printed line.

Under an emulated network (`--parallel.emulate PROFILE`, docs/emulate.md) every layout runs with the same dilation
(the automatic one is computed once here and passed on), and the markdown adds the planner's predictions for the
emulated cluster, uncalibrated: the CPU profile (`--hardware`) for compute, the profile's links dilated for
communication (`emulate.LinkModel.dilated`), measured against predicted step time and rank.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from ..config.config import Config, ConfigError, load_config, validate
from ..config.hardware import cached_calibration, machine_kind
from ..observe.runs import TENSOR_KEYS, layout_argv, run_results, summarise
from ..parallel.comm import emulate
from ..parallel.pp import facts as pp_facts
from ..plan import Layout, enumerate_layouts, layout_config
from ..plan.fit.calibrate import emulated_predictions
from ..resolve import resolve_emulation, resolve_model


def layouts_for(cfg: Config, world: int, micro_batch: int, schedule: str) -> list[Layout]:
    """The planner's layouts of `world` ranks (`plan.enumerate_layouts`) at one micro-batch size m and one
    schedule, by (dp, pp, ep). Fixing m (not M) keeps every layout on the same maths: the MoE balance loss is
    per microbatch, so equal (B, m) = equal losses."""
    lays = [lay for lay in enumerate_layouts(cfg, world)
            if lay.micro_batch == micro_batch and (lay.pp == 1 or lay.schedule == schedule)]
    return sorted(lays, key=lambda lay: (lay.dp, lay.pp, lay.ep))


def schedule_layouts(cfg: Config, world: int, micro_batch: int, schedule: str) -> tuple[list[Layout], list[str]]:
    """`layouts_for` under any schedule: zb1/interleaved take the 1F1B layouts' (dp, pp, ep, M, m) and keep those
    config.validate accepts (cfg.parallel.virtual_stages = V), so that the table names each one skipped.
    Returns (layouts, why each skipped one cannot run)."""
    if schedule in ("gpipe", "1f1b"):
        return layouts_for(cfg, world, micro_batch, schedule), []
    keep, skipped = [], []
    for lay in layouts_for(cfg, world, micro_batch, "1f1b"):
        lay = Layout(lay.dp, lay.pp, lay.ep, schedule if lay.pp > 1 else lay.schedule, lay.microbatches,
                     lay.micro_batch, lay.zero)
        try:
            validate(layout_config(cfg, lay), world_size=world)
            keep.append(lay)
        except ConfigError as e:
            skipped.append(f"N{world}_dp{lay.dp}_pp{lay.pp}_ep{lay.ep} {schedule}: {e}")
    return keep, skipped



def calibrate_machine(config: str, overrides: list[str]) -> None:
    """This machine kind has no planner calibration: make one (`nanotitan plan --calibrate-machine`, its fit
    without the held-out check) under the network this bench emulates, before the layouts it predicts."""
    print(f"[bench layouts] no planner calibration for this machine kind ({machine_kind()}): measuring one first, "
          f"once (--no-calibrate skips it)", flush=True)
    cmd = [sys.executable, "-m", "nanotitan.cli", "plan", "--calibrate-machine", "--holdout-ranks", "0",
           "--config", config, *overrides]
    subprocess.run(cmd, check=True)


def run_layout(dp, pp, ep, schedule, M, m, steps, run_dir: Path, base_args: list[str], timeout: float,
               virtual_stages: int = 1) -> dict:
    args = [sys.executable, "-m", "nanotitan.cli", "train",
            *layout_argv(dp, pp, ep, schedule, M, m, steps, run_dir, base_args, virtual_stages)]
    t0 = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"layout dp={dp} pp={pp} ep={ep} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return {**run_results(run_dir), "wall_s": time.perf_counter() - t0}



def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan bench layouts")
    ap.add_argument("--ranks", "--gpus", dest="ranks", type=int, nargs="+", default=[2, 4],
                    help="world sizes to run (--gpus is the old name)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--window", type=int, nargs=2, default=None, help="average steps (a, b]; default last 2/3")
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    ap.add_argument("--schedules", nargs="+", default=None, choices=["1f1b", "gpipe", "zb1", "interleaved"],
                    help="PP layouts under each of these schedules in turn (default: --schedule alone)")
    ap.add_argument("--virtual-stages", type=int, default=2, help="V, model chunks per rank under interleaved")
    ap.add_argument("--pp-only", action="store_true", help="only the layouts with pp > 1")
    ap.add_argument("--tag", default="", help="write layouts_TAG.json, layouts_TAG.md, ... beside the defaults")
    ap.add_argument("--micro-batch", type=int, default=2, help="m, the same for every layout")
    ap.add_argument("--config", default="configs/bench.toml")
    ap.add_argument("--out", default="docs/experiments")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--hardware", default="auto", help="with --parallel.emulate: the CPU profile the planner "
                    "predicts compute with (auto: this host's, calibrated for this machine kind: the first emulated "
                    "run of a machine kind calibrates it, `nanotitan plan --calibrate-machine`)")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="with --parallel.emulate and --hardware auto: predict with this host's profile as it is, "
                         "without calibrating an uncalibrated machine kind first")
    args, overrides = ap.parse_known_args(argv)
    cfg = resolve_model(load_config(args.config, overrides))  # the model the layouts run (init.from_hf's)
    fixed = cfg.parallel.emulate_dilation  # 0: measured below, then passed to every layout
    links = emulate.link_model(resolve_emulation(cfg))  # parallel.emulate (None: off), on train.threads or 1
    if links is not None and not fixed:  # one dilation for every layout, and on record
        overrides = overrides + ["--parallel.emulate_dilation", repr(links.dilation)]
        print(f"[bench layouts] {links.describe()}", flush=True)
    if links is not None and args.hardware == "auto" and not args.no_calibrate and cached_calibration() is None:
        calibrate_machine(args.config, overrides)  # once per machine kind: its predictions below use it
    schedules = args.schedules or [args.schedule]
    if "interleaved" in schedules:
        cfg.parallel.virtual_stages = args.virtual_stages  # what schedule_layouts validates against
    base = [f"--config={args.config}", *overrides]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"_{args.tag}" if args.tag else ""
    window = tuple(args.window) if args.window else (args.steps // 3, args.steps)
    B = cfg.layout_batch
    all_rows, curves = [], {}
    for n in args.ranks:
        todo = []
        for i, sched in enumerate(schedules):
            lays, skipped = schedule_layouts(cfg, n, args.micro_batch, sched)
            for why in skipped:
                print(f"[bench layouts] skip {why}", flush=True)
            todo += [(sched, lay) for lay in lays if lay.pp > 1 or (i == 0 and not args.pp_only)]  # pp=1 once
        for sched, lay in todo:
            dp, pp, ep, M, m = lay.dp, lay.pp, lay.ep, lay.microbatches, lay.micro_batch
            V = pp_facts.virtual_stages(sched, pp, args.virtual_stages)
            name = f"N{n}_dp{dp}_pp{pp}_ep{ep}" + (f"_{sched}" if args.schedules and pp > 1 else "")
            print(f"[bench layouts] {name}: M={M} m={m} ...", flush=True)
            res = run_layout(dp, pp, ep, sched, M, m, args.steps, out / "runs" / name, base, args.timeout, V)
            row = {"world": n, "dp": dp, "pp": pp, "ep": ep, "schedule": sched if pp > 1 else "-",
                   **({"virtual_stages": V} if V > 1 else {}),
                   "M": M, "m": m, **summarise(res, window), "peak_mem_per_rank": [r["peak_mem_bytes"] for r in
                                                                                    res["ranks"]]}
            all_rows.append(row)
            curves[name] = [(r["step"], r["loss"]) for r in res["records"]]
            print(f"   {row['tokens_per_sec']:.0f} tok/s, step {row['step_time_s'] * 1e3:.0f} ms, "
                  f"loss {row['final_loss']:.4f}", flush=True)
    predicted = emulated_predictions(all_rows, cfg, links, args.hardware) if links is not None else None
    emulated = {"profile": cfg.parallel.emulate, "node_size": links.node_size, "dilation": links.dilation,
                "predicted": predicted} if links is not None else None
    (out / f"layouts{tag}.json").write_text(json.dumps({"rows": all_rows, "curves": curves, "window": window,
                                                        "global_batch": B, "seq_len": cfg.train.seq_len,
                                                        **({"emulate": emulated} if emulated else {})}, indent=1))
    max_rel = (_max_rel_diff(curves, 10), _max_rel_diff(curves))
    write_markdown(out / f"layouts{tag}.md", all_rows, window, B, cfg.train.seq_len, args, overrides, max_rel)
    if predicted is not None:
        with open(out / f"layouts{tag}.md", "a") as f:
            f.write("\n" + format_predictions(predicted, links) + "\n")
        print(format_predictions(predicted, links), flush=True)
    write_memory_markdown(out / f"memory{tag}.md", all_rows, B, cfg.train.seq_len, args, overrides)
    plot(out, all_rows, curves, tag)
    print(f"[bench layouts] max relative loss difference across layouts: {max_rel[0]:.2e} over steps 1-10, "
          f"{max_rel[1]:.2e} over all steps")
    print(f"[bench layouts] wrote {out / f'layouts{tag}.md'}")
    return 0



def format_predictions(res: dict, links: emulate.LinkModel) -> str:
    """Measured against predicted step time, with both rankings (1 = fastest), as markdown."""
    rows = res["rows"]
    rank = {k: {id(r): i + 1 for i, r in enumerate(sorted(rows, key=lambda r: r[k]))}
            for k in ("pred_step_s", "meas_step_s")}
    lines = [f"## The planner on the emulated cluster ({links.hardware.name}, nodes of {links.node_size} ranks, "
             f"dilation {links.dilation:.3g}; uncalibrated)", "",
             "| layout | predicted step ms | measured step ms | error | predicted rank | measured rank | "
             "predicted dominant |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {1e3 * r['pred_step_s']:.0f} | {1e3 * r['meas_step_s']:.0f} | "
                     f"{100 * r['step_err']:+.0f}% | {rank['pred_step_s'][id(r)]} | {rank['meas_step_s'][id(r)]} | "
                     f"{r['dominant']} |")
    lines.append(f"\nmedian |error| of step time {100 * res['median_abs_err_step']:.1f}%; Spearman rho "
                 f"{res['spearman_rho']:.2f}")
    return "\n".join(lines)


def _max_rel_diff(curves: dict, max_step: int | None = None) -> float:
    """Largest relative loss difference of any layout from the first one at equal steps (up to max_step)."""
    names = list(curves)
    if len(names) < 2:
        return 0.0
    ref = dict(curves[names[0]])
    worst = 0.0
    for n in names[1:]:
        for step, loss in curves[n]:
            if step in ref and (max_step is None or step <= max_step):
                worst = max(worst, abs(loss - ref[step]) / abs(ref[step]))
    return worst


def write_markdown(path: Path, rows, window, B, S, args, overrides, max_rel):
    mib = 1024 * 1024
    lines = [f"# Layouts at equal tokens per step ({B} x {S} tokens)", "",
             f"Command: `nanotitan bench layouts --ranks {' '.join(map(str, args.ranks))} --steps {args.steps} "
             f"--micro-batch {args.micro_batch}{_schedule_flags(args)} --config {args.config} "
             f"{' '.join(overrides)}`".rstrip() + "",
             "", f"Medians over steps ({window[0]}, {window[1]}]. Tensor memory per rank = live parameters + "
             "gradients + optimizer state + peak saved activations (the rank that holds the most; the split per rank "
             "is drawn in `throughput_memory.png`); RSS = the process's peak resident memory (mostly the Python/torch "
             "runtime on CPU), shown apart. "
             f"Waits are milliseconds per step blocked in each kind of communication (rank 0). "
             f"Max relative loss difference between layouts at equal steps: {max_rel[0]:.1e} over steps 1-10, "
             f"{max_rel[1]:.1e} over all steps (top-k routing near-ties flip under float reassociation and the "
             f"trajectories drift apart once the LR peaks; one layout at 1 vs 2 threads drifts the same way, 2e-4 "
             f"by step 40). Loss curves: `loss_curves.png`; throughput and memory: `throughput_memory.png`.", "",
             "| N | dp | pp | ep | sched | M x m | tokens/s | step ms | MFU | tensor mem/rank MiB (max) | "
             "RSS/rank MiB (max) | DP wait ms | EP wait ms | PP wait ms | bubble | final loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bub = f"{r['bubble']:.2f}" if r["bubble"] is not None else "-"
        tensor = f"{r['tensor_mem_max'] / mib:.2f}" if r.get("tensor_mem_max") is not None else "-"
        lines.append(f"| {r['world']} | {r['dp']} | {r['pp']} | {r['ep']} | {r['schedule']} | {r['M']} x {r['m']} | "
                     f"{r['tokens_per_sec']:.0f} | {r['step_time_s'] * 1e3:.0f} | {100 * r['mfu']:.1f}% | {tensor} | "
                     f"{r['peak_mem_max'] / mib:.0f} | {r['dp_wait_s'] * 1e3:.0f} | {r['ep_wait_s'] * 1e3:.0f} | "
                     f"{r['pp_wait_s'] * 1e3:.0f} | {bub} | {r['final_loss']:.4f} |")
    path.write_text("\n".join(lines) + "\n")


def write_memory_markdown(path: Path, rows, B, S, args, overrides):
    """What each rank of each layout keeps, in MiB: the figures of `memory_per_rank.png`, and RSS beside them."""
    mib = 2**20
    lines = [f"# Memory per rank of every layout ({B} x {S} tokens per step)", "",
             f"Command: `nanotitan bench layouts --ranks {' '.join(map(str, args.ranks))} --steps {args.steps} "
             f"--micro-batch {args.micro_batch}{_schedule_flags(args)} --config {args.config} "
             f"{' '.join(overrides)}`".rstrip(), "",
             "Live tensors at the end of the run (each storage once) and the peak bytes autograd saved for backward "
             "in a step; RSS is the process's peak resident memory (on CPU mostly the Python/torch runtime). "
             "Picture: `memory_per_rank.png`.", "",
             "| N | dp/pp/ep | sched | M x m | rank | params | grads | optimizer | activations (peak) | tensors "
             "| RSS |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for rank, (t, rss) in enumerate(zip(r.get("tensor_mem_per_rank") or [], r["peak_mem_per_rank"])):
            if None in t.values():
                continue
            cells = [f"{t[k] / mib:.2f}" for k in TENSOR_KEYS] + [f"{sum(t.values()) / mib:.2f}", f"{rss / mib:.0f}"]
            lines.append(f"| {r['world']} | {r['dp']}/{r['pp']}/{r['ep']} | {r['schedule']} | {r['M']} x {r['m']} | "
                         f"{rank} | " + " | ".join(cells) + " |")
    path.write_text("\n".join(lines) + "\n")


def _schedule_flags(args) -> str:
    """The schedule flags of the command line ("" for the default run, so its markdown is unchanged)."""
    if not args.schedules:
        return ""
    v = f" --virtual-stages {args.virtual_stages}" if "interleaved" in args.schedules else ""
    return f" --schedules {' '.join(args.schedules)}{v}" + (" --pp-only" if args.pp_only else "")


def plot(out: Path, rows, curves, tag: str = ""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"N{r['world']} {r['dp']}/{r['pp']}/{r['ep']}" for r in rows]
    width = max(9, 0.18 * sum(len(r["peak_mem_per_rank"]) for r in rows) + 2)
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(width, 8.5))
    a1.bar(labels, [r["tokens_per_sec"] for r in rows], color="tab:blue")
    a1.set_title("throughput (tokens/s)")
    a1.tick_params(axis="x", rotation=30)
    plot_memory(a2, rows, labels)
    fig.tight_layout()
    fig.savefig(out / f"throughput_memory{tag}.png", dpi=110)
    fig, ax = plt.subplots(figsize=(width, 4.5))  # the memory panel alone
    plot_memory(ax, rows, labels)
    fig.tight_layout()
    fig.savefig(out / f"memory_per_rank{tag}.png", dpi=110)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in curves.items():
        ax.plot([s for s, _ in pts], [l for _, l in pts], label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss curves of all layouts (same global batch)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / f"loss_curves{tag}.png", dpi=110)


def plot_memory(ax, rows, labels):
    """One stacked bar per rank, grouped by layout: parameters, gradients, optimizer state and peak saved
    activations — what the layout keeps on each rank. Falls back to RSS when the run did not record tensors."""
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    x, centers = 0.0, []
    for row in rows:
        ranks = row.get("tensor_mem_per_rank") or [{}] * len(row["peak_mem_per_rank"])
        xs = [x + i for i in range(len(ranks))]
        if all(None not in r.values() and r for r in ranks):
            bottom = [0.0] * len(ranks)
            for (key, name), color in zip(TENSOR_KEYS.items(), colors):
                h = [r[key] / 2**20 for r in ranks]
                ax.bar(xs, h, bottom=bottom, width=0.8, color=color, label=name if row is rows[0] else None)
                bottom = [b + v for b, v in zip(bottom, h)]
        else:
            ax.bar(xs, [m / 2**20 for m in row["peak_mem_per_rank"]], width=0.8, color="tab:gray",
                   label="peak RSS (no tensor figures)" if row is rows[0] else None)
        centers.append((xs[0] + xs[-1]) / 2)
        x += len(ranks) + 1.5  # a gap between layouts
    ax.set_xticks(centers, labels, rotation=30)
    ax.set_xlabel("N dp/pp/ep (one bar per rank, in rank order)")
    ax.set_ylabel("MiB")
    ax.set_title("memory each rank keeps: live tensors and peak saved activations (RSS apart: memory.md)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
