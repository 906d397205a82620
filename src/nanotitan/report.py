"""What a run tells its user: the per-step record, MoE load statistics, the end-of-run summary and progress.

The record's fields are the `metrics.jsonl` surface (DESIGN §5); the summary gathers one row per rank
(coordinates, peak memory, communication waits per axis) to global rank 0, which prints it as a table
and writes `summary.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from .metrics import fmt_bytes, peak_mem_bytes
from .model.transformer import Transformer, is_moe_layer
from .parallel import comm
from .parallel.dims import ParallelDims
from .parallel.pp import StepStats, theoretical_bubble


def step_record(*, step: int, ce_loss: float, aux_loss: float, grad_norm: float, lr: float, step_time: float,
                tokens_per_step: int, flops_per_token: float, peak_flops: float, device: torch.device,
                dims: ParallelDims, M: int, schedule: str, stats: StepStats, comm_stats: dict) -> dict:
    """One line of metrics.jsonl (step is 1-based: the number of optimizer steps taken)."""
    tok_s = tokens_per_step / step_time
    record = {
        "step": step, "loss": ce_loss + aux_loss, "ce_loss": ce_loss, "aux_loss": aux_loss,
        "grad_norm": grad_norm, "lr": lr, "tokens_per_sec": tok_s, "step_time_s": step_time,
        "mfu": flops_per_token * tok_s / peak_flops, "peak_mem_bytes": peak_mem_bytes(device),
        "dp": dims.dp, "pp": dims.pp, "ep": dims.ep, "microbatches": M,
        "schedule": schedule if dims.pp > 1 else "none", "tokens": step * tokens_per_step, **comm_stats,
    }
    if dims.pp > 1:
        busy = stats.compute_s + stats.p2p_wait_s
        record["bubble_measured"] = stats.p2p_wait_s / busy if busy > 0 else 0.0
        record["bubble_theory"] = theoretical_bubble(dims.pp, M)
    return record


def expert_load_stats(model: Transformer, world_size: int, device: torch.device) -> dict:
    """Tokens per expert per MoE layer since the last call, summed over every data rank (then reset)."""
    cfg = model.cfg
    load = torch.zeros(cfg.n_layers, cfg.num_experts, device=device)
    for key, counts in model.expert_load.items():
        load[int(key)] = counts.float()
    model.expert_load.clear()
    if dist.is_initialized() and world_size > 1:
        comm.all_reduce(load, axis="other")  # each layer lives on one stage; data ranks add up
    moe_rows = load[[i for i in range(cfg.n_layers) if is_moe_layer(cfg, i)]]
    imbalance = moe_rows.max(dim=1).values / moe_rows.mean(dim=1).clamp_min(1e-9)
    lo, hi, worst = torch.stack([moe_rows.min(), moe_rows.max(), imbalance.max()]).tolist()
    return {"expert_load": moe_rows.long().tolist(), "expert_load_min": int(lo), "expert_load_max": int(hi),
            "expert_imbalance": round(worst, 4)}


def gather_summary(last: dict, rank: int, dims: ParallelDims, device: torch.device, wait_totals: dict,
                   run_dir: Path, extra: dict | None = None) -> dict:
    """Per-rank peak memory and communication waits, gathered to every rank; rank 0 prints and saves them."""
    mine = {"rank": rank, "coords": dims.coords(), "peak_mem_bytes": peak_mem_bytes(device),
            **{f"wait_{a}_s": round(v, 3) for a, v in wait_totals.items()}, **(extra or {})}
    rows = [mine]
    if dist.is_initialized() and dims.world_size > 1:
        rows = [None] * dims.world_size
        dist.all_gather_object(rows, mine)
    summary = {"last": last, "ranks": rows}
    if rank == 0 and last:
        print_summary(last, rows)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def print_summary(last: dict, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"nanoTitan summary — step {last['step']}, layout dp={last['dp']} pp={last['pp']} ep={last['ep']}")
    for col in ("loss", "val loss", "tokens/s", "MFU", "step time"):
        t.add_column(col)
    t.add_row(f"{last['loss']:.4f}", f"{last.get('val_loss', float('nan')):.4f}", f"{last['tokens_per_sec']:.0f}",
              f"{100 * last['mfu']:.1f}%", f"{last['step_time_s'] * 1000:.0f} ms")
    console.print(t)
    r = Table(title="per rank (wait = time blocked in communication, whole run)")
    for col in ("rank", "(dp, pp, ep)", "peak mem", "DP all-reduce", "EP all-to-all", "PP send/recv", "other"):
        r.add_column(col)
    for row in rows:
        r.add_row(str(row["rank"]), str(tuple(row["coords"])), fmt_bytes(row["peak_mem_bytes"]),
                  f"{row['wait_dp_s']:.2f} s", f"{row['wait_ep_s']:.2f} s", f"{row['wait_pp_s']:.2f} s",
                  f"{row['wait_other_s']:.2f} s")
    console.print(r)


class Progress:
    """A rich progress bar with loss and tokens/s on rank 0 (plain lines when not a terminal)."""

    def __init__(self, total: int, enabled: bool):
        self.enabled, self.total = enabled, total
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        self.task = self.bar.add_task("train", total=total, info="")
        self.bar.start()

    def update(self, done: int, record: dict | None):
        if not self.enabled:
            return
        if record is None:
            self.bar.update(self.task, completed=done)
            return
        info = f"loss {record['loss']:.4f} | {record['tokens_per_sec']:.0f} tok/s | mfu {100 * record['mfu']:.1f}%"
        self.bar.update(self.task, completed=done, info=info)
        if not self.bar.console.is_terminal:
            self.bar.console.print(f"step {record['step']:>5} | {info} | lr {record['lr']:.2e}")

    def close(self):
        if self.enabled:
            self.bar.stop()
