"""`nanotitan plan`: the ranked table and recommendation for a world size, `--measure` (profile this machine)
and `--calibrate` (fit a profile to `nanotitan bench layouts` output). Usage: docs/planner.md."""

from __future__ import annotations

import argparse
import sys

from ..config.config import ConfigError, load_config
from ..config.hardware import detect_hardware, save_hardware
from ..config.hf_config import resolve_model
from .fit.calibrate import (calibrate, calibration_rows, fit_expert_skew, fit_profile, format_calibration,
                        format_peak_check, peak_tensor_check)
from .cost import PlanOptions
from .search import format_table, plan, reason
from .shape import PRECISIONS, ModelShape


def _parser() -> argparse.ArgumentParser:
    from ..config.help import config_help

    ap = argparse.ArgumentParser(prog="nanotitan plan", description="Predict memory and step time of every "
                                 "DP x PP x EP x TP x CP layout, rank them, pick one. Config keys "
                                 "(--section.key VALUE) describe the model and batch.", epilog=config_help(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="TOML config (model, train.seq_len, global batch = dp*ep*M*m)")
    ap.add_argument("--ranks", "--gpus", dest="ranks", type=int,
                    help="world size N to plan for: GPUs, or processes on CPU (--gpus is the old name)")
    ap.add_argument("--nodes", type=int, default=0, help="nodes the N ranks fill in order (default: by the profile)")
    ap.add_argument("--hardware", default="auto", help="built-in profile name or a JSON profile file (auto: detect)")
    ap.add_argument("--measure", action="store_true", help="measure this machine and write a profile to --out")
    ap.add_argument("--dry-run", action="store_true",
                    help="build every distinct rank of the config's layout at --ranks N with the real code on fake "
                         "tensors and a fake process group; report each rank's bytes against the planner's")
    ap.add_argument("--json", nargs="?", const="-", default="", metavar="FILE",
                    help="with --dry-run: every rank's bytes as JSON; with --what-if: the report as JSON (to FILE, "
                         "or to stdout without one)")
    ap.add_argument("--what-if", action="store_true",
                    help="one report for a cluster (--hardware, --nodes; --ranks defaults to nodes x GPUs per node): "
                         "does the config fit (the dry run of the best layout, its worst rank), the best layouts with "
                         "tokens/s, step time and 80%% intervals, what dominates and what to change")
    ap.add_argument("--no-dry-run", action="store_true", help="with --what-if: the planner's memory only (faster)")
    ap.add_argument("--sigmas", default="", metavar="FILE",
                    help="interval sigmas (bench plan_intervals' JSON; default: plan.fit.interval.FITTED)")
    ap.add_argument("--skew-from", default="", metavar="METRICS_JSONL",
                    help="the routing skew a run recorded (its metrics.jsonl: ep_recv_max_mean) as --expert-skew")
    ap.add_argument("--calibrate", default="", metavar="LAYOUTS_JSON",
                    help="fit --hardware's time constants and memory reserve to `nanotitan bench layouts` output "
                         "(with its --config) and write the calibrated profile to --out")
    ap.add_argument("--peaks", default="", metavar="LAYOUTS_JSON",
                    help="the planner's per-rank peak of live tensor bytes (save transient included) against each "
                         "layout's measured step high-water mark in `nanotitan bench layouts` output (its --config)")
    ap.add_argument("--out", default="",
                    help="with --measure/--calibrate: profile JSON path; else: also write the table there")
    ap.add_argument("--top", type=int, default=15, help="rows of the ranked table to print")
    ap.add_argument("--global-batch", type=int, default=0, help="sequences per step (default: the config's dp*ep*M*m)")
    ap.add_argument("--micro-batch", type=int, default=0, help="keep m fixed (default: free)")
    ap.add_argument("--precision", default="", choices=["", *PRECISIONS],
                    help="state/activation bytes (default: train.dtype's; --what-if's dry run builds only that one)")
    ap.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                    help="plan only this parallel.zero level (default: every level a layout allows)")
    ap.add_argument("--zero1", action="store_true", help="same as --zero 1 (old name)")
    ap.add_argument("--tp", type=int, default=0, help="plan only this parallel.tp degree (default: every one)")
    ap.add_argument("--cp", type=int, default=0, help="plan only this parallel.cp degree (default: every one that "
                    "splits train.seq_len into 2*cp chunks; parallel.cp_impl from the config)")
    ap.add_argument("--activation-checkpointing", choices=["config", "true", "false"], default="config")
    ap.add_argument("--ep-overlap", type=float, default=0.0, help="fraction of all-to-all hidden by compute (0: ours)")
    ap.add_argument("--expert-skew", type=float, default=None,
                    help="routing skew behind the busiest EP rank's peak: the CV of an expert's share of a "
                         "microbatch's assignments (default: plan.cost.EXPERT_SKEW, from the calibration; 0: a "
                         "balanced router; unused where model.capacity_factor bounds it)")
    ap.add_argument("--first-dense", type=int, default=0, help="first k layers dense (models beyond our Transformer)")
    ap.add_argument("--dense-ffn", type=int, default=0, help="hidden size of dense FFN layers (default model.ffn_dim)")
    ap.add_argument("--shared-experts", type=int, default=0, help="always-on experts per MoE layer")
    return ap


def main(argv: list[str]) -> int:
    args, overrides = _parser().parse_known_args(argv)
    try:
        if args.measure:
            from .fit.measure import measure_hardware  # spawns processes: imported only when asked

            out = args.out or "hardware.json"
            hw = measure_hardware(out)
            print(f"wrote {out}: {hw.name}, GEMM {hw.gemm_flops_by_threads}, "
                  f"all-reduce {hw.intra.allreduce_bw / 1e9:.2f} GB/s, reserve {hw.mem_reserved_bytes / 2**20:.0f} MiB")
            return 0
        if args.calibrate:
            if args.hardware == "auto" or not args.out:
                raise ConfigError("--calibrate needs --hardware PROFILE (the profile to fit) and --out NEW_PROFILE")
            cfg = resolve_model(load_config(args.config, overrides))  # the config `bench layouts` ran
            rows = calibration_rows(args.calibrate)
            hw = fit_profile(rows, cfg, args.hardware)
            save_hardware(hw, args.out)
            res = calibrate(rows, cfg, hw)
            print(f"wrote {args.out}: {hw.source}\n\n{format_calibration(res)}")
            return 0
        if args.peaks:
            cfg = resolve_model(load_config(args.config, overrides))  # the config `bench layouts` ran
            rows, opts = calibration_rows(args.peaks), PlanOptions(expert_skew=args.expert_skew)
            print(format_peak_check(peak_tensor_check(rows, cfg, args.hardware, opts)))
            skew, each = fit_expert_skew(rows, cfg, args.hardware, opts)
            if each:  # what these rows measure of the routing skew, for --expert-skew or EXPERT_SKEW
                print(f"\nrouting skew that matches each EP layout's peak: median {skew:.3f} "
                      f"(range {min(each):.3f}-{max(each):.3f} over {len(each)} layouts)")
            return 0
        if args.what_if:
            return _what_if(args, overrides)
        if not args.ranks:
            raise ConfigError("nanotitan plan needs --ranks N (the world size to plan for)")
        if args.dry_run:
            return _dry_run(args, overrides)
        cfg = resolve_model(load_config(args.config, overrides))  # the model (init.from_hf's); the layout is ours
        hw = detect_hardware(None if args.hardware == "auto" else args.hardware,
                             dtype="bf16" if (args.precision or cfg.train.dtype).startswith("bf16") else "fp32")
        opts = _options(args, cfg)
        extra = opts.shape_extra
        preds = plan(cfg, args.ranks, hw, opts)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not preds:
        print(f"error: no valid layout of {args.ranks} ranks for this config at global batch "
              f"{opts.global_batch or cfg.layout_batch} sequences; set --global-batch to one that dp*ep*M*m can hold",
              file=sys.stderr)
        return 2
    shape = ModelShape.from_config(cfg, **extra)
    B = opts.global_batch or cfg.layout_batch
    head = (f"{shape.total_params() / 1e9:.3g}B params, {B} x {shape.seq_len} tokens/step on {args.ranks} x {hw.name} "
            f"({len(preds)} layouts, {sum(p.fits for p in preds)} fit)")
    best = preds[0].layout
    rec = (f"Recommended: {best.short()} — {reason(preds)}\n  --parallel.dp {best.dp} --parallel.pp {best.pp} "
           f"--parallel.ep {best.ep} --parallel.schedule {best.schedule} --parallel.microbatches {best.microbatches} "
           f"--train.micro_batch {best.micro_batch} --parallel.zero {best.zero} --parallel.tp {best.tp} "
           f"--parallel.cp {best.cp}")
    text = f"{head}\n\n{format_table(preds, args.top)}\n\n{rec}\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


def _options(args, cfg) -> PlanOptions:
    """PlanOptions from the command line (--skew-from: the skew a run recorded, plan/skew.py)."""
    extra = {k: v for k, v in (("first_dense", args.first_dense), ("dense_ffn_dim", args.dense_ffn),
                               ("n_shared_experts", args.shared_experts)) if v}
    ac = None if args.activation_checkpointing == "config" else args.activation_checkpointing == "true"
    skew = args.expert_skew
    if args.skew_from:
        from .skew import measured_skew

        skew = measured_skew(args.skew_from, cfg.model.num_experts)
        print(f"routing skew from {args.skew_from}: sigma {skew:.3f}", file=sys.stderr)
    return PlanOptions(precision=args.precision, zero=args.zero, zero1=args.zero1, tp=args.tp, cp=args.cp,
                       activation_checkpointing=ac,
                       global_batch=args.global_batch, micro_batch=args.micro_batch, nodes=args.nodes,
                       ep_overlap=args.ep_overlap, shape_extra=extra, expert_skew=skew)


def _what_if(args, overrides: list[str]) -> int:
    """`--what-if`: plan/whatif.py's report for --nodes x the profile's GPUs per node (or --ranks)."""
    import json

    from .fit.interval import load_sigmas
    from .whatif import format_what_if, what_if

    cfg = resolve_model(load_config(args.config, overrides))
    hw = detect_hardware(None if args.hardware == "auto" else args.hardware,
                         dtype="bf16" if (args.precision or cfg.train.dtype).startswith("bf16") else "fp32")
    world = args.ranks or (args.nodes or 1) * hw.devices_per_node
    log = None if args.json == "-" else (lambda line: print(line, file=sys.stderr, flush=True))
    report = what_if(cfg, world, hw, _options(args, cfg), load_sigmas(args.sigmas or None), top=args.top,
                     dry_run=not args.no_dry_run, log=log)
    if args.json:
        text = json.dumps(report, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.json != "-":
        print(format_what_if(report))
    return 0 if report["layouts"] else 2


def _dry_run(args, overrides: list[str]) -> int:
    """`--dry-run`: the config's own layout at --ranks N, every distinct rank built (plan/dryrun.py)."""
    import json

    from .dryrun import compare_with_planner, dry_run, format_comparison, launch_config

    cfg = launch_config(load_config(args.config, overrides), args.ranks)
    p = cfg.parallel
    hw = detect_hardware(None if args.hardware == "auto" else args.hardware,
                         dtype="bf16" if cfg.train.dtype == "bf16" else "fp32")
    print(f"dry run: dp={p.dp} pp={p.pp} ep={p.ep} tp={p.tp} cp={p.cp} {p.schedule} M={p.microbatches} "
          f"m={cfg.train.micro_batch} zero={p.zero} on {args.ranks} ranks (fake process group, fake tensors)",
          flush=True)
    run = dry_run(cfg, args.ranks, log=lambda line: print(line, flush=True))
    opts = PlanOptions(nodes=args.nodes)
    print(f"\n{len(run.classes)} distinct ranks of {args.ranks} built in {run.seconds:.1f} s. Bytes per rank, from the "
          f"code / the planner ({hw.name}, {cfg.train.dtype}):\n")
    print(format_comparison(compare_with_planner(run, hw, opts)))
    nodes = args.nodes or -(-args.ranks // hw.devices_per_node)
    limit = hw.mem_per_rank(min(args.ranks, -(-args.ranks // nodes)))
    over = run.first_over(limit, hw.mem_reserved_bytes)
    if over is None:
        print(f"\nevery rank fits: peak + {hw.mem_reserved_bytes / 2**30:.1f} GiB reserved <= {limit / 2**30:.1f} GiB")
    else:
        print(f"\nrank {over['rank']} {tuple(over['coords'])} is the first over {hw.name}'s memory: "
              f"{over['peak_bytes'] / 2**30:.2f} GiB peak + {hw.mem_reserved_bytes / 2**30:.1f} GiB reserved > "
              f"{limit / 2**30:.1f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": run.rows()}, f)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
