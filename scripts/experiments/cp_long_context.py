"""Issue 50 item 5: the default model family at a long sequence, trained at CP 1/2/4/8 on this machine: each rank's
peak of saved activations (the memory meter, summary.json) beside the planner's activation term for the same
layout, and tokens/s. One sequence a step (micro_batch 1), 8 experts (so that they fold over cp 8), a few steps.

    PYTHONPATH=src python scripts/experiments/cp_long_context.py --seq 16384 --cps 1 2 4 8 --steps 3

Writes docs/experiments/cp/long_context_seq{S}.json and prints a markdown table."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def train_args(S: int, cp: int, steps: int, run_dir: Path) -> list[str]:
    return ["--config", str(ROOT / "configs/default.toml"), "--parallel.dp", "1", "--parallel.pp", "1",
            "--parallel.ep", "1", "--parallel.microbatches", "1", "--parallel.cp", str(cp),
            "--model.num_experts", "8", "--train.seq_len", str(S), "--model.max_seq_len", str(S),
            "--train.micro_batch", "1", "--train.steps", str(steps), "--train.warmup_steps", "1",
            "--train.eval_every", "0", "--train.sample_tokens", "0", "--train.ckpt_at_end", "false",
            "--run.dir", str(run_dir), "--run.overwrite", "true", "--run.log_every", "1", "--run.peak_every", "1",
            "--run.progress", "false", "--run.tensorboard", "false"]


def planned_activations(S: int, cp: int) -> float:
    """The planner's activation bytes per rank for this layout (plan/cost.py predict, the CPU profile)."""
    from nanotitan.config.config import load_config
    from nanotitan.config.hardware import get_hardware
    from nanotitan.plan.cost import predict
    from nanotitan.plan.shape import Layout

    cfg = load_config(str(ROOT / "configs/default.toml"), train_args(S, cp, 1, Path("/tmp/unused"))[2:])
    p = predict(cfg, Layout(1, 1, 1, "1f1b", 1, 1, cp=cp), get_hardware("cpu"))
    return p.mem_parts["activations"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--runs", default="runs/cp_long_context")
    a = ap.parse_args()
    rows = []
    for cp in a.cps:
        run = Path(a.runs) / f"seq{a.seq}_cp{cp}"
        cmd = [sys.executable, "-m", "nanotitan.cli", "train", *train_args(a.seq, cp, a.steps, run)]
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                       stdout=subprocess.DEVNULL)
        records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "loss" in r]
        ranks = json.loads((run / "summary.json").read_text())["ranks"]
        acts = [r["act_peak_bytes"] for r in ranks if "act_peak_bytes" in r]
        rows.append({"cp": cp, "act_peak_max": max(acts), "act_peak_min": min(acts),
                     "planned_activations": planned_activations(a.seq, cp),
                     "tokens_per_sec_last": steps[-1]["tokens_per_sec"],
                     "tokens_per_sec_best": max(r["tokens_per_sec"] for r in steps[1:] or steps),
                     "loss": [r["loss"] for r in steps]})
        print(json.dumps(rows[-1]), flush=True)
    out = ROOT / "docs/experiments/cp" / f"long_context_seq{a.seq}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seq": a.seq, "rows": rows}, indent=1))
    one = rows[0]["act_peak_max"]
    print(f"| cp | saved activations, peak per rank (MiB) | planner (MiB) | fall vs cp {rows[0]['cp']} | tokens/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['cp']} | {r['act_peak_max'] / 2**20:.1f} | {r['planned_activations'] / 2**20:.1f} | "
              f"{one / r['act_peak_max']:.2f}x | {r['tokens_per_sec_best']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
