"""`nanotitan plot RUN_DIR [RUN_DIR ...] [--out DIR]`: pictures of runs from their metrics.jsonl.

    loss.png                 train loss (running mean over ~1/30 of the run, raw underneath) and val loss
                             (markers) over steps, every run overlaid
    throughput.png           tokens/s and MFU over steps, every run overlaid
    expert_load_<run>.png    per run: one heatmap per MoE layer, expert x logged step, colour = tokens routed to
                             the expert / mean over experts (1 = balanced), and each layer's max/mean in its title

It also prints a markdown table, one row per run: final val loss, and over the last `--last` records the mean
max/mean expert load per MoE layer (log every step for per-step figures), the dropped fraction and balance loss.
A run is named by its directory. Restarted runs log replayed steps again; the last record of a step wins.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..config.config import ConfigError


def read_records(run_dir: Path) -> list[dict]:
    """The step records of a run's metrics.jsonl (events skipped), one per step (the last one written), by step.
    A torn last line (a run still writing it, or one that crashed mid-write) is left out; a bad line before it
    is refused in one line naming it."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no metrics.jsonl: pass a run directory of `nanotitan train` (RUN_DIR)")
    text = path.read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")  # the last item is "" when the file ends with a newline, else the torn line
    by_step = {}
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            if i == len(lines) or (i == len(lines) - 1 and not lines[-1]):  # the last line: torn, leave it out
                continue
            raise ConfigError(f"{path}:{i}: not a JSON line ({e}); every line of metrics.jsonl is one JSON "
                              "object (remove or fix that line)") from None
        if isinstance(rec, dict) and "step" in rec and "event" not in rec:
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_runs(run_dirs: list[Path], out: Path) -> list[Path]:
    """Write the PNGs of these runs into `out`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    runs = {_name(d, run_dirs): read_records(d) for d in run_dirs}
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, recs), color in zip(runs.items(), _colors(len(runs))):
        steps, loss = _series(recs, "loss")
        window = max(1, len(loss) // 30)  # per-step losses are noisy: a faint raw curve under a running mean
        if window > 1:
            ax.plot(steps, loss, color=color, linewidth=0.5, alpha=0.25)
        ax.plot(steps, _running_mean(loss, window), color=color, linewidth=1.2, label=f"{name} train")
        steps, val = _series(recs, "val_loss")
        if steps:
            ax.plot(steps, val, "o--", color=color, markersize=4, linewidth=1, label=f"{name} val")
    ax.set(xlabel="step", ylabel="loss", title="loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    written.append(_save(fig, out / "loss.png"))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for (name, recs), color in zip(runs.items(), _colors(len(runs))):
        a1.plot(*_series(recs, "tokens_per_sec"), color=color, linewidth=1, label=name)
        steps, mfu = _series(recs, "mfu")
        a2.plot(steps, [100 * v for v in mfu], color=color, linewidth=1, label=name)
    a1.set(xlabel="step", ylabel="tokens/s", title="throughput")
    a2.set(xlabel="step", ylabel="MFU (%)", title="model FLOPs utilisation")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    written.append(_save(fig, out / "throughput.png"))

    for name, recs in runs.items():
        path = plot_expert_load(recs, name, out / f"expert_load_{name}.png", plt)
        if path is not None:
            written.append(path)
    return written


def plot_expert_load(records: list[dict], name: str, path: Path, plt) -> Path | None:
    """One heatmap per MoE layer: load / mean load per expert (rows) over logged steps (columns)."""
    import numpy as np

    recs = [r for r in records if r.get("expert_load")]
    if not recs:
        return None
    load = np.array([r["expert_load"] for r in recs], dtype=float)  # (records, layers, experts)
    share = load / np.maximum(load.mean(axis=2, keepdims=True), 1e-9)
    steps = [r["step"] for r in recs]
    n_layers, E = share.shape[1], share.shape[2]
    fig, axes = plt.subplots(n_layers, 1, figsize=(9, 1.0 + 1.3 * n_layers * max(1.0, E / 8)), sharex=True,
                             squeeze=False, layout="constrained")
    tail = max(1, len(recs) // 6)  # the last sixth of the run: the balance it settles at
    for layer, ax in enumerate(axes[:, 0]):
        im = ax.imshow(share[:, layer, :].T, aspect="auto", cmap="coolwarm", vmin=0.0, vmax=2.0,
                       interpolation="nearest", extent=(steps[0] - 0.5, steps[-1] + 0.5, E - 0.5, -0.5))
        worst = share[-tail:, layer, :].max(axis=1).mean()
        ax.set_ylabel(f"MoE {layer}\nexpert", fontsize=8)
        ax.set_title(f"max/mean over the last {tail} records: {worst:.2f}", fontsize=8, loc="right")
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(f"{name}: tokens per expert / mean (1 = balanced)")
    fig.colorbar(im, ax=axes[:, 0].tolist(), shrink=0.8)
    return _save(fig, path, tight=False)


def summary_table(run_dirs: list[Path], last: int = 50) -> str:
    """Markdown: per run, the final val loss and, averaged over its last `last` records, each MoE layer's max/mean
    expert load, the dropped fraction (when recorded) and the unweighted balance loss."""
    rows = ["| run | val loss | max/mean load per MoE layer | dropped | balance loss |", "|---|---|---|---|---|"]
    for d in run_dirs:
        recs = read_records(d)
        tail = [r for r in recs if r.get("expert_max_mean")][-last:]
        val = [r["val_loss"] for r in recs if r.get("val_loss") is not None]
        per_layer = [sum(col) / len(col) for col in zip(*(r["expert_max_mean"] for r in tail))] if tail else []
        drops = [r["dropped_frac"] for r in tail if "dropped_frac" in r]
        bal = [r["balance_loss"] for r in tail if "balance_loss" in r]
        rows.append(f"| {_name(d, run_dirs)} | {val[-1]:.4f} | " if val else f"| {_name(d, run_dirs)} | - | ")
        rows[-1] += (" / ".join(f"{v:.2f}" for v in per_layer) or "-") + " | "
        rows[-1] += (f"{100 * sum(drops) / len(drops):.2f}%" if drops else "-") + " | "
        rows[-1] += (f"{sum(bal) / len(bal):.4f}" if bal else "-") + " |"
    return "\n".join(rows)


def _running_mean(xs: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def _name(d: Path, all_dirs: list[Path]) -> str:
    """The directory name, or the path relative to the common parent when names repeat."""
    names = [p.name for p in all_dirs]
    return d.name if names.count(d.name) == 1 else str(d).strip("/").replace("/", "_")


def _colors(n: int):
    import matplotlib.pyplot as plt

    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return [cycle[i % len(cycle)] for i in range(n)]


def _save(fig, path: Path, tight: bool = True) -> Path:
    import matplotlib.pyplot as plt

    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan plot", description="PNG pictures of runs: loss curves overlaid, "
                                 "tokens/s and MFU, expert load heatmaps per MoE layer.")
    ap.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories of `nanotitan train`")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default: FIRST_RUN_DIR/plots)")
    ap.add_argument("--last", type=int, default=50, help="records the summary table averages over (default: 50)")
    args = ap.parse_args(argv)
    from ..run.rundir import writable_dir

    out = writable_dir(args.out or args.run_dirs[0] / "plots", "--out")  # refused before reading or drawing
    for path in plot_runs(args.run_dirs, out):
        print(path)
    print(summary_table(args.run_dirs, args.last))
    return 0
