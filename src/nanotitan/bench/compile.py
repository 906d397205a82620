"""train.compile on CPU: one job eager and the same job with compiled blocks, side by side (docs/compile.md).

    nanotitan bench compile [--config configs/mid.toml] [--steps 60] [--from-step 20] [--threads N] [-- ARGS]

A 3-step compiled warm-up run first, on an empty inductor cache of its own (its compile_s: the cold compile; it fills
the cache), then the compiled job (warm cache) and, once its first record is out (compile done), the eager job, so
their steps run at the same time (the machine is shared: only ratios taken within one run mean anything), each the real
trainer (`nanotitan train`) in its own run dir under /tmp, with eval, checkpoints and samples off. From each
metrics.jsonl: the compile time (`compile_s`, the first record's), the first record's step time, and the steady step
time: the median of the records' step times from --from-step on (each record's step time is the mean over the steps
since the previous record; a record holding a metered step, which runs eagerly, is among them), with its MFU by our FLOP
count. Prints one row per job and compiled / eager; the compile pays for itself after compile_s / (eager - compiled step
time) steps when the compiled step is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _launch(config: str, compiled: bool, steps: int, run_dir: Path, extra: list[str]) -> subprocess.Popen:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "nanotitan.cli", "train", "--config", config, "--train.steps", str(steps),
           "--train.eval_every", "0", "--train.ckpt_at_end", "false", "--train.sample_tokens", "0",
           "--run.progress", "false", "--run.tensorboard", "false", "--run.dir", str(run_dir),
           "--train.compile", str(compiled).lower(), *extra]
    log = open(f"{run_dir}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())


def summarize(metrics: Path, from_step: int) -> dict:
    """compile_s, the first record's step time, and the steady records' median step time and MFU."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.startswith('{"step"')]
    steady = [r for r in records if r["step"] >= from_step]
    if not steady:
        raise SystemExit(f"{metrics}: no record at or after step {from_step}")
    return {"compile_s": records[0].get("compile_s", 0.0), "first_step_s": records[0]["step_time_s"],
            "step_s": statistics.median(r["step_time_s"] for r in steady),
            "mfu": statistics.median(r["mfu"] for r in steady), "records": len(steady)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan bench compile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/mid.toml")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--from-step", type=int, default=20, help="steady records: this step on")
    ap.add_argument("--tag", default="bench_compile")
    ap.add_argument("extra", nargs="*", help="more trainer args for both jobs (after --)")
    args = ap.parse_args(argv)
    root = Path("/tmp") / args.tag
    runs = {name: root / name for name in ("eager", "compiled")}
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")  # empty: the warm-up's compile is cold
    # A short compiled run first fills inductor's on-disk cache (its compile_s is the cold compile time), so that the
    # compiled job below loads its graphs and both jobs' steady steps overlap in time (a job that compiles for
    # minutes while the other steps alone, then steps alone itself, measures nothing side by side).
    warm = _launch(args.config, True, 3, root / "warmup", args.extra)
    if warm.wait() != 0:
        raise SystemExit(f"warm-up job failed: see {root / 'warmup'}.log")
    cold = summarize(root / "warmup" / "metrics.jsonl", 1)["compile_s"]
    # The eager job starts once the compiled one has its first record (its compile is done): their steps run together.
    procs = {"compiled": _launch(args.config, True, args.steps, runs["compiled"], args.extra)}
    first = runs["compiled"] / "metrics.jsonl"
    while procs["compiled"].poll() is None and not (first.exists() and '{"step"' in first.read_text()):
        time.sleep(0.2)
    procs["eager"] = _launch(args.config, False, args.steps, runs["eager"], args.extra)
    for name, p in procs.items():
        if p.wait() != 0:
            raise SystemExit(f"{name} job failed: see {runs[name]}.log")
    rows = {name: summarize(d / "metrics.jsonl", args.from_step) for name, d in runs.items()}
    print(f"{args.config}, {args.steps} steps, side by side; steady = median of {rows['eager']['records']} records "
          f"from step {args.from_step}")
    print(f"{'job':9} {'compile_s':>9} {'step 1 s':>9} {'steady ms':>10} {'MFU':>7}")
    for name, r in rows.items():
        print(f"{name:9} {r['compile_s']:9.1f} {r['first_step_s']:9.2f} {r['step_s'] * 1e3:10.1f} {r['mfu']:7.2%}")
    print(f"cold compile (empty on-disk cache, the warm-up run): {cold:.1f} s; the compiled job above: warm cache")
    e, c = rows["eager"], rows["compiled"]
    gain = e["step_s"] - c["step_s"]
    print(f"compiled / eager steady step time: {c['step_s'] / e['step_s']:.3f}; "
          + (f"compile repaid after {c['compile_s'] / gain:.0f} steps" if gain > 0 else "compile never repaid"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
