"""Issue 50 item 5: the default model family at a long sequence, trained at CP 1/2/4/8 on this machine: each rank's
peak of saved activations (the memory meter, summary.json) beside the planner's activation term for the same
layout, and tokens/s. One sequence a step (micro_batch 1), 8 experts (so that they fold over cp 8), a few steps.

The busiest rank is the one whose experts the router sends the most tokens (docs/cp.md "Long context"): each
rank's received assignments per step come from the run's `expert_load` (experts fold over CP in contiguous blocks
of E/cp), and the planner is asked twice, with its fitted routing skew and with the run's measured load (the
busiest rank's assignments over the mean, PlanOptions.expert_load). Speed on a shared 2-core machine: wall
tokens/s, and the slowest rank's CPU seconds per step (`cpu_step_s`, process time: what the other jobs do not
move), with the load average around each run.

    PYTHONPATH=src python scripts/experiments/cp_long_context.py --seq 16384 --cps 1 2 4 8 --steps 3

Writes docs/experiments/cp/long_context_seq{S}.json and prints a markdown table."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
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


def planned_activations(S: int, cp: int, steps: int, load: float | None = None) -> float:
    """The planner's activation bytes of the busiest rank for this layout (plan/cost.py predict, the CPU profile):
    at its fitted routing skew, or at a measured load (busiest rank's received assignments over the mean)."""
    from nanotitan.config.config import load_config
    from nanotitan.config.hardware import get_hardware
    from nanotitan.plan.context import PlanOptions
    from nanotitan.plan.cost import predict
    from nanotitan.plan.shape import Layout

    cfg = load_config(str(ROOT / "configs/default.toml"), train_args(S, cp, steps, Path("/tmp/unused"))[2:])
    p = predict(cfg, Layout(1, 1, 1, "1f1b", 1, 1, cp=cp), get_hardware("cpu"), PlanOptions(expert_load=load))
    return p.mem_parts["activations"]


def received_per_rank(record: dict, cp: int) -> list[int]:
    """Each CP rank's received expert assignments in a step, summed over MoE layers (its experts: a contiguous
    block of E/cp)."""
    n = len(record["expert_load"][0]) // cp
    return [sum(sum(layer[r * n:(r + 1) * n]) for layer in record["expert_load"]) for r in range(cp)]


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
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                       stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
        steps = list({r["step"]: r for r in records if "loss" in r}.values())
        ranks = json.loads((run / "summary.json").read_text())["ranks"]
        acts = [r["act_peak_bytes"] for r in ranks]
        recv = [received_per_rank(r, cp) for r in steps]
        load = max(max(x) * cp / sum(x) for x in recv)  # the busiest rank's share at the step that peaks most
        slow = max(r["cpu_step_s"] for r in ranks)
        rows.append({"cp": cp, "act_peak_per_rank": acts, "act_peak_max": max(acts), "act_peak_min": min(acts),
                     "busiest_rank": acts.index(max(acts)), "received_per_rank_per_step": recv,
                     "measured_load_max_mean": load,
                     "planned_activations": planned_activations(a.seq, cp, a.steps),
                     "planned_at_measured_load": planned_activations(a.seq, cp, a.steps, load),
                     "planned_balanced": planned_activations(a.seq, cp, a.steps, 1.0),
                     "tokens_per_sec_last": steps[-1]["tokens_per_sec"],
                     "tokens_per_sec_best": max(r["tokens_per_sec"] for r in steps[1:] or steps),
                     "cpu_step_s_per_rank": [r["cpu_step_s"] for r in ranks], "cpu_step_s_slowest": slow,
                     "cpu_s_per_1k_tokens_slowest": 1000 * slow / a.seq, "load_before": load_before,
                     "load_after": os.getloadavg()[0], "wall_s": wall,
                     "loss": [r["loss"] for r in steps]})
        print(json.dumps(rows[-1]), flush=True)
    out = ROOT / "docs/experiments/cp" / f"long_context_seq{a.seq}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seq": a.seq, "rows": rows}, indent=1))
    one = rows[0]["act_peak_max"]
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    print("| cp | busiest rank (MiB) | planner, fitted skew | measured load | planner at it | lightest | planner, "
          "balanced | busiest: fall | tokens/s wall (best) | slowest rank CPU s/step | CPU s / 1k tokens | load |")
    print("|---" * 12 + "|")
    for r in rows:
        print(f"| {r['cp']} | {mib(r['act_peak_max'])} (rank {r['busiest_rank']}) | {mib(r['planned_activations'])} | "
              f"{r['measured_load_max_mean']:.2f} | {mib(r['planned_at_measured_load'])} | {mib(r['act_peak_min'])} | "
              f"{mib(r['planned_balanced'])} | {one / r['act_peak_max']:.2f}x | {r['tokens_per_sec_best']:.0f} | "
              f"{r['cpu_step_s_slowest']:.1f} | {r['cpu_s_per_1k_tokens_slowest']:.2f} | "
              f"{r['load_before']:.0f}-{r['load_after']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
