"""Muon against AdamW (issue 51), single process on this machine's CPU, every figure of docs/optim.md:

    python scripts/experiments/muon.py sweep [--steps 200] [--microbatches 8] [--lrs 'adamw=1e-3,3e-3;muon=1e-2']
                                                             # default model: the lr sweeps, val loss at steps/2 and
                                                             # steps, the plot (muon_rest=...: train.muon_adamw_lr, the lr
                                                             # of Muon's AdamW families; --out one point's json;
                                                             # --from-runs DIR: read runs' metrics.jsonl instead)
    python scripts/experiments/muon.py mid [--steps 4] [--tokens 1024,4096] [--rounds 2] [--dp 1]
                                                             # MID: step time and optimizer memory, AdamW vs Muon,
                                                             # and Newton-Schulz's fp32 vs bf16 throughput
    python scripts/experiments/muon.py ns [--steps 6]        # Newton-Schulz seconds per rank: one process vs DP4 zero 1
    python scripts/experiments/muon.py qk [--steps 60]       # QK-clip on a high-lr run: qk_max with and without

Each run is `nanotitan train`'s Trainer on configs/default.toml (or mid.toml) at dp=pp=ep=1 with the global batch
of the config's layout (B = 16 sequences: 8 microbatches of 2), so the losses are those of the 3-D default job.
Results go to docs/experiments/muon_<what>.json; `sweep` also draws docs/optim_muon.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "docs" / "experiments"
SINGLE = ["--parallel.dp", "1", "--parallel.pp", "1", "--parallel.ep", "1", "--run.progress", "false",
          "--run.tensorboard", "false", "--train.ckpt_at_end", "false", "--train.sample_tokens", "0",
          "--train.threads", "1"]
ADAMW_LRS = [1e-3, 3e-3, 1e-2]
MUON_LRS = [3e-3, 1e-2, 2e-2, 4e-2]
MUON_REST_LRS: list[float] = []  # train.muon_adamw_lr under Muon (its AdamW part: embeddings, head, norms, router); [] = default
MUON_REST_AT = [3e-3]  # the muon_lr those points run at


def train(config: str, args: list[str]) -> dict:
    from nanotitan.config.config import load_config
    from nanotitan.observe.memory import live_tensor_bytes
    from nanotitan.train import Trainer

    trainer = Trainer(load_config(str(ROOT / "configs" / config), args))
    try:
        out = trainer.train()
        orth = getattr(trainer.optimizer, "orthogonalizer", None)
        ns = (orth.ns_s / max(1, orth.calls)) if orth is not None else None
        mem = live_tensor_bytes(trainer.model, trainer.optimizer)
    finally:
        trainer.shard.close()
    return {"history": out["history"], "mem": mem, "ns_s_per_step": ns}


def _point(opt: str, lr: float, rest: float | None, steps: int, run_root: Path, microbatches: int,
           config: str = "default.toml") -> tuple:
    flag = ["--train.lr", str(lr)] if opt == "adamw" else ["--train.muon_lr", str(lr)]
    if opt == "muon":  # Muon's AdamW half (train.muon_adamw_lr); the muon_lr points hold it at AdamW-alone's 3e-3
        flag += ["--train.muon_adamw_lr", str(3e-3 if rest is None else rest)]
    name = f"{opt} lr={lr}" + (f" adamw_lr={rest}" if rest is not None else "")
    r = train(config, SINGLE + ["--parallel.microbatches", str(microbatches), "--train.steps", str(steps),
                                        "--train.optimizer", opt, "--train.eval_every", str(steps // 2),
                                        "--run.log_every", "10", "--run.dir", f"{run_root}/{name.replace(' ', '_')}",
                                        *flag])
    h = r["history"]
    out = {"opt": opt, "lr": lr, "rest_lr": rest, "steps": [x["step"] for x in h], "loss": [x["loss"] for x in h],
           "val": {x["step"]: x["val_loss"] for x in h if "val_loss" in x}}
    print(name, {s: round(v, 4) for s, v in out["val"].items()}, flush=True)
    return name, out


def sweep(steps: int, run_root: Path, microbatches: int = 8, config: str = "default.toml") -> dict:
    """Both optimizers over their lr grids (and Muon's AdamW lr over MUON_REST_LRS at muon_lr MUON_REST_AT), `steps`
    steps of `microbatches` x 2 sequences; val loss at steps/2 and at the end."""
    pts = [("adamw", lr, None) for lr in ADAMW_LRS] + [("muon", lr, None) for lr in MUON_LRS]
    pts += [("muon", MUON_REST_AT[0], rest) for rest in MUON_REST_LRS]
    return dict(_point(o, lr, rest, steps, run_root, microbatches, config) for o, lr, rest in pts)


def plot(res: dict, path: Path, seqs: int = 16, model: str = "default model") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in res.items():
        ax.plot(r["steps"], r["loss"], ("-" if r["opt"] == "muon" else "--"), label=name, lw=1.2)
    ax.set_xlabel(f"step ({seqs} x 128 tokens each)")
    ax.set_ylabel("train loss")
    ax.set_ylim(top=min(8.0, ax.get_ylim()[1]))
    ax.set_title(f"{model} on Shakespeare: Muon (solid) vs AdamW (dashed)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# mid's arms: Muon with Newton-Schulz in fp32 (the default, exact across layouts) and in bf16 (the reference's)
ARMS = {"adamw": ["--train.optimizer", "adamw"], "muon": ["--train.optimizer", "muon"],
        "muon_bf16": ["--train.optimizer", "muon", "--train.muon_ns_dtype", "bf16"]}


def _mid_rank(rank, world, args):
    r = train("mid.toml", args)
    return {"history": r["history"], "ns_s_per_step": r["ns_s_per_step"], "mem": r["mem"]}


def mid(steps: int, run_root: Path, tokens: list[int], rounds: int = 2, dp: int = 1) -> dict:
    """MID's step time, AdamW vs Muon (Newton-Schulz fp32, and bf16), at each `tokens` per step (1,024 x microbatches of 8 x 128, the same
    microbatch: accumulation), `rounds` rounds alternating the optimizers so a drift in the shared machine's speed
    hits both; per run the steps after the first (warm-up). `dp` > 1: that many ranks at zero 1 (one thread each;
    tokens per rank), rank 0's step times. Beside each measured overhead, the FLOP ratio: Newton-Schulz FLOPs (the
    busiest rank's, optim/cost.py) over the step's training FLOPs (model/transformer.py flops_per_token)."""
    from nanotitan.config.config import load_config
    from nanotitan.model.transformer import flops_per_token
    from nanotitan.optim.cost import muon_costs
    from tests.helpers.mp import run_ranks

    res = {}
    for tok in tokens:
        mb = max(1, tok // 1024)
        layout = ["--parallel.dp", str(dp), "--parallel.microbatches", str(mb)] + (
            ["--parallel.zero", "1"] if dp > 1 else [])
        e = res[str(tok)] = {"tokens_per_rank_step": 1024 * mb, "dp": dp}
        for rnd in range(rounds):
            for opt in ARMS:
                args = SINGLE + layout + ["--train.steps", str(steps), *ARMS[opt],
                                          "--run.log_every", "1", "--run.dir", f"{run_root}/mid_{tok}_{opt}_{rnd}"]
                if dp > 1:  # layout's --parallel.dp comes after SINGLE's: the later flag wins
                    r = run_ranks(_mid_rank, dp, args=(args,), timeout=1800, pg_timeout=600)[0]
                else:
                    r = train("mid.toml", args)
                o = e.setdefault(opt, {"step_s": [], "cpu_s": [], "ns_s_per_step": [],
                                       "optim_bytes": r["mem"]["optim_bytes"]})
                o["step_s"] += [x["step_time_s"] for x in r["history"][1:]]
                o["cpu_s"] += [x["cpu_step_s"] for x in r["history"][1:]]  # the rank's CPU: other jobs do not move it
                o["ns_s_per_step"].append(r["ns_s_per_step"])
                print(tok, rnd, opt, [round(x["step_time_s"], 2) for x in r["history"]], r["ns_s_per_step"],
                      flush=True)
        for opt in ARMS:
            o = e[opt]
            o["min_s"], o["median_s"] = min(o["step_s"]), statistics.median(o["step_s"])
            o["cpu_min_s"], o["cpu_median_s"] = min(o["cpu_s"]), statistics.median(o["cpu_s"])
            if opt != "adamw":
                for m in ("min", "median", "cpu_min", "cpu_median"):
                    e[f"overhead_{m}_{opt}"] = o[f"{m}_s"] / e["adamw"][f"{m}_s"] - 1
        cfg = load_config(str(ROOT / "configs" / "mid.toml"), args + ["--model.vocab_size", "4096"])  # data.vocab_size
        e["ns_flops_rank"] = muon_costs(cfg)["ns_flops_rank"]
        e["train_flops_rank"] = flops_per_token(cfg.model, cfg.train.seq_len) * 1024 * mb
        e["flop_ratio"] = e["ns_flops_rank"] / e["train_flops_rank"]
        print(tok, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in e.items() if k not in ARMS}, flush=True)
        OUT.mkdir(parents=True, exist_ok=True)  # each tokens leg as it ends: the long legs may be cut short
        (OUT / f"muon_mid_dp{dp}.partial.json").write_text(json.dumps({"steps": steps, **res}, indent=1))
    print(json.dumps(res, indent=1), flush=True)
    return res


def bench_ns(repeats: int = 5) -> dict:
    """MID's Newton-Schulz batches alone (96 expert matrices 256 x 512, 16 attention 256 x 256) and the bmm under
    them, fp32 against bf16, interleaved, one thread: GFLOP/s min/median-free (best of `repeats`)."""
    import time

    from nanotitan.optim.newton_schulz import ns_flops, orthogonalize

    g = torch.Generator().manual_seed(0)
    ex, at = torch.randn(96, 256, 512, generator=g), torch.randn(16, 256, 256, generator=g)
    cases = {}
    for dt in (torch.float32, torch.bfloat16):
        x = ex.to(dt)
        cases[f"bmm 96x(256x512 @ 512x256) {dt}"] = (2 * 96 * 256 * 256 * 512, lambda x=x: x @ x.mT)
        cases[f"NS5 MID (96 + 16 matrices) {dt}"] = (
            96 * ns_flops(256, 512) + 16 * ns_flops(256, 256),
            lambda dt=dt: (orthogonalize(ex, 5, dt), orthogonalize(at, 5, dt)))
    best = {k: float("inf") for k in cases}
    for _ in range(repeats):
        for k, (_, f) in cases.items():
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t0)
    out = {k: {"s": best[k], "gflops": cases[k][0] / best[k] / 1e9} for k in cases}
    print(json.dumps(out, indent=1), flush=True)
    return out


def _ns_rank(rank, world, args):
    return train("mid.toml", args)["ns_s_per_step"]


def ns(steps: int, run_root: Path) -> dict:
    """Newton-Schulz seconds per step on each rank, MID at DP4 zero 1 (4 ranks, one thread each) vs one process."""
    from tests.helpers.mp import run_ranks

    base = SINGLE + ["--train.steps", str(steps), "--train.optimizer", "muon", "--run.log_every", "1"]
    one = train("mid.toml", base + ["--run.dir", f"{run_root}/ns1"])["ns_s_per_step"]
    dp4 = base + ["--parallel.dp", "4", "--parallel.zero", "1", "--run.dir", f"{run_root}/ns4"]
    per_rank = run_ranks(_ns_rank, 4, args=(dp4,), timeout=900, pg_timeout=300)
    res = {"one_process_s": one, "dp4_zero1_per_rank_s": per_rank, "ratio_max_rank": max(per_rank) / one}
    print(json.dumps(res, indent=1), flush=True)
    return res


def qk(steps: int, run_root: Path, tau: float = 0.0) -> dict:
    """QK-clip on a run whose logits grow: the default model at a high lr (muon_lr 3e-2, train.lr 1e-2), 2 sequences
    of 128 a step, without the clip and with TAU = half the unclipped run's final max logit."""
    base = SINGLE + ["--parallel.microbatches", "1", "--train.steps", str(steps), "--train.optimizer", "muon",
                     "--train.muon_lr", "3e-2", "--train.lr", "1e-2", "--train.warmup_steps", "5",
                     "--train.eval_every", "0", "--run.log_every", "5"]
    res = {}
    free = train("default.toml", base + ["--train.qk_clip", "1e9", "--run.dir", f"{run_root}/qk_free"])["history"]
    tau = tau or round(free[-1]["qk_max"] / 2, 1)
    clipped = train("default.toml", base + ["--train.qk_clip", str(tau), "--run.dir", f"{run_root}/qk_clip"])["history"]
    for name, h in (("no clip", free), (f"qk_clip {tau}", clipped)):
        res[name] = {"steps": [x["step"] for x in h], "qk_max": [x["qk_max"] for x in h],
                     "loss": [x["loss"] for x in h]}
    res["tau"] = tau
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["sweep", "mid", "ns", "qk"])
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--run-root", default="/tmp/muon_runs")
    ap.add_argument("--microbatches", type=int, default=8, help="sweep: B = 2 x this (8: the default job's 16)")
    ap.add_argument("--config", default="default.toml", help="sweep: the configs/ file (mid.toml: MID at its own batch, --microbatches 1)")
    ap.add_argument("--plot", default="", help="sweep: write the loss plot here (default: docs/optim_muon.png unless --out)")
    ap.add_argument("--merge", action="store_true", help="sweep: add these runs to docs/experiments/muon_sweep.json")
    ap.add_argument("--tokens", default="1024", help="mid: tokens per step (per rank), multiples of 1,024")
    ap.add_argument("--rounds", type=int, default=2, help="mid: rounds alternating AdamW and Muon")
    ap.add_argument("--dp", type=int, default=1, help="mid: data ranks (zero 1)")
    ap.add_argument("--lrs", default="", help="sweep: 'adamw=1e-3,3e-3;muon=3e-3,1e-2;muon_rest=1e-2' instead of "
                    "the grids (muon_rest: train.muon_adamw_lr for Muon's AdamW parameters, at muon_lr muon_at=3e-3)")
    ap.add_argument("--out", default="", help="sweep: write this json instead of docs/experiments/muon_sweep.json "
                    "(points run side by side as separate processes, then --merge-from joins them)")
    ap.add_argument("--from-runs", default="", help="sweep: read the points' metrics.jsonl under this run root "
                    "(runs still going, or stopped) instead of training")
    ap.add_argument("--merge-from", default="", help="sweep: join these comma-separated jsons (no training) and plot")
    a = ap.parse_args()
    torch.set_num_threads(1)
    steps = a.steps or {"sweep": 200, "mid": 4, "ns": 6, "qk": 60}[a.what]
    for part in filter(None, a.lrs.split(";")):
        name, vals = part.split("=")
        grid = {"adamw": ADAMW_LRS, "muon": MUON_LRS, "muon_rest": MUON_REST_LRS, "muon_at": MUON_REST_AT}[name]
        grid[:] = [float(v) for v in vals.split(",") if v]
    if a.what == "sweep" and a.from_runs:
        res = {}
        for d in sorted(Path(a.from_runs).iterdir()):  # names as _point writes them: "adamw_lr=0.003[_adamw_lr=..]"
            h = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
            opt, *kv = d.name.split("_lr=")
            res[d.name.replace("_", " ")] = {"opt": opt, "lr": float(kv[0].split("_")[0]), "steps": [x["step"] for x in h],
                                            "loss": [x["loss"] for x in h],
                                            "val": {x["step"]: x["val_loss"] for x in h if "val_loss" in x}}
            print(d.name, "steps", h[-1]["step"], {k: round(v, 4) for k, v in res[d.name.replace("_", " ")]["val"].items()})
    elif a.what == "sweep" and a.merge_from:
        res = {}
        for f in a.merge_from.split(","):
            part = json.loads(Path(f).read_text())
            assert part.pop("steps") == steps, f"{f}: --merge-from needs --steps {steps}"
            res.update(part)
    elif a.what == "sweep":
        res = sweep(steps, Path(a.run_root), a.microbatches, a.config)
        old = OUT / "muon_sweep.json"
        if a.merge and old.exists():  # more lrs on an earlier sweep of the same steps
            prev = json.loads(old.read_text())
            assert prev.pop("steps") == steps, "--merge needs the earlier sweep's --steps"
            res = {**prev, **res}
    elif a.what == "mid":
        res = {"ns_bench": bench_ns(), **mid(steps, Path(a.run_root), [int(t) for t in a.tokens.split(",")],
                                            a.rounds, a.dp)}
    else:
        res = {"ns": ns, "qk": qk}[a.what](steps, Path(a.run_root))
    OUT.mkdir(parents=True, exist_ok=True)
    name = f"mid_dp{a.dp}" if a.what == "mid" else a.what
    dest = Path(a.out) if a.out else OUT / f"muon_{name}.json"
    dest.write_text(json.dumps({"steps": steps, **res}, indent=1))
    if a.what == "sweep" and (a.plot or not a.out):
        import tomllib
        mb = tomllib.loads((ROOT / "configs" / a.config).read_text()).get("train", {}).get("micro_batch", 2)
        plot(res, Path(a.plot) if a.plot else ROOT / "docs" / "optim_muon.png", mb * a.microbatches,
             "default model" if a.config == "default.toml" else a.config.removesuffix(".toml").upper())


if __name__ == "__main__":
    main()
