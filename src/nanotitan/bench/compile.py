"""train.compile on CPU: one job eager and the same job with compiled blocks, side by side (docs/compile.md).

    nanotitan bench compile [--config configs/mid.toml] [--steps 60] [--from-step 20] [--threads N] [-- ARGS]
    nanotitan bench compile --static-ep [--ep 2] [--steps 20]

A 3-step compiled warm-up run first, on an empty inductor cache of its own (its compile_s: the cold compile; it fills
the cache), then the compiled job (warm cache) and, once its first record is out (compile done), the eager job, so
their steps run at the same time (the machine is shared: only ratios taken within one run mean anything), each the real
trainer (`nanotitan train`) in its own run dir under /tmp, with eval, checkpoints and samples off. From each
metrics.jsonl: the compile time (`compile_s`, the first record's), the first record's step time, and the steady step
time: the median of the records' step times from --from-step on (each record's step time is the mean over the steps
since the previous record; a record holding a metered step, which runs eagerly, is among them), with its MFU by our FLOP
count. Prints one row per job and compiled / eager; the compile pays for itself after compile_s / (eager - compiled step
time) steps when the compiled step is faster.

--static-ep: the three ways to run one MoE model under EP with parallel.ep_dispatch static, in one process per EP rank
(gloo), their steps interleaved (step i of each before step i + 1 of any, so the machine's load falls on all three):
eager; per-block compile with the MoE eager between two graphs (`compile_blocks(whole=False)`, what train.compile
does for the dynamic dispatch); each block compiled whole (`whole=True`, what train.compile does for static). Rank 0's
compile time (dynamo and inductor, the first step's) and median step time of each, and the ratios.
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


def _static_ep_rank(rank: int, world: int, steps: int) -> dict:
    """Rank `rank`'s three shards of one model (identical weights), stepped in turn; compile_s and step times."""
    import torch
    import torch.nn.functional as F

    from ..config.config import Config, ModelConfig, ParallelConfig
    from ..model.spec import build_chunk_specs
    from ..model.transformer import Transformer
    from ..parallel.compile import compile_blocks, compile_seconds
    from ..parallel.dims import ParallelDims
    from ..parallel.ep import apply_ep
    from ..parallel.placement import expert_shards

    torch.set_num_threads(1)
    model = ModelConfig(vocab_size=512, d_model=128, n_layers=4, n_heads=4, ffn_dim=256, num_experts=8, top_k=2,
                        moe_every=1, max_seq_len=128, experts_impl="grouped")
    cfg = Config(model=model, parallel=ParallelConfig(ep=world, ep_dispatch="static", ep_capacity=float(world)))
    dims = ParallelDims(1, 1, world, rank=rank).build_groups(timeout_s=600)
    spec = build_chunk_specs(cfg, 0, rank)[0]
    jobs = {name: apply_ep(Transformer(model, spec, seed=3, experts=expert_shards(cfg, dims)), dims,
                           capacity=cfg.parallel.ep_capacity) for name in ("eager", "per-block", "whole")}
    from torch._inductor.compile_fx import compile_fx

    compile_blocks(jobs["per-block"], whole=False)
    # inductor again, as an object of its own: dynamo keeps one cache for every Block (one code object) and tells
    # graphs apart by backend, not by the MoE's eager wrapper, so the whole blocks would reuse per-block's graphs
    compile_blocks(jobs["whole"], whole=True, backend=lambda gm, inputs: compile_fx(gm, inputs))
    toks = torch.randint(0, 512, (4, 129), generator=torch.Generator().manual_seed(rank))
    times: dict[str, list[float]] = {name: [] for name in jobs}
    compile_s = {}
    for i in range(steps + 1):
        for name, shard in jobs.items():
            c0, t0 = compile_seconds(), time.perf_counter()
            logits, aux = shard(toks[:, :-1])
            (F.cross_entropy(logits.flatten(0, 1), toks[:, 1:].flatten()) + aux).backward()
            shard.zero_grad()
            for m in shard.moe_layers():  # the step drains the records (parallel/ep.py take_received)
                m.dispatcher.received.clear()
            if i == 0:
                compile_s[name] = (compile_seconds() - c0, time.perf_counter() - t0)
            else:
                times[name].append(time.perf_counter() - t0)
    return {name: (*compile_s[name], statistics.median(t)) for name, t in times.items()}


def static_ep(ep: int, steps: int) -> int:
    from ..run.spawn import run_ranks
    rows = run_ranks(_static_ep_rank, ep, (steps,), timeout=3600, pg_timeout=1200)[0]
    print(f"static EP dispatch, EP{ep} on gloo, 4 MoE blocks (d_model 128, 8 experts, top-2, 4x128 tokens a rank), "
          f"{steps} steps each, interleaved; rank 0")
    print(f"{'job':10} {'compile_s':>9} {'step 1 s':>9} {'step ms':>9} {'/ eager':>8} {'/ per-block':>11}")
    for name, (c, first, t) in rows.items():
        print(f"{name:10} {c:9.1f} {first:9.1f} {t * 1e3:9.1f} {t / rows['eager'][2]:8.3f} "
              f"{t / rows['per-block'][2]:11.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan bench compile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/mid.toml")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--from-step", type=int, default=20, help="steady records: this step on")
    ap.add_argument("--tag", default="bench_compile")
    ap.add_argument("--static-ep", action="store_true", help="eager / per-block / whole blocks under static EP")
    ap.add_argument("--ep", type=int, default=2, help="with --static-ep: EP ranks")
    ap.add_argument("extra", nargs="*", help="more trainer args for both jobs (after --)")
    args = ap.parse_args(argv)
    if args.static_ep:
        return static_ep(args.ep, args.steps)
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
