"""bf16 mixed precision vs fp32 on one CPU thread: step time side by side, and where the non-GEMM time goes.

    python -m nanotitan.bench.precision [--rounds 8] [--profile-steps 3] [--d-model 256]
    python -m nanotitan.bench.precision --wire      (bytes on the wire per axis, fp32 vs bf16, 2 gloo ranks)

Model: MID (docs/design.md) (d_model 256, 4 layers, 8 experts of 512, top-2, vocab 4096), 8x128 random tokens
per step, one process, 1 thread, the product's step (`parallel.step.forward_backward`, finish, fused AdamW).
Two shards with the same init, one per dtype, step in alternating order (the machine is shared: only
ratios taken within one run mean anything); reports min/median step time per dtype and bf16 / fp32, in
wall time and in this process's CPU time (one thread: CPU time is the compute, and it does not grow when
other jobs take the core away, which wall time does). Then torch.profiler over a few steps of each, one
profile per step and the minimum per operator over them (a descheduled op inflates one step, not all):
self time by category (GEMM, dtype casts, attention, elementwise, MoE routing/permutation, optimizer,
other) and the top operators of the bf16 step.

--wire: the communication accounting (parallel/comm/collectives.py) of one MID microbatch on each axis, 2 ranks: PP (one
activation (8, 128, 256) forward and its gradient back, StageComms), EP (one MoE layer's dispatch and combine,
forward and backward, 1,024 tokens per rank, the same routing in both dtypes), DP (one Reducer all-reduce of
the MID model's gradients, parallel.reduce_dtype fp32 vs bf16).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from ..config.config import load_config
from ..parallel import step
from ..parallel.dims import ParallelDims
from ..parallel.parallelize import parallelize

MID_ARGS = ["--model.vocab_size", "4096", "--data.vocab_size", "4096", "--model.d_model", "256",
            "--model.n_layers", "4", "--model.n_heads", "4", "--model.ffn_dim", "512", "--model.num_experts", "8",
            "--model.top_k", "2", "--train.seq_len", "128", "--train.micro_batch", "8", "--model.max_seq_len", "128"]
CPU = torch.device("cpu")

# Operator name -> category (first match wins); self time, so a matmul's cast of its input counts as a cast.
CATEGORIES = [
    ("GEMM", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_mkldnn", "mkldnn")),
    ("cast", ("aten::copy_", "aten::_to_copy", "aten::to")),
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention")),
    ("MoE routing/permutation", ("aten::index", "aten::argsort", "aten::sort", "aten::topk", "aten::bincount",
                                 "aten::repeat_interleave", "aten::scatter", "aten::gather", "aten::embedding")),
    ("optimizer", ("adamw", "_fused_adam", "aten::_foreach")),
    ("softmax/CE/norm", ("softmax", "nll_loss", "cross_entropy", "rms_norm", "aten::_fused_rms")),
    ("elementwise", ("aten::mul", "aten::add", "aten::silu", "aten::sigmoid", "aten::div", "aten::sub",
                     "aten::neg", "aten::cat", "aten::sum", "aten::mean", "aten::pow", "aten::sqrt", "aten::rsqrt",
                     "aten::fill_", "aten::zero_", "aten::clamp", "aten::where", "aten::exp")),
]


def category(op: str) -> str:
    for name, keys in CATEGORIES:
        if any(k in op for k in keys):
            return name
    return "other"


class Run:
    """One shard of the model for one dtype, its optimizer and its fixed batches."""

    def __init__(self, dtype: str, d_model: int):
        cfg = load_config(None, MID_ARGS + ["--model.d_model", str(d_model), "--train.dtype", dtype])
        self.dtype, self.cfg = dtype, cfg
        self.shard = parallelize(cfg, ParallelDims(1, 1, 1, rank=0), CPU)
        self.opt = torch.optim.AdamW(self.shard.model.parameters(), lr=1e-4, fused=True)
        g = torch.Generator().manual_seed(0)
        tok = torch.randint(0, cfg.model.vocab_size, (8, 129), generator=g)
        self.xs, self.ys = [tok[:, :-1]], [tok[:, 1:]]

    def step(self) -> tuple[float, float]:
        """(wall seconds, process CPU seconds) of one optimizer step."""
        t0, c0 = time.perf_counter(), time.process_time()
        step.forward_backward(self.shard, self.xs, self.ys, schedule="1f1b", aux_weight=0.01 / 4, device=CPU,
                           dtype=self.dtype)
        step.finish_grads(self.shard)
        self.opt.step()
        step.after_update(self.shard)
        return time.perf_counter() - t0, time.process_time() - c0


def profile(run: Run, steps: int) -> dict[str, float]:
    """Self seconds per operator in one step: the minimum over `steps` separately profiled steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    best: dict[str, float] = {}
    for _ in range(steps):
        with tprofile(activities=[ProfilerActivity.CPU]) as prof:
            run.step()
        for e in prof.key_averages():
            best[e.key] = min(best.get(e.key, float("inf")), e.self_cpu_time_total / 1e6)
    return best


def _wire_worker(rank: int, world: int) -> dict:
    from ..model.moe import ExpertFFN
    from ..model.transformer import Transformer
    from ..parallel.comm import collectives as comm
    from ..parallel.dp.reducer import Reducer
    from ..parallel.ep import EPDispatcher
    from ..parallel.placement import EPShard, identity
    from ..parallel.pp.comms import StageComms

    cfg = load_config(None, MID_ARGS)
    D, F, E, K, T = cfg.model.d_model, cfg.model.ffn_dim, cfg.model.num_experts, cfg.model.top_k, 8 * 128
    dims = ParallelDims(1, 2, 1, rank=rank).build_groups()
    g = torch.Generator().manual_seed(rank)
    act = torch.randn(8, 128, D, generator=g)
    x_TD, ids_TK = torch.randn(T, D, generator=g), torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w_TK = torch.rand(T, K, generator=g)
    experts = ExpertFFN(E // world, D, F)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.02)
    model = Transformer(cfg.model, seed=0)
    out = {}
    for dtype in ("fp32", "bf16"):
        wire = step.compute_dtype(dtype)
        comm.COMM.reset()
        sc = StageComms(dims, tuple(act.shape), wire, CPU)  # PP: activation forward, its gradient back
        if dims.is_pp_first_stage:
            sc.send_forward(act)
            sc.recv_backward()
        else:
            sc.recv_forward()
            sc.send_backward(act)
        x = x_TD.clone().requires_grad_()  # EP: one MoE layer, forward under autocast, backward outside
        with step.autocast(CPU, dtype):
            y = EPDispatcher(EPShard(identity(E, world), rank), dist.group.WORLD)(x, ids_TK, w_TK, experts, E)
        y.float().sum().backward()
        red = Reducer(list(model.named_parameters()), dist.group.WORLD, 25, 0.5,
                      reduce_dtype=torch.bfloat16 if dtype == "bf16" else None)
        red.prepare(sync=True)
        sum(p.sum() for p in model.parameters()).backward()
        red.finish()
        out[dtype] = {a: comm.COMM.bytes[a] for a in ("pp", "ep", "dp")}
    return out


def wire(out: dict) -> None:
    print("bytes on the wire per rank (rank 0), MID shapes, 2 gloo ranks, parallel/comm/collectives.py accounting:")
    print(f"  {'axis':<6}{'what':<58}{'fp32':>12}{'bf16':>12}{'ratio':>8}")
    what = {"pp": "one (8,128,256) activation out, its gradient back",
            "ep": "1 MoE layer fwd+bwd, 1,024 tokens, incl. 64 B of int64 counts",
            "dp": "all-reduce of the MID gradients (reduce_dtype)"}
    for a in ("pp", "ep", "dp"):
        f32, b16 = out["fp32"][a], out["bf16"][a]
        print(f"  {a:<6}{what[a]:<58}{f32:>12,}{b16:>12,}{b16 / f32:>8.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan bench precision", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8, help="timed steps per dtype, alternating (default 8)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile-steps", type=int, default=3, help="profiled steps per dtype (0: no profile)")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--wire", action="store_true", help="bytes per axis, fp32 vs bf16, on 2 gloo ranks")
    args = ap.parse_args(argv)
    if args.wire:
        from ..run.spawn import run_ranks

        wire(run_ranks(_wire_worker, 2, timeout=300)[0])
        return 0
    torch.set_num_threads(1)
    runs = {dt: Run(dt, args.d_model) for dt in ("fp32", "bf16")}
    wall, cpu = defaultdict(list), defaultdict(list)
    for i in range(args.warmup + args.rounds):
        order = ("fp32", "bf16") if i % 2 == 0 else ("bf16", "fp32")
        for dt in order:
            w, c = runs[dt].step()
            if i >= args.warmup:
                wall[dt].append(w)
                cpu[dt].append(c)
    tokens = 8 * 128
    print(f"MID (d_model {args.d_model}), 1 thread, {tokens} tokens/step, {args.rounds} alternating steps per dtype")
    for dt in ("fp32", "bf16"):
        print(f"  {dt}: wall min {min(wall[dt]) * 1e3:.1f} / median {statistics.median(wall[dt]) * 1e3:.1f} ms, "
              f"CPU min {min(cpu[dt]) * 1e3:.1f} / median {statistics.median(cpu[dt]) * 1e3:.1f} ms")
    for what, ts in (("wall", wall), ("CPU", cpu)):
        print(f"  bf16 / fp32 ({what}): median {statistics.median(ts['bf16']) / statistics.median(ts['fp32']):.2f}, "
              f"min {min(ts['bf16']) / min(ts['fp32']):.2f}")
    if not args.profile_steps:
        return 0
    prof = {dt: profile(runs[dt], args.profile_steps) for dt in ("fp32", "bf16")}
    cats = {dt: defaultdict(float) for dt in prof}
    for dt, ops in prof.items():
        for op, s in ops.items():
            if op.startswith(("ProfilerStep", "autograd::engine")):
                continue
            cats[dt][category(op)] += s
    names = [c for c, _ in CATEGORIES] + ["other"]
    # The profiler clocks wall time, which a shared machine inflates; its shares are what we keep, scaled to the
    # median CPU time of a step.
    total = {dt: sum(cats[dt].values()) for dt in cats}
    step_ms = {dt: statistics.median(cpu[dt]) * 1e3 for dt in cats}
    print(f"\nwhere a step goes: share of profiled self time (min over {args.profile_steps} profiled steps per op), "
          f"and that share of the median CPU step in ms")
    print(f"  {'category':<26}{'fp32 %':>8}{'ms':>8}{'bf16 %':>9}{'ms':>8}")
    for c in names:
        f32, b16 = cats["fp32"][c] / total["fp32"], cats["bf16"][c] / total["bf16"]
        print(f"  {c:<26}{100 * f32:>8.1f}{f32 * step_ms['fp32']:>8.1f}{100 * b16:>9.1f}{b16 * step_ms['bf16']:>8.1f}")
    print(f"  {'step (CPU, median)':<26}{'':>8}{step_ms['fp32']:>8.1f}{'':>9}{step_ms['bf16']:>8.1f}")
    print("\ntop bf16 operators, % of profiled self time (fp32 beside):")
    for op, s in sorted(prof["bf16"].items(), key=lambda kv: -kv[1])[:16]:
        if op.startswith("ProfilerStep"):
            continue
        print(f"  {op[:52]:<54}{100 * prof['fp32'].get(op, 0.0) / total['fp32']:>6.1f}{100 * s / total['bf16']:>7.1f}"
              f"   [{category(op)}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
