"""What a run tells its user: the per-step record, MoE load statistics, the end-of-run summary, and the observers a
rank opens for them (writer, profiler, memory meters). The console's step lines and bar are console.py's.

The record's fields are the `metrics.jsonl` surface (docs/design.md §5); the summary gathers one row per rank
(coordinates, peak memory, communication waits per axis) to global rank 0, which prints it as a table
and writes `summary.json`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .memory import StepMeters, live_tensor_bytes, peak_mem_bytes
from .metrics import MetricsWriter, fmt_bytes
from .profiling import StepProfiler
from ..model.spec import chunk_layer_counts
from ..model.transformer import flops_per_token, is_moe_layer
from ..parallel.comm import collectives as comm
from ..parallel.compile import first_compile_s
from ..parallel.dims import ParallelDims
from ..parallel.lanes import LaneMeans
from ..parallel.pp.facts import theoretical_bubble
from ..parallel.pp.schedules import StepStats
from ..parallel.step import RouterFigures, StepResult


def step_record(*, step: int, ce_loss: float, aux_loss: float, grad_norm: float, lr: float, step_time: float,
                tokens_per_step: int, flops_per_token: float, peak_flops: float, device: torch.device,
                dims: ParallelDims, M: int, schedule: str, stats: StepStats, comm_stats: dict,
                virtual_stages: int = 1, mtp_loss: float | None = None) -> dict:
    """One line of metrics.jsonl (step is 1-based: the number of optimizer steps taken). `loss` is the objective,
    ce_loss the main head's CE (comparable with runs without MTP), aux_loss and mtp_loss (with MTP) weighted."""
    tok_s = tokens_per_step / step_time
    record = {
        "step": step, "loss": ce_loss + aux_loss + (mtp_loss or 0.0), "ce_loss": ce_loss, "aux_loss": aux_loss,
        **({"mtp_loss": mtp_loss} if mtp_loss is not None else {}),
        "grad_norm": grad_norm, "lr": lr, "tokens_per_sec": tok_s, "step_time_s": step_time,
        "mfu": flops_per_token * tok_s / peak_flops, "peak_mem_bytes": peak_mem_bytes(device),
        "dp": dims.dp, "pp": dims.pp, "ep": dims.ep, "tp": dims.tp, "cp": dims.cp, "microbatches": M,
        "schedule": schedule if dims.pp > 1 else "none", "tokens": step * tokens_per_step, **comm_stats,
    }
    if dims.pp > 1:
        busy = stats.compute_s + stats.p2p_wait_s
        record["bubble_measured"] = stats.p2p_wait_s / busy if busy > 0 else 0.0
        record["bubble_theory"] = theoretical_bubble(dims.pp, M, schedule, virtual_stages)
    return record


def router_record(fig: RouterFigures, cfg) -> dict:
    """The record's router fields from the figures the step reduced over the world (parallel/step.py `StepEnd`), since
    the previous record: tokens per expert per MoE layer (`expert_load`, what the router chose, drops included) and
    each layer's max/mean of it (`expert_max_mean`; `expert_imbalance` is the worst layer), the balance loss and z-loss
    unweighted and averaged over MoE layers and microbatches, the share of assignments dropped by capacity
    (`dropped_frac`, when model.capacity_factor > 0), the router biases after this step (`router_bias`, when
    model.bias_update_rate > 0); and the routing skew of each training microbatch, per MoE layer: `expert_cv`, the CV
    over experts of one source rank's tokens per expert (the planner's sigma, `--expert-skew`), averaged; under EP,
    `ep_recv_max_mean`: the busiest EP rank's received assignments over its group's mean, averaged over layers and
    microbatches: what the time model charges the busiest rank's expert GEMMs and all-to-all by (plan/skew.py), with
    expert e on rank e // (E/EP); `ep_placed_max_mean`, the same under the placement in force
    (parallel.expert_placement=balanced: each copy of an expert receives its cut of the microbatch). `cfg`: the
    model's config."""
    E = cfg.num_experts
    n = cfg.n_layers + cfg.mtp_layers  # the MTP blocks are layers n_layers.. (model/mtp.py)
    moe_rows = fig.rows[[i for i in range(n) if is_moe_layer(cfg, i)]]
    load, sums = moe_rows[:, :E], moe_rows[:, E:].sum(dim=0)  # sums: [balance, z, dropped, assignments, calls]
    max_mean = load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-9)
    calls = sums[4].clamp_min(1)
    head = torch.stack([load.min(), load.max(), max_mean.max(), sums[0] / calls, sums[1] / calls,
                        sums[2] / sums[3].clamp_min(1)])
    (lo, hi, worst, balance, z_loss, dropped), per_layer = head.tolist(), max_mean.tolist()
    out = {"expert_load": load.long().tolist(), "expert_load_min": int(lo), "expert_load_max": int(hi),
           "expert_imbalance": round(worst, 4), "expert_max_mean": [round(v, 4) for v in per_layer],
           "balance_loss": balance, "z_loss": z_loss}
    if cfg.capacity_factor:
        out["dropped_frac"] = dropped
    if cfg.bias_update_rate:
        out["router_bias"] = fig.biases
    cv_sum, cv_n, r_sum, r_n, p_sum, p_n = fig.skew
    if cv_n:
        out["expert_cv"] = round(cv_sum / cv_n, 4)
    if r_n:
        out["ep_recv_max_mean"] = round(r_sum / r_n, 4)
    if p_n:
        out["ep_placed_max_mean"] = round(p_sum / p_n, 4)
    return out


def gather_summary(last: dict, rank: int, dims: ParallelDims, device: torch.device, wait_totals: dict,
                   run_dir: Path, extra: dict | None = None) -> dict:
    """Per-rank peak memory and communication waits, gathered to every rank; rank 0 prints and saves them."""
    mine = {"rank": rank, "coords": dims.coords(), "tp_rank": dims.tp_rank, "cp_rank": dims.cp_rank,
            "peak_mem_bytes": peak_mem_bytes(device),
            **{f"wait_{a}_s": round(v, 3) for a, v in wait_totals.items()}, **(extra or {})}
    rows = gather_rows(mine, dims, device)
    summary = {"last": last, "ranks": rows}
    if rank == 0 and last:
        print_summary(last, rows)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


# A summary row's values as numbers: (kind, value) per scalar, kind 0 None, 1 int, 2 float (float64 holds every int
# below 2**53 exactly: byte counts, ranks).
_NONE, _INT, _FLOAT = 0.0, 1.0, 2.0


def gather_rows(mine: dict, dims: ParallelDims, device: torch.device) -> list[dict]:
    """Every rank's summary row, in rank order, on every rank: one SUM all-reduce of a (world, 2 * fields) float64
    table in which each rank fills its own row (x + 0 is exact), so no rank unpickles what a peer sends, as an
    object collective would. Every rank builds its row with the same code, hence the same keys in the same
    order, each value an int, a float, None, or a list/tuple of ints (the coordinates); the table is read back by
    this rank's own keys."""
    if not (dist.is_initialized() and dims.world_size > 1):
        return [mine]
    shape = {k: (type(v), len(v)) if isinstance(v, (list, tuple)) else None for k, v in mine.items()}
    flat = [x for v in mine.values() for x in (v if isinstance(v, (list, tuple)) else [v])]
    pairs = [(_NONE, 0.0) if x is None else (_INT, float(x)) if isinstance(x, int) else (_FLOAT, float(x))
             for x in flat]
    table = torch.zeros(dims.world_size, 2 * len(pairs), device=device, dtype=torch.float64)
    table[dims.rank] = torch.tensor([c for pair in pairs for c in pair], dtype=torch.float64)
    comm.all_reduce(table, axis="other")
    rows = []
    for numbers in table.tolist():
        values = iter(None if kind == _NONE else int(x) if kind == _INT else x
                      for kind, x in zip(numbers[0::2], numbers[1::2]))
        rows.append({k: next(values) if seq is None else seq[0](next(values) for _ in range(seq[1]))
                     for k, seq in shape.items()})
    return rows


def observers(cfg, rank: int, device: torch.device, model) -> tuple[MetricsWriter, StepProfiler, StepMeters]:
    """(writer, profiler, meters) of a rank's run: metrics.jsonl, TensorBoard and W&B on rank 0 (appended to on
    resume), torch.profiler over run.profile_steps, and the memory meters (metrics.StepMeters, some logged steps)."""
    writer = MetricsWriter(cfg.run.dir, rank == 0, cfg.run.tensorboard, append=cfg.train.resume not in ("", "never"),
                           wandb_project=cfg.run.wandb_project if cfg.run.wandb else "", config=dataclasses.asdict(cfg))
    return (writer, StepProfiler(cfg.run.profile_steps, rank, Path(cfg.run.dir), device),
            StepMeters(model, device, cfg.run.peak_every, cfg.train.compile))


def run_summary(logger: "StepLogger", profiler, writer, meters, model, optimizer, run_dir: Path) -> dict:
    """The end of a run: this rank's profile table printed (every rank its own; torchrun prefixes the lines with
    [rankN]:), then gather_summary's rows (collective) with each rank's live tensor bytes and meter peaks, and the
    writer closed."""
    profile = profiler.close()
    if profile:
        print(profile, flush=True)
    shard = logger.shard
    metered = {"act_peak_bytes": meters.act_peak_bytes, "peak_tensor_bytes": meters.peak_tensor_bytes}
    mem = {**live_tensor_bytes(model, optimizer), **(metered if meters.peak_every else {}),  # (0: none metered)
           "cpu_step_s": logger.last.get("cpu_step_s")}
    summary = gather_summary(logger.last, shard.dims.rank, shard.dims, logger.device, logger.wait_totals, run_dir, mem)
    writer.close()
    return summary


# The coordinates every layout shows, then the axes a layout shows only when it has them (degree > 1): a new axis
# (context parallel) joins the second list, with its `{axis}_rank` in the summary rows and its `{axis}` in the record.
SHOWN_AXES, OPTIONAL_AXES = ("dp", "pp", "ep"), ("cp", "tp")


def layout_axes(record: dict) -> tuple[str, ...]:
    """The axes of a run's layout, in coordinate order: dp, pp, ep, then each optional axis the record's layout has."""
    return SHOWN_AXES + tuple(a for a in OPTIONAL_AXES if record.get(a, 1) > 1)


def print_summary(last: dict, rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    axes = layout_axes(last)
    extra = axes[len(SHOWN_AXES):]
    console = Console(width=max(150, Console().width))  # 12 columns: rich's 80 off a terminal would fold them
    title = f"nanoTitan summary — step {last['step']}, layout " + " ".join(
        f"{a}={last.get(a, 1)}" for a in ("dp", "pp", "ep", "tp", "cp"))  # every factor, as the first line's
    t = Table(title=title, min_width=len(title))
    for col in ("loss", "val loss", "tokens/s", "MFU", "step time"):
        t.add_column(col)
    t.add_row(f"{last['loss']:.4f}", f"{last.get('val_loss', float('nan')):.4f}", f"{last['tokens_per_sec']:.0f}",
              f"{100 * last['mfu']:.1f}%", f"{last['step_time_s'] * 1000:.0f} ms")
    console.print(t)
    r = Table(title="per rank: live tensors between steps, peak saved activations, peak of all live tensors during a "
                    "step, peak memory (RSS on CPU), and seconds blocked in communication over the run")
    waits = ("dp", "ep", "pp", *extra, "other")
    for col in ("rank", f"({','.join(axes)})", "params", "grads", "optim", "acts peak", "step peak", "peak mem",
                *(f"{a.upper()} wait" for a in waits[:-1]), "other"):
        r.add_column(col)
    for row in rows:
        tensors = [fmt_bytes(row[k]) if k in row else "-"
                   for k in ("param_bytes", "grad_bytes", "optim_bytes", "act_peak_bytes", "peak_tensor_bytes")]
        coords = (*row["coords"], *(row.get(f"{a}_rank", 0) for a in extra))
        r.add_row(str(row["rank"]), str(coords), *tensors, fmt_bytes(row["peak_mem_bytes"]),
                  *(f"{row.get(f'wait_{a}_s', 0.0):.2f} s" for a in waits))
    console.print(r)


class StepLogger:
    """Builds the step records of a run, writes them (metrics.jsonl, TensorBoard, W&B: global rank 0 only)
    and keeps them, with the run's per-axis communication waits for the summary. Every step is `count`ed (its
    time, its lanes' figures); `log` writes a record of what the step reduced over the world (parallel/step.py: the
    losses, the router's figures, the step peak) with its own figures: the means over the steps since the previous
    record, the memory meters, the compile time (first record). No collective of its own."""

    def __init__(self, writer, shard, device: torch.device, cfg, peak_flops: float, meters: StepMeters):
        p, t = cfg.parallel, cfg.train
        self.writer, self.shard, self.device, self.cfg, self.meters = writer, shard, device, cfg, meters
        self.M, self.schedule, self.virtual_stages = p.microbatches, p.schedule, p.virtual_stages
        self.peak_flops = peak_flops
        self.tokens_per_step, self.flops_per_token = cfg.layout_batch * t.seq_len, flops_per_token(cfg.model, t.seq_len)
        self.history: list[dict] = []
        self.wait_totals = {a: 0.0 for a in comm.AXES}
        # A record's step time is the mean over the steps since the previous record, so a metered step (memory
        # meters) and any one-off stall are averaged in, not reported alone; the lanes' figures likewise.
        self.interval_s, self.interval_steps = 0.0, 0
        self.lanes = LaneMeans(shard.ep_lanes)
        self.replays = 0  # parallel.ep_dispatch static: steps replayed after an overflow, so far (ep_replays)
        self.cpu_mark = time.process_time()  # CPU seconds per step (cpu_step_s): this rank's work, whatever the load
        comm.COMM.reset()

    @property
    def last(self) -> dict:
        return self.history[-1] if self.history else {}

    def count(self, result: StepResult, seconds: float) -> None:
        """One step done in `seconds`: it joins the next record's interval."""
        self.interval_s, self.interval_steps = self.interval_s + seconds, self.interval_steps + 1
        self.lanes.add(result.stats)
        self.replays += result.replayed

    def log(self, step: int, result: StepResult, val_loss: float | None = None, skipped_steps: int = 0) -> dict:
        """The record of `step` (1-based), whose losses the step reduced (result.losses); written and kept."""
        losses, dims = result.losses, self.shard.dims
        assert losses is not None, f"step {step}: a record needs the step's reduced losses (train.py's train_step)"
        cstats = comm.COMM.snapshot_and_reset()
        for a in comm.AXES:
            self.wait_totals[a] += cstats[f"comm_{a}_wait_s"]
        record = step_record(step=step, ce_loss=losses.ce, aux_loss=losses.aux, grad_norm=float(result.grad_norm),
                             lr=result.lr, step_time=self.interval_s / self.interval_steps,
                             tokens_per_step=self.tokens_per_step, flops_per_token=self.flops_per_token,
                             peak_flops=self.peak_flops, device=self.device, dims=dims, M=self.M,
                             schedule=self.schedule, stats=result.stats, comm_stats=cstats,
                             virtual_stages=self.virtual_stages, mtp_loss=losses.mtp)
        cpu, self.cpu_mark = self.cpu_mark, time.process_time()
        record["cpu_step_s"] = (self.cpu_mark - cpu) / self.interval_steps
        self.interval_s, self.interval_steps = 0.0, 0
        record.update(router_record(result.router, self.cfg.model))
        # the memory meters since the previous record (metrics.StepMeters; None: no metered step, left out): the saved
        # activations, and the step peak maximised over ranks (the step did it)
        extra = {"val_loss": val_loss, "skipped": result.nonfinite, "skipped_steps": skipped_steps,
                 "qk_max": result.qk_max, "act_peak_bytes": self.meters.take_interval_acts(),
                 "peak_tensor_bytes": result.peak, "host_syncs": result.host_syncs, **self.lanes.take(),
                 "ep_replays": self.replays if self.cfg.parallel.ep_dispatch == "static" else None,
                 "compile_s": first_compile_s(self.cfg, not self.history)}
        record.update({k: v for k, v in extra.items() if v is not None})
        self.writer.write(record)
        self.history.append(record)
        return record


def layout_line(cfg, n_params: int, peak_flops: float, links=None) -> str:
    """The run's first line: the layout (with the layers per stage that pp_layers auto chose, halves shown), the
    batch arithmetic B = dp*ep*M*m, tokens per step, this rank's parameters, the MFU peak and threads per rank;
    then, under parallel.emulate, a line describing the emulated network (`links`, emulate.LinkModel)."""
    p, t = cfg.parallel, cfg.train
    per = "chunk" if p.schedule == "interleaved" else "stage"
    split = f" (layers per {per}: {chunk_layer_counts(cfg)})" if p.pp > 1 else ""
    B = cfg.layout_batch
    return (f"layout dp={p.dp} pp={p.pp}{split} ep={p.ep} tp={p.tp} cp={p.cp} | B={B} seqs = dp*ep*M*m = "
            f"{p.dp}*{p.ep}*{p.microbatches}*{t.micro_batch} (tp and cp ranks share them) | "
            f"{B * t.seq_len} tokens/step | "
            f"params on rank 0: {n_params / 1e6:.2f}M | peak {peak_flops / 1e9:.0f} GFLOP/s | threads/rank {t.threads}"
            + (f"\n{links.describe()}" if links is not None else ""))
