"""`nanotitan plan`: the ranked table and recommendation for a world size, `--measure` (profile this machine)
and `--calibrate` (fit a profile to `nanotitan bench layouts` output). Usage: docs/planner.md."""

from __future__ import annotations

import argparse
import sys

from ..config import ConfigError, load_config
from ..hardware import detect_hardware, save_hardware
from .calibrate import calibrate, calibration_rows, fit_profile, format_calibration
from .cost import PlanOptions
from .search import format_table, plan, reason
from .shape import PRECISIONS, ModelShape


def main(argv: list[str]) -> int:
    from ..config_help import config_help

    ap = argparse.ArgumentParser(prog="nanotitan plan", description="Predict memory and step time of every "
                                 "DP x PP x EP layout, rank them, pick one. Config keys (--section.key VALUE) "
                                 "describe the model and batch.", epilog=config_help(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="TOML config (model, train.seq_len, global batch = dp*ep*M*m)")
    ap.add_argument("--ranks", "--gpus", dest="ranks", type=int,
                    help="world size N to plan for: GPUs, or processes on CPU (--gpus is the old name)")
    ap.add_argument("--nodes", type=int, default=0, help="nodes the N ranks fill in order (default: by the profile)")
    ap.add_argument("--hardware", default="auto", help="built-in profile name or a JSON profile file (auto: detect)")
    ap.add_argument("--measure", action="store_true", help="measure this machine and write a profile to --out")
    ap.add_argument("--calibrate", default="", metavar="LAYOUTS_JSON",
                    help="fit --hardware's time constants and memory reserve to `nanotitan bench layouts` output "
                         "(with its --config) and write the calibrated profile to --out")
    ap.add_argument("--out", default="", help="with --measure/--calibrate: profile JSON path; else: also write the table there")
    ap.add_argument("--top", type=int, default=15, help="rows of the ranked table to print")
    ap.add_argument("--global-batch", type=int, default=0, help="sequences per step (default: the config's dp*ep*M*m)")
    ap.add_argument("--micro-batch", type=int, default=0, help="keep m fixed (default: free)")
    ap.add_argument("--precision", default="", choices=["", *PRECISIONS], help="state/activation bytes (default: train.dtype)")
    ap.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                    help="plan only this parallel.zero level (default: every level a layout allows)")
    ap.add_argument("--zero1", action="store_true", help="same as --zero 1 (old name)")
    ap.add_argument("--activation-checkpointing", choices=["config", "true", "false"], default="config")
    ap.add_argument("--ep-overlap", type=float, default=0.0, help="fraction of all-to-all hidden by compute (0: ours)")
    ap.add_argument("--first-dense", type=int, default=0, help="first k layers dense (models beyond our Transformer)")
    ap.add_argument("--dense-ffn", type=int, default=0, help="hidden size of dense FFN layers (default model.ffn_dim)")
    ap.add_argument("--shared-experts", type=int, default=0, help="always-on experts per MoE layer")
    args, overrides = ap.parse_known_args(argv)
    try:
        if args.measure:
            from .measure import measure_hardware  # spawns processes: imported only when asked

            out = args.out or "hardware.json"
            hw = measure_hardware(out)
            print(f"wrote {out}: {hw.name}, GEMM {hw.gemm_flops_by_threads}, all-reduce {hw.intra.allreduce_bw / 1e9:.2f} "
                  f"GB/s, reserve {hw.mem_reserved_bytes / 2**20:.0f} MiB")
            return 0
        if args.calibrate:
            if args.hardware == "auto" or not args.out:
                raise ConfigError("--calibrate needs --hardware PROFILE (the profile to fit) and --out NEW_PROFILE")
            cfg = load_config(args.config, overrides)  # the config `bench layouts` ran
            rows = calibration_rows(args.calibrate)
            hw = fit_profile(rows, cfg, args.hardware)
            save_hardware(hw, args.out)
            res = calibrate(rows, cfg, hw)
            print(f"wrote {args.out}: {hw.source}\n\n{format_calibration(res)}")
            return 0
        if not args.ranks:
            raise ConfigError("nanotitan plan needs --ranks N (the world size to plan for)")
        cfg = load_config(args.config, overrides)
        hw = detect_hardware(None if args.hardware == "auto" else args.hardware)
        extra = {k: v for k, v in (("first_dense", args.first_dense), ("dense_ffn_dim", args.dense_ffn),
                                   ("n_shared_experts", args.shared_experts)) if v}
        ac = None if args.activation_checkpointing == "config" else args.activation_checkpointing == "true"
        opts = PlanOptions(precision=args.precision, zero=args.zero, zero1=args.zero1, activation_checkpointing=ac,
                           global_batch=args.global_batch, micro_batch=args.micro_batch, nodes=args.nodes,
                           ep_overlap=args.ep_overlap, shape_extra=extra)
        preds = plan(cfg, args.ranks, hw, opts)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not preds:
        print(f"error: no valid layout of {args.ranks} ranks for this config and global batch", file=sys.stderr)
        return 2
    shape = ModelShape.from_config(cfg, **extra)
    B = opts.global_batch or cfg.layout_batch
    head = (f"{shape.total_params() / 1e9:.3g}B params, {B} x {shape.seq_len} tokens/step on {args.ranks} x {hw.name} "
            f"({len(preds)} layouts, {sum(p.fits for p in preds)} fit)")
    best = preds[0].layout
    rec = (f"Recommended: {best.short()} — {reason(preds)}\n  --parallel.dp {best.dp} --parallel.pp {best.pp} "
           f"--parallel.ep {best.ep} --parallel.schedule {best.schedule} --parallel.microbatches {best.microbatches} "
           f"--train.micro_batch {best.micro_batch} --parallel.zero {best.zero}")
    text = f"{head}\n\n{format_table(preds, args.top)}\n\n{rec}\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
