"""Muon against AdamW (issue 51), single process on this machine's CPU, every figure of docs/optim.md:

    python scripts/experiments/muon.py sweep [--steps 200] [--microbatches 8] [--lrs 'adamw=1e-3,3e-3;muon=1e-2']
                                                             # default model: the lr sweeps, val loss at steps/2 and
                                                             # steps, the plot (muon_rest=...: train.lr, the lr
                                                             # of Muon's AdamW families; --out one point's json;
                                                             # --from-runs DIR: read runs' metrics.jsonl instead)
    python scripts/experiments/muon.py mid [--steps 20]      # MID: step time and optimizer memory, AdamW vs Muon
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
MUON_REST_LRS: list[float] = []  # train.lr under Muon (its AdamW part: embeddings, head, norms, router); [] = default
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


def _point(opt: str, lr: float, rest: float | None, steps: int, run_root: Path, microbatches: int) -> tuple:
    flag = ["--train.lr", str(lr)] if opt == "adamw" else ["--train.muon_lr", str(lr)]
    if rest is not None:  # Muon's AdamW half (train.lr); None keeps the config's
        flag += ["--train.lr", str(rest)]
    name = f"{opt} lr={lr}" + (f" adamw_lr={rest}" if rest is not None else "")
    r = train("default.toml", SINGLE + ["--parallel.microbatches", str(microbatches), "--train.steps", str(steps),
                                        "--train.optimizer", opt, "--train.eval_every", str(steps // 2),
                                        "--run.log_every", "10", "--run.dir", f"{run_root}/{name.replace(' ', '_')}",
                                        *flag])
    h = r["history"]
    out = {"opt": opt, "lr": lr, "rest_lr": rest, "steps": [x["step"] for x in h], "loss": [x["loss"] for x in h],
           "val": {x["step"]: x["val_loss"] for x in h if "val_loss" in x}}
    print(name, {s: round(v, 4) for s, v in out["val"].items()}, flush=True)
    return name, out


def sweep(steps: int, run_root: Path, microbatches: int = 8) -> dict:
    """Both optimizers over their lr grids (and Muon's AdamW lr over MUON_REST_LRS at muon_lr MUON_REST_AT), `steps`
    steps of `microbatches` x 2 sequences; val loss at steps/2 and at the end."""
    pts = [("adamw", lr, None) for lr in ADAMW_LRS] + [("muon", lr, None) for lr in MUON_LRS]
    pts += [("muon", MUON_REST_AT[0], rest) for rest in MUON_REST_LRS]
    return dict(_point(o, lr, rest, steps, run_root, microbatches) for o, lr, rest in pts)


def plot(res: dict, path: Path, seqs: int = 16) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in res.items():
        ax.plot(r["steps"], r["loss"], ("-" if r["opt"] == "muon" else "--"), label=name, lw=1.2)
    ax.set_xlabel(f"step ({seqs} x 128 tokens each)")
    ax.set_ylabel("train loss")
    ax.set_ylim(top=min(8.0, ax.get_ylim()[1]))
    ax.set_title("default model on Shakespeare: Muon (solid) vs AdamW (dashed)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def mid(steps: int, run_root: Path) -> dict:
    """Median step time (steps 3..; the first two are warm-up) and optimizer bytes, AdamW vs Muon, MID config."""
    res = {}
    for rnd in range(2):  # two rounds, alternating, so a drift in the shared machine's speed hits both
        for opt in ("adamw", "muon"):
            r = train("mid.toml", SINGLE + ["--train.steps", str(steps), "--train.optimizer", opt,
                                            "--run.log_every", "1", "--run.dir", f"{run_root}/mid_{opt}_{rnd}"])
            times = [x["step_time_s"] for x in r["history"][2:]]
            e = res.setdefault(opt, {"step_time_s": [], "optim_bytes": r["mem"]["optim_bytes"],
                                     "param_bytes": r["mem"]["param_bytes"], "ns_s_per_step": []})
            e["step_time_s"].append(statistics.median(times))
            e["ns_s_per_step"].append(r["ns_s_per_step"])
    for e in res.values():
        e["median_step_s"] = statistics.median(e["step_time_s"])
    res["overhead"] = res["muon"]["median_step_s"] / res["adamw"]["median_step_s"] - 1
    print(json.dumps(res, indent=1), flush=True)
    return res


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
    ap.add_argument("--merge", action="store_true", help="sweep: add these runs to docs/experiments/muon_sweep.json")
    ap.add_argument("--lrs", default="", help="sweep: 'adamw=1e-3,3e-3;muon=3e-3,1e-2;muon_rest=1e-2' instead of "
                    "the grids (muon_rest: train.lr for Muon's AdamW parameters, at muon_lr muon_at=3e-3)")
    ap.add_argument("--out", default="", help="sweep: write this json instead of docs/experiments/muon_sweep.json "
                    "(points run side by side as separate processes, then --merge-from joins them)")
    ap.add_argument("--from-runs", default="", help="sweep: read the points' metrics.jsonl under this run root "
                    "(runs still going, or stopped) instead of training")
    ap.add_argument("--merge-from", default="", help="sweep: join these comma-separated jsons (no training) and plot")
    a = ap.parse_args()
    torch.set_num_threads(1)
    steps = a.steps or {"sweep": 200, "mid": 20, "ns": 6, "qk": 60}[a.what]
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
        res = sweep(steps, Path(a.run_root), a.microbatches)
        old = OUT / "muon_sweep.json"
        if a.merge and old.exists():  # more lrs on an earlier sweep of the same steps
            prev = json.loads(old.read_text())
            assert prev.pop("steps") == steps, "--merge needs the earlier sweep's --steps"
            res = {**prev, **res}
    else:
        res = {"mid": mid, "ns": ns, "qk": qk}[a.what](steps, Path(a.run_root))
    OUT.mkdir(parents=True, exist_ok=True)
    dest = Path(a.out) if a.out else OUT / f"muon_{a.what}.json"
    dest.write_text(json.dumps({"steps": steps, **res}, indent=1))
    if a.what == "sweep" and not a.out:
        plot(res, ROOT / "docs" / "optim_muon.png", 2 * a.microbatches)


if __name__ == "__main__":
    main()
