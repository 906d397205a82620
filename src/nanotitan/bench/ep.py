"""`nanotitan bench ep`: one MoE layer fwd+bwd under EP, against its controls.

    nanotitan bench ep [--iters 10] [--rounds 3] [--warmup 3] [--worlds 1,2,4]

Shapes: MID (docs/design.md) MoE layer — d_model 256, 8 SwiGLU experts of hidden 512, top-2, 1,024 tokens
per rank (8 x 128), fp32, 1 thread per rank, gloo. Every rank keeps 1,024 tokens, so EP=P does P
times the work of EP=1 on P processes: the fair control is P independent EP=1 processes side by side.

Launches (each its own processes):
  world 1: EP=1 (LocalDispatcher), and the pack/permutation microbenchmark (ours vs the seed's loops)
  world 2: rounds of [control: two EP=1 side by side | EP=2 ours | EP=2 seed-style], interleaved so the
           ratios come from the same time window
  world 4: rounds of [control: four EP=1 side by side | EP=4 ours] (4 processes on 2 cores: oversubscribed)
Per mode: per-iteration wall time of the slowest rank (a layer is done when every rank is), min / median
over rounds*iters; all-to-all time = the "ep" wait recorded by parallel.comm (includes waiting for the
slower peer); expert compute = the same experts fwd+bwd on the received rows, timed alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from ..model.moe import LocalDispatcher, MoE, pack_expert_major
from ..parallel.comm import collectives as comm
from ..parallel.ep import EPDispatcher, source_to_expert_major
from ..parallel.placement import EPShard, identity
from ..run.spawn import run_ranks
from .seed_ep_naive import SeedEPDispatcher, seed_pack, seed_permute

D, E, F_HID, K, B, S = 256, 8, 512, 2, 8, 128


def build_moe(P: int, ep_rank: int) -> MoE:
    L = E // P
    moe = MoE(D, F_HID, E, K, True, ep_rank * L, (ep_rank + 1) * L, expert_shard=EPShard(identity(E, P), ep_rank))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # same global weights in every layout; expert slice by ep_rank
        moe.router.weight.copy_(torch.randn(E, D, generator=g) * 0.02)
        for p in (moe.experts.W_gate, moe.experts.W_val, moe.experts.W_out):
            p.copy_((torch.randn((E,) + tuple(p.shape[1:]), generator=g) * 0.02)[ep_rank * L:(ep_rank + 1) * L])
    return moe


def step(moe: MoE, x, g) -> None:
    y, _ = moe(x)
    (y * g).sum().backward()


def time_mode(moe: MoE, x, g, iters: int, group) -> tuple[list[float], list[float]]:
    """Per-iteration (wall, ep-comm wait) of this rank; a barrier before each iteration aligns the ranks."""
    walls, waits = [], []
    for _ in range(iters):
        if group is not None:
            dist.barrier(group=group)
        comm.COMM.reset()
        t0 = time.perf_counter()
        step(moe, x, g)
        walls.append(time.perf_counter() - t0)
        waits.append(comm.COMM.wait_s["ep"])
        moe.zero_grad(set_to_none=True)
    return walls, waits


def expert_compute_s(moe: MoE, P: int, reps: int = 5) -> float:
    """Experts fwd+bwd alone on an expert-major buffer with the balanced-routing row count."""
    n = B * S * K  # every rank receives ~T*K rows when routing is balanced
    counts = [n // moe.experts.W_gate.shape[0]] * moe.experts.W_gate.shape[0]
    x = torch.randn(sum(counts), D, requires_grad=True)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        moe.experts(x, counts).sum().backward()
        ts.append(time.perf_counter() - t0)
    moe.experts.zero_grad(set_to_none=True)
    return min(ts)


def pack_microbench(reps: int) -> dict:
    """Dispatch-side data movement for 1,024 tokens top-2 E=8, EP=2 layout: pack + source->expert permutation."""
    g = torch.Generator().manual_seed(1)
    x_TD = torch.randn(B * S, D, generator=g)
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * S)])
    recv_PL = torch.bincount(ids_TK.reshape(-1), minlength=E).view(2, E // 2)  # as if both ranks sent the same
    R = int(recv_PL.sum())
    x_RD = torch.randn(R, D, generator=g)

    def ours():
        order, tok, counts = pack_expert_major(ids_TK, E)
        packed = x_TD.index_select(0, tok)
        perm = source_to_expert_major(recv_PL, R)
        return packed, x_RD.index_select(0, perm)

    def seed():
        packed, _, _, counts = seed_pack(x_TD, ids_TK, E)
        return packed, seed_permute(x_RD, recv_PL.tolist())

    a, b = ours(), seed()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), "ours and the seed's packing disagree"
    out = {}
    for name, fn in (("ours", ours), ("seed", seed)):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[name] = (min(ts), statistics.median(ts))
    return out


def rank_main(rank: int, world: int, args) -> tuple[dict, dict]:
    """This rank's per-mode (walls, waits) and, per mode, the experts-alone time (+ the pack microbench)."""
    group = dist.new_group(list(range(world))) if world > 1 else None
    torch.manual_seed(1000 + rank)  # each rank its own tokens
    x = torch.randn(B, S, D)
    g = torch.randn(B, S, D)
    modes = {"ep1": (build_moe(1, 0), LocalDispatcher())} if world == 1 else {
        f"control{world}": (build_moe(1, 0), LocalDispatcher()),
        f"ep{world}": (build_moe(world, rank), EPDispatcher(EPShard(identity(E, world), rank), group)),
    }
    if world == 2:
        modes["seed_ep2"] = (build_moe(2, rank), SeedEPDispatcher(group, 2, rank))
    res = {m: ([], []) for m in modes}
    for moe, disp in modes.values():
        moe.dispatcher = disp
        time_mode(moe, x, g, args.warmup, group)
    for _ in range(args.rounds):
        for m, (moe, _) in modes.items():
            w, c = time_mode(moe, x, g, args.iters, group)
            res[m][0].extend(w)
            res[m][1].extend(c)
    extra = {m: expert_compute_s(moe, world) for m, (moe, _) in modes.items()}
    if world == 1:
        extra["pack"] = pack_microbench(args.iters * args.rounds)
    return res, extra


def launch(world: int, args) -> tuple[list, dict]:
    got = run_ranks(rank_main, world, (args,), timeout=1800, pg_timeout=300)
    return [res for res, _ in got], got[0][1]


def summarise(per_rank: list[dict], mode: str) -> dict:
    walls = [max(it) for it in zip(*[r[mode][0] for r in per_rank])]  # slowest rank per iteration
    waits = [statistics.mean(it) for it in zip(*[r[mode][1] for r in per_rank])]
    return {"min_ms": 1e3 * min(walls), "med_ms": 1e3 * statistics.median(walls),
            "a2a_med_ms": 1e3 * statistics.median(waits)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan bench ep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=10, help="timed iterations per mode and round (default 10)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every mode (default 3)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed iterations per mode first (default 3)")
    ap.add_argument("--worlds", default="1,2,4", help="process counts to launch, comma-separated")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, MoE layer D={D} E={E} F={F_HID} top-{K}, "
          f"{B * S} tokens/rank, fp32, 1 thread/rank, {args.rounds}x{args.iters} iters")
    table = {}
    for world in (int(w) for w in args.worlds.split(",")):
        per_rank, extra = launch(world, args)
        for mode in per_rank[0]:
            table[mode] = summarise(per_rank, mode)
            table[mode]["expert_fwd_bwd_ms"] = 1e3 * extra[mode]
        if "pack" in extra:
            table["pack"] = extra["pack"]
    print(f"{'mode':<10} {'min ms':>8} {'median ms':>10} {'a2a median ms':>14} {'experts alone ms':>17}")
    for mode, r in table.items():
        if mode != "pack":
            print(f"{mode:<10} {r['min_ms']:8.1f} {r['med_ms']:10.1f} {r['a2a_med_ms']:14.1f} "
                  f"{r['expert_fwd_bwd_ms']:17.1f}")
    if "ep2" in table and "control2" in table:
        print(f"EP=2 / control2 (median): {table['ep2']['med_ms'] / table['control2']['med_ms']:.3f}   "
              f"(min): {table['ep2']['min_ms'] / table['control2']['min_ms']:.3f}")
        print(f"EP=2 / seed-style EP=2 (median): {table['ep2']['med_ms'] / table['seed_ep2']['med_ms']:.3f}   "
              f"vs the seed's ~120 ms: {table['ep2']['med_ms'] / 120:.3f}")
    if "ep4" in table and "control4" in table:
        print(f"EP=4 / control4 (median): {table['ep4']['med_ms'] / table['control4']['med_ms']:.3f}")
    if "pack" in table:
        (o_min, o_med), (s_min, s_med) = table["pack"]["ours"], table["pack"]["seed"]
        print(f"pack+permute, 1,024 tokens top-2: ours {1e3 * o_min:.3f}/{1e3 * o_med:.3f} ms, seed loops "
              f"{1e3 * s_min:.2f}/{1e3 * s_med:.2f} ms (min/median): ours is {s_med / o_med:.0f}x faster")
    return 0
