"""`nanotitan bench pp`: pipeline schedules side by side -- step time, bubble, activation memory, timelines --
on the MID model (docs/design.md), PP=2, M=8, m=2.

    nanotitan bench pp [--repeats 5] [--layers 4] [--splits even auto] [--schedules ...] [--json out.json]
                       [--timeline docs/pp_timeline.png]

Launches 2 gloo processes (1 thread each) and runs, interleaved round by round so machine noise hits every
variant alike:
- single: the full model, gradient accumulation over the same 8 microbatches (the other rank idles);
- single_x2 (unless --no-ceiling): the same on both ranks at once, no communication: half of it is this
  machine's ceiling for a 2-stage pipeline (two busy cores slow each other: shared caches, memory bandwidth);
- ours:  `pipeline_forward_backward` with gpipe, 1f1b, zb1 (one chunk per rank) and interleaved (V=2 chunks
         per rank, one layer each on 4 layers);
- torch: `torch.distributed.pipelining` ScheduleGPipe, Schedule1F1B, ScheduleInterleavedZeroBubble (the same one
         stage per rank as zb1) and ScheduleInterleaved1F1B (the same V=2 chunks as ours), on the same modules;
- each of them per split in --splits: "even" (whole layers, as evenly as possible: what torchtitan and torch's
  own splitting give), "auto" (`parallel.pp_layers auto`: balanced by the planner's costs, cuts between a
  block's attention and its MoE allowed; variant names end in "@auto"), or an explicit list such as 2.5,1.5.
A step is zero_grad + forward/backward of all 8 microbatches + fused AdamW step; its time is the max over the
two ranks after a barrier. Reported per variant: min/median step time and the ratios of medians; CPU seconds
per stage (`time.process_time`, which does not depend on whether the rank got a core); the measured bubble:
ours `StepStats.p2p_wait_s / wall_s` per stage, and for every variant the idle fraction 1 - CPU s / step time
per stage (a rank blocked in gloo sleeps); the peak saved activations per stage (the bytes of distinct
storages autograd holds for a pending backward, parameters excluded); and for ours a timeline of one step
(per rank: F, B, W, blocked P2P) drawn with matplotlib. torch's stages return one tensor, so they
backpropagate the CE only, ours CE + the MoE balance loss: a slight advantage to torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..config.config import Config, ModelConfig, ParallelConfig
from ..model.spec import build_chunk_specs, chunk_layer_counts
from ..model.transformer import Transformer
from ..observe.memory import SavedActivations
from ..parallel.dims import ParallelDims
from ..parallel.pp.facts import theoretical_bubble, virtual_stages
from ..parallel.pp.schedules import RunOptions, pipeline_forward_backward
from ..parallel.pp.chunks import StageChunks
from ..parallel.pp.comms import StageComms
from ..resolve import auto_layer_counts
from ..run.spawn import run_ranks

PP, M, MB, SEQ, VOCAB, D, V = 2, 8, 2, 128, 4096, 256, 2
SEED, AUX_WEIGHT = 0, 0.01 / 4
OURS = ("gpipe", "1f1b", "zb1", "interleaved")
TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "zb1": "ScheduleInterleavedZeroBubble",
         "interleaved": "ScheduleInterleaved1F1B"}  # torch's counterpart of each of ours, on the same stages


def mid_cfg(n_layers: int, split, schedule: str = "1f1b") -> Config:
    """The MID model on PP stages; split "even", "auto" or a list of layers per stage (V=1 schedules only; the
    interleaved schedule takes "auto" or its even chunks)."""
    model = ModelConfig(vocab_size=VOCAB, d_model=D, n_layers=n_layers, n_heads=4, ffn_dim=512, num_experts=8,
                        top_k=2, max_seq_len=SEQ)
    pp_layers = split if split == "auto" else ([] if split == "even" or schedule == "interleaved" else list(split))
    cfg = Config(model=model, parallel=ParallelConfig(pp=PP, schedule=schedule, pp_layers=pp_layers,
                                                      virtual_stages=virtual_stages(schedule, PP, V)))
    cfg.train.device, cfg.train.micro_batch, cfg.train.seq_len = "cpu", MB, SEQ
    if split == "auto":  # the split a job of this config runs (resolve.py)
        cfg.parallel.pp_layers = auto_layer_counts(cfg)
    return cfg


def split_tag(split) -> str:
    """The suffix of a variant's name for its split: "" (even), "@auto", "@2.5,1.5"."""
    return "" if split == "even" else f"@{split if split == 'auto' else ','.join(map(str, split))}"


def chunk_models(cfg: Config, pp_rank: int) -> list[Transformer]:
    return [Transformer(cfg.model, spec, SEED) for spec in build_chunk_specs(cfg, pp_rank, 0)]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


class LogitsStage(nn.Module):
    """torch.distributed.pipelining wants one tensor out of a stage: hidden states, or logits on the last."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)[0]


def ce_loss(logits, targets):
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def _single_steps(rank: int, args, xs, ys, steps: dict, models: dict) -> None:
    """One process: the full model with gradient accumulation. "single" runs it on rank 0 while rank 1 idles at
    the barrier; "single_x2" runs it on both ranks at once, each on its own copy, with no communication: how
    much two busy cores slow each other down here (shared caches, memory bandwidth, a VM's host), which bounds
    what any 2-stage pipeline can reach on this machine, ours and torch's alike."""
    steps["single"], models["single"] = (lambda: None), []
    if rank == 0 or args.ceiling:  # rank 1 needs its own copy only for single_x2
        full = Transformer(mid_cfg(args.layers, "even").model, None, SEED)
        opt_full = adamw(full.parameters())

        def single():
            opt_full.zero_grad(set_to_none=True)
            for x, y in zip(xs, ys):
                ce, aux = full(x, y)
                ((ce + AUX_WEIGHT * aux) / M).backward()
            opt_full.step()
        if rank == 0:
            steps["single"], models["single"] = single, [full]
        if args.ceiling:
            steps["single_x2"], models["single_x2"] = single, [full]


def _ours_step(cfg: Config, dims, comms, xs, ys, name: str, stats_of: dict):
    """Our `pipeline_forward_backward` of cfg's schedule on this rank's chunks: (step, chunks); each step's
    StepStats go to stats_of[name]."""
    chunks = chunk_models(cfg, dims.pp_rank)
    model = chunks[0] if len(chunks) == 1 else StageChunks(chunks)
    opt = adamw(model.parameters())
    schedule = cfg.parallel.schedule

    def ours(timeline=None):
        opt.zero_grad(set_to_none=True)
        stats_of[name] = pipeline_forward_backward(
            model, dims, xs, ys, comms=comms, schedule=schedule, aux_weight=AUX_WEIGHT, loss_scale=1.0 / M,
            before_backward=None, options=RunOptions(timeline=timeline))
        opt.step()
    return ours, chunks


def _torch_step(cfg: Config, dims, x_BS, y_BS):
    """torch.distributed.pipelining's counterpart of cfg's schedule on the same chunks: (step, chunks)."""
    import torch.distributed.pipelining as pipelining

    schedule = cfg.parallel.schedule
    tchunks = chunk_models(cfg, dims.pp_rank)
    n_stages = PP * len(tchunks)
    stages = []
    for v, chunk in enumerate(tchunks):
        c = v * PP + dims.pp_rank
        example = (x_BS[:MB],) if c == 0 else (torch.zeros(MB, SEQ, D, requires_grad=True),)
        stages.append(pipelining.PipelineStage(LogitsStage(chunk), c, n_stages, torch.device("cpu"),
                                               input_args=example, group=dims.group("pp")))
    cls = getattr(pipelining, TORCH[schedule])
    sched = cls(stages[0], n_microbatches=M, loss_fn=ce_loss) if schedule in ("gpipe", "1f1b") \
        else cls(stages, n_microbatches=M, loss_fn=ce_loss)
    topt = adamw([p for c in tchunks for p in c.parameters()])

    def torch_step():
        topt.zero_grad(set_to_none=True)
        if dims.is_pp_first_stage:
            sched.step(x_BS)
        else:
            sched.step(target=y_BS, losses=[])
        topt.step()
    return torch_step, tchunks


def _timed(fn, cpu: list | None = None) -> float:
    """One step after a barrier: its wall seconds, the max over ranks (this rank's CPU seconds appended to cpu)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    dt = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item()


def _time_steps(steps: dict, stats_of: dict, repeats: int) -> dict:
    """Every variant warmed up, then timed round by round: step times, this rank's CPU seconds per step (immune to
    waiting for a core), ours' bubbles, and the load average before and after."""
    cpu = {name: [] for name in steps}
    for name, fn in steps.items():  # warm-up: allocator, gloo pairs, torch's stage shape inference
        for _ in range(2):
            _timed(fn)
    times = {name: [] for name in steps}
    bubbles = {name: [] for name in steps if name.startswith("ours")}
    load_before = os.getloadavg()[0]
    for _ in range(repeats):
        for name, fn in steps.items():
            times[name].append(_timed(fn, cpu[name]))
            if name in bubbles:
                bubbles[name].append(stats_of[name].bubble)
    return dict(times=times, cpu=cpu, bubbles=bubbles, load=(load_before, os.getloadavg()[0]))


def _bench(rank, world, args):
    dims = ParallelDims(1, world, 1, rank).build_groups()
    g = torch.Generator().manual_seed(0)
    x_BS = torch.randint(0, VOCAB, (M * MB, SEQ), generator=g)
    y_BS = torch.randint(0, VOCAB, (M * MB, SEQ), generator=g)
    xs, ys = list(x_BS.split(MB)), list(y_BS.split(MB))
    comms = StageComms(dims, (MB, SEQ, D), torch.float32, torch.device("cpu"))  # ours: kept across steps
    steps, models = {}, {}  # variant -> one step on this rank; variant -> the modules it trains
    stats_of = {}  # ours: variant -> last StepStats
    _single_steps(rank, args, xs, ys, steps, models)
    for schedule, split in ((sc, sp) for sp in args.splits for sc in args.schedules):
        cfg, tag = mid_cfg(args.layers, split, schedule), split_tag(split)
        if (name := f"ours_{schedule}{tag}") in args.variants:
            steps[name], models[name] = _ours_step(cfg, dims, comms, xs, ys, name, stats_of)
        if (name := f"torch_{schedule}{tag}") in args.variants:
            steps[name], models[name] = _torch_step(cfg, dims, x_BS, y_BS)
    res = _time_steps(steps, stats_of, args.repeats)

    # Peak saved-activation bytes per stage (untimed steps), and one step's timeline of each of ours.
    peak, timelines = {}, {}
    for name, fn in steps.items():
        if name.startswith("single"):
            continue
        meter = SavedActivations(nn.ModuleList(models[name]))
        with meter:
            _timed(fn)
        assert name.startswith("torch") or meter.bytes == 0, f"{name}: {meter.bytes} saved bytes alive after the step"
        peak[name] = meter.peak_bytes
    for name in (n for n in steps if n.startswith("ours")):  # 3 steps each: the picture shows the fastest
        timelines[name] = [[] for _ in range(3)]
        for tl in timelines[name]:
            dist.barrier()
            steps[name](timeline=tl)
    counts = {str(sp): chunk_layer_counts(mid_cfg(args.layers, sp, "1f1b")) for sp in args.splits}
    return dict(res, peak=peak, timelines=timelines, counts=counts)


def draw_timelines(res: dict, path: str) -> None:
    """One panel per schedule of ours: a row per rank, F / B / W bars and blocked P2P, over one step (of the
    recorded ones, the shortest: the least disturbed by other processes on the cores)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res[0]["timelines"])
    colors = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452", "wait": "#c44e52"}
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.3 + 1.1 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        def span(k):
            evs = [ev for r in res for ev in res[r]["timelines"][name][k]]
            return max(ev[4] for ev in evs) - min(ev[3] for ev in evs)
        k = min(range(len(res[0]["timelines"][name])), key=span)
        t0 = min(ev[3] for r in res for ev in res[r]["timelines"][name][k])
        end = span(k)
        for r in res:
            for kind, v, i, a, b in res[r]["timelines"][name][k]:
                y = PP - 1 - r
                h = 0.35 if kind == "wait" else 0.8
                ax.broken_barh([(a - t0, b - a)], (y - h / 2, h), facecolors=colors[kind],
                               edgecolors="white" if kind != "wait" else "none", linewidth=0.3)
                if kind != "wait" and (b - a) > end / 70:
                    ax.text((a + b) / 2 - t0, y, f"{i}" if v < 1 else f"{i}'", ha="center", va="center",
                            fontsize=6, color="white")
        ax.set_yticks(range(PP), [f"rank {PP - 1 - y}" for y in range(PP)])
        ax.set_xlim(0, end)
        ax.set_title(f"ours {name.removeprefix('ours_')}: one step, {end * 1000:.0f} ms", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds since the step started (F forward, B backward / input gradient, "
                           "W weight gradient, red: blocked in P2P; ' = second chunk)")
    handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in colors.items()]
    fig.legend(handles=handles, loc="upper right", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=130)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan bench pp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per variant, interleaved (default 5)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the MID model (default 4)")
    ap.add_argument("--splits", nargs="+", default=["even", "auto"],
                    help="stage splits, each run by every schedule: even, auto, or layers per stage such as 2.5,1.5 "
                         "(gpipe/1f1b/zb1 only; default: even auto)")
    ap.add_argument("--schedules", nargs="+", default=list(OURS), choices=OURS)
    ap.add_argument("--only", choices=["ours", "torch"], default=None, help="run only ours or only torch's")
    ap.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                    help="skip single_x2 (the one-process step on both ranks at once: this machine's ceiling)")
    ap.add_argument("--json", default="", help="also write the raw results here")
    ap.add_argument("--timeline", default="", help="draw ours' one-step timelines into this PNG")
    args = ap.parse_args(argv)
    args.splits = [sp if sp in ("even", "auto") else [float(n) for n in sp.split(",")] for sp in args.splits]
    tags = [split_tag(sp) for sp in args.splits]
    args.variants = {f"{who}_{s}{tag}" for s in args.schedules for tag in tags for who in ("ours", "torch")
                     if args.only in (None, who) and not (s == "interleaved" and tag not in ("", "@auto"))}

    res = dict(enumerate(run_ranks(_bench, PP, (args,), timeout=3600, pg_timeout=900)))

    times = res[0]["times"]
    med = {k: statistics.median(v) for k, v in times.items()}
    mn = {k: min(v) for k, v in times.items()}
    cpu = {k: [statistics.median(res[r]["cpu"][k]) for r in range(PP)] for k in times}
    print(f"MID model ({args.layers} layers; layers per stage by split, one chunk per rank: {res[0]['counts']}), "
          f"PP={PP}, M={M}, "
          f"m={MB}, seq {SEQ}, 1 thread/rank, {args.repeats} repeats (step = zero_grad + fwd/bwd + fused AdamW); "
          f"1-min load average {res[0]['load'][0]:.1f} -> {res[0]['load'][1]:.1f} on {os.cpu_count()} cores")
    print(f"{'variant':<24}{'min s':>8}{'median s':>10}{'x single (med)':>16}{'CPU s per stage':>22}"
          f"{'idle per stage':>18}{'peak act MiB':>16}")
    for k in times:
        idle = "" if k.startswith("single") else str([round(1 - c / med[k], 2) for c in cpu[k]])
        pk = "" if k.startswith("single") else str([round(res[r]["peak"][k] / 2**20, 1) for r in range(PP)])
        cp = str([round(c, 3) for c in cpu[k]]) if k != "single" else f"{cpu[k][0]:.3f}"
        print(f"{k:<24}{mn[k]:>8.3f}{med[k]:>10.3f}{med['single'] / med[k]:>16.2f}{cp:>22}{idle:>18}{pk:>16}")
    cpu_single = cpu["single"][0]
    print("\nsingle CPU s / slowest stage's CPU s (the balance bound on the speed-up):")
    for k in times:
        if not k.startswith("single"):
            print(f"  {k:<24}{cpu_single / max(cpu[k]):.2f}")
    print("\nmeasured bubble of ours (time blocked in P2P / time in the schedule; median per stage, mean):")
    for k in res[0]["bubbles"]:
        sched = k.removeprefix("ours_").partition("@")[0]
        theo = theoretical_bubble(PP, M, sched, V)
        per_stage = [statistics.median(res[r]["bubbles"][k]) for r in range(PP)]
        mean = sum(per_stage) / PP
        print(f"  {k:<24}{[round(b, 3) for b in per_stage]}  mean {mean:.3f}; theoretical {theo:.3f}; "
              f"1F1B's theoretical {theoretical_bubble(PP, M):.3f}")
    print("\nours / torch's on the same stages (median step time):")
    for k in (k for k in med if k.startswith("ours_") and "torch_" + k[5:] in med):
        sched, _, split = k[5:].partition("@")
        theirs_name = TORCH[sched] + ("@" + split if split else "")
        print(f"  {k[5:]:<18} / {theirs_name:<36} {med[k] / med['torch_' + k[5:]]:.2f}")
    ours = {k: v for k, v in med.items() if k.startswith("ours")}
    theirs = {k: v for k, v in med.items() if k.startswith("torch")}
    if ours and theirs:
        best, tbest = min(ours, key=ours.get), min(theirs, key=theirs.get)
        print(f"best of ours {best} / torch's best {tbest}: {ours[best] / theirs[tbest]:.2f}")
        even = {k: v for k, v in theirs.items() if "@" not in k}
        if even and len(even) < len(theirs):
            teven = min(even, key=even.get)
            print(f"best of ours {best} / torch's best on whole-layer stages {teven}: {ours[best] / even[teven]:.2f}")
        if "torch_1f1b" in med:
            print(f"best of ours {best} / torch Schedule1F1B (whole-layer stages): "
                  f"{ours[best] / med['torch_1f1b']:.2f}")
    if "single_x2" in med:
        # Two stages that split the work evenly, never wait and slow each other as two whole steps at once do.
        ceiling = med["single_x2"] / PP
        print(f"\nthis machine's ceiling for PP={PP}: single_x2 / {PP} = {ceiling:.3f} s (two cores at once run "
              f"{med['single_x2'] / med['single']:.2f}x slower each than one alone)")
        # zb1 on 2 stages, F = B = W = f per microbatch: the last stage starts one F late and the first stage's
        # last B and W follow the last stage's last B, so a step is at least S + 2f = S (1 + 2/(3M)).
        zb1_bound = ceiling * (1 + 2 / (3 * M))
        print(f"  zb1's bound on it (fill and drain, F = B = W): ceiling x (1 + 2/(3M)) = {zb1_bound:.3f} s")
        if ours:
            best = min(ours, key=ours.get)
            print(f"  best of ours {best} / ceiling: {ours[best] / ceiling:.2f}; / zb1's bound: "
                  f"{ours[best] / zb1_bound:.2f}")
        if "torch_1f1b" in med:
            print(f"  ceiling / torch Schedule1F1B (whole-layer stages): {ceiling / med['torch_1f1b']:.2f} "
                  f"(no schedule does better here); zb1's bound / torch Schedule1F1B: "
                  f"{zb1_bound / med['torch_1f1b']:.2f}")
    if args.timeline:
        draw_timelines(res, args.timeline)
        print(f"timelines: {args.timeline}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(r): res[r] for r in res}, f, indent=1)
    return 0
