"""`nanotitan bench pp`: pipeline-parallel step time, bubble and activation memory on the MID model
(BASELINES), PP=2, M=8, m=2.

    nanotitan bench pp [--repeats 7] [--splits 2,2 3,1] [--json out.json]

Launches 2 gloo processes (1 thread each) and compares, interleaved round by round so machine noise
hits every variant alike:
- one process: the full model, gradient accumulation over the same 8 microbatches (the other rank idles);
- ours:  `pipeline_forward_backward` with schedule 1f1b and gpipe, for each layer split;
- torch: `torch.distributed.pipelining` Schedule1F1B / ScheduleGPipe on the same stages and microbatches.
A step is zero_grad + forward/backward of all 8 microbatches + fused AdamW step; its time is the max over
the two ranks after a barrier. Reported: min/median step time, ratios of medians, measured bubble
(time blocked in P2P ÷ time in the schedule, per stage) vs (PP-1)/(M+PP-1), and peak activation memory
per stage: the peak over the step of the bytes of distinct tensor storages that autograd holds saved for
backward (a saved_tensors_hooks pack/unpack pair counts each storage once while any saved reference to
it is alive; parameters are excluded). torch's schedules here backpropagate the CE only (their stages
return one tensor), ours CE + aux: a slight advantage to torch.
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

from ..config import Config, ModelConfig, ParallelConfig
from ..model.spec import build_shard_spec
from ..model.transformer import Transformer
from ..parallel.dims import ParallelDims
from ..parallel.pp import pipeline_forward_backward, theoretical_bubble
from ..parallel.pp_comms import StageComms
from ..spawn import run_ranks

PP, M, MB, SEQ, VOCAB, D = 2, 8, 2, 128, 4096, 256
SEED, AUX_WEIGHT = 0, 0.01 / 4


def mid_cfg(pp: int, split: list[int] | None) -> Config:
    model = ModelConfig(vocab_size=VOCAB, d_model=D, n_layers=4, n_heads=4, ffn_dim=512, num_experts=8, top_k=2,
                        max_seq_len=SEQ)
    return Config(model=model, parallel=ParallelConfig(pp=pp, pp_layers=list(split or [])))


class SavedActivationBytes:
    """Live bytes of distinct storages saved for backward (parameters excluded), and their peak."""

    class _Handle:
        def __init__(self, owner, t):
            self.owner, self.t, self.key = owner, t, t.untyped_storage().data_ptr()
            refs, nbytes = owner.live.get(self.key, (0, t.untyped_storage().nbytes()))
            if refs == 0:
                owner.cur += nbytes
                owner.peak = max(owner.peak, owner.cur)
            owner.live[self.key] = (refs + 1, nbytes)

        def __del__(self):
            refs, nbytes = self.owner.live[self.key]
            if refs == 1:
                del self.owner.live[self.key]
                self.owner.cur -= nbytes
            else:
                self.owner.live[self.key] = (refs - 1, nbytes)

    def __init__(self, params):
        self.param_keys = {p.untyped_storage().data_ptr() for p in params}
        self.live, self.cur, self.peak = {}, 0, 0

    def hooks(self):
        pack = lambda t: t if t.untyped_storage().data_ptr() in self.param_keys else self._Handle(self, t)
        unpack = lambda h: h.t if isinstance(h, self._Handle) else h
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class LogitsStage(nn.Module):
    """torch.distributed.pipelining wants one tensor out of a stage: hidden states, or logits on the last."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)[0]


def ce_loss(logits, targets):
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def _bench(rank, world, args):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    dims = ParallelDims(1, world, 1, rank).build_groups()
    g = torch.Generator().manual_seed(0)
    x_BS = torch.randint(0, VOCAB, (M * MB, SEQ), generator=g)
    y_BS = torch.randint(0, VOCAB, (M * MB, SEQ), generator=g)
    xs, ys = list(x_BS.split(MB)), list(y_BS.split(MB))
    comms = StageComms(dims, (MB, SEQ, D), torch.float32, torch.device("cpu"))  # ours: kept across steps
    steps = {}  # variant name -> callable running one step on this rank
    stats_of = {}  # variant name -> last StepStats (ours)

    def adamw(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    # one process: full model on rank 0, rank 1 idles at the barrier
    if rank == 0:
        full = Transformer(mid_cfg(1, None).model, None, SEED)
        opt_full = adamw(full)

        def single():
            opt_full.zero_grad(set_to_none=True)
            for x, y in zip(xs, ys):
                ce, aux = full(x, y)
                ((ce + AUX_WEIGHT * aux) / M).backward()
            opt_full.step()
        steps["single"] = single
    else:
        steps["single"] = lambda: None

    for split in args.splits:
        cfg = mid_cfg(PP, split)
        spec = build_shard_spec(cfg, dims.pp_rank, 0)
        tag = ",".join(map(str, split))
        for schedule in ("1f1b", "gpipe"):
            model = Transformer(cfg.model, spec, SEED)
            opt = adamw(model)

            def ours(model=model, opt=opt, schedule=schedule, name=f"ours_{schedule}[{tag}]"):
                opt.zero_grad(set_to_none=True)
                stats_of[name] = pipeline_forward_backward(
                    model, dims, xs, ys, comms=comms, schedule=schedule, aux_weight=AUX_WEIGHT, loss_scale=1.0 / M,
                    before_backward=None)
                opt.step()
            steps[f"ours_{schedule}[{tag}]"] = ours

            tmodel = Transformer(cfg.model, spec, SEED)
            topt = adamw(tmodel)
            example = (x_BS[:MB],) if dims.is_pp_first_stage else (torch.zeros(MB, SEQ, D, requires_grad=True),)
            stage = PipelineStage(LogitsStage(tmodel), dims.pp_rank, PP, torch.device("cpu"), input_args=example,
                                  group=dims.group("pp"))
            cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
            sched = cls(stage, n_microbatches=M, loss_fn=ce_loss)

            def torch_step(sched=sched, topt=topt):
                topt.zero_grad(set_to_none=True)
                if dims.is_pp_first_stage:
                    sched.step(x_BS)
                else:
                    sched.step(target=y_BS, losses=[])
                topt.step()
            steps[f"torch_{schedule}[{tag}]"] = torch_step

    cpu = {name: [] for name in steps}  # this rank's CPU seconds per step (immune to waiting for a core)

    def timed(fn, name=None) -> float:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        if name is not None:
            cpu[name].append(time.process_time() - c0)
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return dt.item()

    for name, fn in steps.items():  # warm-up: allocator, gloo pairs, torch's stage shape inference
        for _ in range(2):
            timed(fn)
    times = {name: [] for name in steps}
    bubbles = {name: [] for name in steps if name.startswith("ours")}
    computes = {name: [] for name in bubbles}
    load_before = os.getloadavg()[0]
    for _ in range(args.repeats):
        for name, fn in steps.items():
            times[name].append(timed(fn, name))
            if name in bubbles:
                bubbles[name].append(stats_of[name].bubble)
                computes[name].append(stats_of[name].compute_s)

    # peak saved-activation bytes per stage, ours 1F1B vs GPipe (untimed steps)
    cfg = mid_cfg(PP, args.splits[0])
    peak = {}
    for schedule in ("1f1b", "gpipe"):
        model = Transformer(cfg.model, build_shard_spec(cfg, dims.pp_rank, 0), SEED)
        meter = SavedActivationBytes(model.parameters())
        with meter.hooks():
            pipeline_forward_backward(model, dims, xs, ys, comms=comms, schedule=schedule, aux_weight=AUX_WEIGHT,
                                      loss_scale=1.0 / M, before_backward=None)
        assert meter.cur == 0, f"{meter.cur} saved bytes still alive after the step"
        peak[schedule] = meter.peak
    return dict(times=times, cpu=cpu, bubbles=bubbles, computes=computes, peak=peak,
                load=(load_before, os.getloadavg()[0]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan bench pp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7, help="timed steps per variant, interleaved (default 7)")
    ap.add_argument("--splits", nargs="+", default=["2,2", "3,1"], help="layers per stage, e.g. 2,2 3,1")
    ap.add_argument("--json", default="", help="also write the raw results here")
    args = ap.parse_args(argv)
    args.splits = [[int(n) for n in s.split(",")] for s in args.splits]

    res = dict(enumerate(run_ranks(_bench, PP, (args,), timeout=1800, pg_timeout=600)))

    times = res[0]["times"]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"MID model, PP={PP}, M={M}, m={MB}, seq {SEQ}, 1 thread/rank, {args.repeats} repeats "
          f"(step = zero_grad + fwd/bwd + fused AdamW); 1-min load average {res[0]['load'][0]:.1f} -> "
          f"{res[0]['load'][1]:.1f} on {os.cpu_count()} cores")
    mn = {k: min(v) for k, v in times.items()}
    print(f"{'variant':<22}{'min s':>8}{'median s':>10}{'speedup (min)':>15}{'speedup (median)':>18}")
    for k in times:
        print(f"{k:<22}{mn[k]:>8.3f}{med[k]:>10.3f}{mn['single'] / mn[k]:>15.2f}{med['single'] / med[k]:>18.2f}")
    # CPU seconds per stage (median): how the work splits, whatever else competes for the cores
    cpu_single = statistics.median(res[0]["cpu"]["single"])
    print(f"\nCPU s per step: single {cpu_single:.3f}")
    for k in times:
        if k != "single":
            per = [statistics.median(res[r]["cpu"][k]) for r in range(PP)]
            print(f"CPU s per step {k:<18} per stage {[round(c, 3) for c in per]}  "
                  f"single / max stage = {cpu_single / max(per):.2f}")
    theo = theoretical_bubble(PP, M)
    print(f"\ntheoretical bubble (PP-1)/(M+PP-1) = {theo:.3f}")
    for k in res[0]["bubbles"]:
        per_stage = [statistics.median(res[r]["bubbles"][k]) for r in range(PP)]
        compute = [statistics.median(res[r]["computes"][k]) for r in range(PP)]
        mean = sum(per_stage) / PP
        print(f"measured bubble {k:<18} median per stage {[round(b, 3) for b in per_stage]}  mean {mean:.3f} "
              f"= {mean / theo:.2f} x theoretical; compute s per stage {[round(c, 3) for c in compute]}")
        # the fastest step is the one least disturbed by other processes competing for the cores
        fastest = times[k].index(mn[k])
        per_stage = [res[r]["bubbles"][k][fastest] for r in range(PP)]
        mean = sum(per_stage) / PP
        print(f"{'':16}{'':<18} fastest step per stage {[round(b, 3) for b in per_stage]}  mean {mean:.3f} "
              f"= {mean / theo:.2f} x theoretical")
    for split in args.splits:
        tag = ",".join(map(str, split))
        for sched, cls in (("1f1b", "Schedule1F1B"), ("gpipe", "ScheduleGPipe")):
            ours, ref = f"ours_{sched}[{tag}]", f"torch_{sched}[{tag}]"
            print(f"split {tag}: ours {sched} / torch {cls}: min {mn[ours] / mn[ref]:.2f}, "
                  f"median {med[ours] / med[ref]:.2f}")
    split0 = ",".join(map(str, args.splits[0]))
    for r in range(PP):
        pk = res[r]["peak"]
        print(f"stage {r} [{split0}] peak saved activations: 1F1B {pk['1f1b'] / 2**20:.1f} MiB, "
              f"GPipe {pk['gpipe'] / 2**20:.1f} MiB ({pk['1f1b'] / pk['gpipe']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(r): res[r] for r in res}, f, indent=1)
    return 0
