"""`nanotitan plan`: the ranked table and recommendation for a world size, `--measure` (profile this machine)
and `--calibrate` (fit a profile to `nanotitan bench layouts` output). Usage: docs/planner.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config.config import ConfigError, load_config
from ..config.hardware import detect_hardware, save_hardware
from ..config.hf_config import resolve_model
from .fit.calibrate import (calibrate, calibration_rows, fit_expert_skew, fit_profile, format_calibration,
                        format_peak_check, peak_tensor_check)
from .cost import PlanOptions
from .search import plan
from .table import batch_changes, format_table, layout_rows, no_layout, reason
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
    ap.add_argument("--calibrate-machine", action="store_true",
                    help="calibrate the planner on this machine and cache it for this machine kind: `bench layouts` "
                         "at --fit-ranks under an emulated network (default 4 nodes of 2 over 100 Gb/s), the time "
                         "constants and interval composition fitted to those steps, and checked on layouts the fit "
                         "never saw (the coverage of the 80%% intervals, the median error). Needs a quiet machine; "
                         "~15 min with the defaults")
    ap.add_argument("--fit-ranks", type=int, nargs="+", default=[2, 4, 8], metavar="N",
                    help="with --calibrate-machine: the world sizes the fit measures (every layout of each)")
    ap.add_argument("--holdout-ranks", type=int, nargs="+", default=[8], metavar="N",
                    help="with --calibrate-machine: the world sizes of the check: each of their layouts predicted by "
                         "a fit to all the other layouts (or, with --holdout, those files' layouts); 0: no check")
    ap.add_argument("--steps", type=int, default=14, help="with --calibrate-machine: steps per measured layout")
    ap.add_argument("--from", dest="fit_from", nargs="+", default=[], metavar="LAYOUTS_JSON",
                    help="with --calibrate-machine: fit these `bench layouts` files (their rows of --fit-ranks) "
                         "instead of measuring")
    ap.add_argument("--holdout", nargs="+", default=[], metavar="LAYOUTS_JSON",
                    help="with --calibrate-machine: score these `bench layouts` files (their rows of "
                         "--holdout-ranks) instead of measuring")
    ap.add_argument("--no-save", action="store_true", help="with --calibrate-machine: fit and score, cache nothing")
    ap.add_argument("--peaks", default="", metavar="LAYOUTS_JSON",
                    help="the planner's per-rank peak of live tensor bytes (save transient included) against each "
                         "layout's measured step high-water mark in `nanotitan bench layouts` output (its --config)")
    ap.add_argument("--out", default="",
                    help="with --measure/--calibrate: profile JSON path; else: also write the table there")
    ap.add_argument("--top", type=int, default=15, help="rows of the ranked table to print")
    ap.add_argument("--global-batch", type=int, default=0, help="sequences per step (default: the config's dp*ep*M*m)")
    ap.add_argument("--micro-batch", default="", metavar="M|any",
                    help="sequences per microbatch m to plan (default: the config's train.micro_batch, so every "
                         "layout trains the config's model; 'any': every m that divides the batch, each change of m "
                         "named as the different model it trains)")
    ap.add_argument("--precision", default="", choices=["", *PRECISIONS],
                    help="state/activation bytes (default: train.dtype's; --what-if's dry run builds only that one)")
    ap.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                    help="plan only this parallel.zero level (default: every level a layout allows)")
    ap.add_argument("--zero1", action="store_true", help="same as --zero 1 (old name)")
    ap.add_argument("--tp", type=int, default=0, help="plan only this parallel.tp degree (default: every one)")
    ap.add_argument("--cp", type=int, default=0, help="plan only this parallel.cp degree (default: every one that "
                    "splits train.seq_len into 2*cp chunks; parallel.cp_impl from the config)")
    ap.add_argument("--activation-checkpointing", choices=["config", "true", "false"], default="config")
    ap.add_argument("--doc-len-mean", type=float, default=0.0, metavar="L",
                    help="price document-masked attention (model.attn_mask doc) for documents of mean length L "
                         "(geometric), and the CP split's balance over them (plan/docs.py)")
    ap.add_argument("--doc-data", default="", metavar="DIR",
                    help="as --doc-len-mean, with the documents of a prepared data directory's train.bin")
    ap.add_argument("--ep-overlap", type=float, default=0.0, help="fraction of all-to-all hidden by compute (0: ours)")
    ap.add_argument("--expert-skew", type=float, default=None,
                    help="routing skew behind the busiest EP rank's peak: the CV of an expert's share of a "
                         "microbatch's assignments (default: plan.cost.EXPERT_SKEW, from the calibration; 0: a "
                         "balanced router; unused where model.capacity_factor bounds it)")
    ap.add_argument("--host-sync-us", type=float, default=None, metavar="US",
                    help="with --what-if: what one host read of a device value costs a step, in microseconds, "
                         "where the what-if sets static EP dispatch against dynamic (default: 0 on a CPU profile, "
                         "plan.dispatch.HOST_SYNC_S on an accelerator, not measured)")
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
        if args.calibrate_machine:
            return _calibrate_machine(args, overrides)
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
        _note_uncalibrated(hw)
        preds = plan(cfg, args.ranks, hw, opts)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not preds:
        print(f"error: {no_layout(args.ranks, opts.global_batch or cfg.layout_batch, opts.micro_batch)}",
              file=sys.stderr)
        return 2
    shape = ModelShape.from_config(cfg, **extra)
    B = opts.global_batch or cfg.layout_batch
    rows = layout_rows(preds)
    head = (f"{shape.total_params() / 1e9:.3g}B params, {B} x {shape.seq_len} tokens/step on {args.ranks} x {hw.name} "
            f"({len(preds)} (layout, schedule, zero) variants planned, {sum(p.fits for p in preds)} fit; "
            f"{_m_scope(opts)})")
    text = f"{head}\n\n{format_table(rows, args.top, cfg)}\n\n{_recommendation(cfg, rows, opts)}\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


def _note_uncalibrated(hw) -> None:
    """One line on stderr where this host's CPU profile is priced with another machine's host costs."""
    if hw.cores_per_node and hw.name.startswith("cpu-") and not hw.name.endswith("-calibrated") and \
            hw.name != "cpu-gloo":
        print(f"note: {hw.name}'s host costs are cpu-gloo's, not this machine's: `nanotitan plan --calibrate-machine` "
              f"(on a quiet machine, ~15 min, once per machine kind) fits them and caches the result",
              file=sys.stderr)


def _m_scope(opts: PlanOptions) -> str:
    return f"m = {opts.micro_batch} as configured" if opts.micro_batch else "every m (--micro-batch any)"


def _recommendation(cfg, rows, opts: PlanOptions) -> str:
    """The recommended layout, why, the flags that run it, and each change to the config's batch it makes."""
    rec = next((r for r in rows if r.recommended), None)
    if rec is None:
        return f"No recommendation: {reason(rows)}"
    best = rec.layout
    lines = [f"Recommended (row {rec.rank}): {best.short()} — {reason(rows)}",
             f"  --parallel.dp {best.dp} --parallel.pp {best.pp} --parallel.ep {best.ep} --parallel.schedule "
             f"{best.schedule} --parallel.microbatches {best.microbatches} --train.micro_batch {best.micro_batch} "
             f"--parallel.zero {best.zero} --parallel.tp {best.tp} --parallel.cp {best.cp}"]
    changes = batch_changes(cfg, best, opts)
    lines += ["Changes to the config's batch:"] + [f"  - {c}" for c in changes] if changes else []
    return "\n".join(lines)


def _micro_batch(value: str, cfg) -> int:
    """--micro-batch: '' = the config's m, 'any' = free (0), else that m."""
    if value == "":
        return cfg.train.micro_batch
    if value == "any":
        return 0
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"--micro-batch {value}: give a positive number of sequences, or 'any' for every m")
    return int(value)


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
                       global_batch=args.global_batch, micro_batch=_micro_batch(args.micro_batch, cfg),
                       nodes=args.nodes,
                       ep_overlap=args.ep_overlap, shape_extra=extra, expert_skew=skew,
                       doc_len_mean=args.doc_len_mean, doc_data=args.doc_data,
                       host_sync_s=None if args.host_sync_us is None else 1e-6 * args.host_sync_us)


def _what_if(args, overrides: list[str]) -> int:
    """`--what-if`: plan/whatif.py's report for --nodes x the profile's GPUs per node (or --ranks)."""
    import json

    from .fit.interval import load_sigmas
    from .fit.machine import sigmas_for
    from .whatif import format_what_if, what_if

    cfg = resolve_model(load_config(args.config, overrides))
    hw = detect_hardware(None if args.hardware == "auto" else args.hardware,
                         dtype="bf16" if (args.precision or cfg.train.dtype).startswith("bf16") else "fp32")
    world = args.ranks or (args.nodes or 1) * hw.devices_per_node
    log = None if args.json == "-" else (lambda line: print(line, file=sys.stderr, flush=True))
    _note_uncalibrated(hw)
    report = what_if(cfg, world, hw, _options(args, cfg), load_sigmas(args.sigmas) if args.sigmas else sigmas_for(hw),
                     top=args.top, dry_run=not args.no_dry_run, log=log)
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


def _calibrate_machine(args, overrides: list[str]) -> int:
    """`--calibrate-machine`: measure (or read), fit, check on layouts the fit never saw, cache for this machine kind
    (plan/fit/machine.py). Exits 1 when the check misses its targets."""
    from ..config.hardware import machine_kind, save_calibration
    from .fit import machine

    config = args.config or "configs/bench.toml"
    cfg = resolve_model(load_config(config, overrides))
    fit_files = args.fit_from or [machine.measure(config, tuple(args.fit_ranks), machine.runs_dir(), "fit", overrides,
                                                  args.steps)]
    steps = [s for s in machine.read_steps(fit_files) if s.row.get("world") in args.fit_ranks]
    hw, sig = machine.fit(steps, cfg)
    print(f"machine kind: {machine_kind()}\nfitted on {len(steps)} layouts: "
          + ", ".join(f"{k} {getattr(hw, k):.3g}" for k in machine.FIT_FIELDS)
          + f", reserve {hw.mem_reserved_bytes / 2**20:.0f} MiB, GEMM {hw.peak_flops_fp32 / 1e9:.0f} GFLOP/s per core; "
            f"step bias {sig.step_bias:+.3f}, step sigma {sig.step_sigma:.3f}\n")
    print(machine.format_score(machine.score(steps, cfg, hw, sig), "The fit's own layouts (in sample)"))
    worlds = tuple(w for w in args.holdout_ranks if w)
    if args.holdout:  # other measurements: every layout of --holdout-ranks the fit did not see, by the full fit
        seen = {s.grid + (s.row.get("world"),) for s in steps}
        scored = machine.score([s for s in machine.read_steps(args.holdout) if s.row.get("world") in worlds
                                and s.grid + (s.row.get("world"),) not in seen], cfg, hw, sig)
        title = "Held out: layouts of other measurements the fit never saw"
    else:  # each layout of --holdout-ranks predicted by a fit to all the others
        scored = machine.leave_one_out(steps, cfg, worlds)
        title = f"Held out: each layout of {', '.join(map(str, worlds))} ranks by a fit to all the others"
    ok = True
    if scored:
        print("\n" + machine.format_score(scored, title))
        ok = machine.summary(scored)["meets"]
    if not args.no_save:
        print(f"\ncached for this machine kind: {save_calibration(machine.entry(hw, sig, steps, config))} "
              f"(measurements: {', '.join(map(str, fit_files))})")
    return 0 if ok else 1


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
