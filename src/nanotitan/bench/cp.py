"""`nanotitan bench cp`: attention under context parallelism (parallel/cp_attn.py) measured (docs/cp.md "Measured").

    nanotitan bench cp [--part balance overlap compare] [--cp 4] [--seq 4096] [--heads 8] [--kv-heads 8]
                       [--head-dim 64] [--batch 1] [--repeats 5] [--topology h100-sxm:8] [--dilation 0]
                       [--out FILE]

    balance  each CP rank's attention compute (forward + backward: the block kernels the ring runs, nothing else)
             with the balanced split (chunks i and 2N-1-i) against a naive contiguous split (rank i: tokens
             [i S/N, (i+1) S/N), which sees i whole blocks and one causal one); slowest rank / mean, per repeat.
             One process runs every rank's blocks in turn on one thread and counts CPU time (process time), so
             neither the ranks nor other load on the machine move the figure.
    overlap  ring_attention forward + backward on N gloo ranks under the network emulator (PROFILE[:RANKS_PER_NODE]
             as `bench emulate`; dilation 0: this CPU's one-thread fp32 GEMM peak / the profile's bf16 peak, times
             the share of a core the ranks got in the free run just before: see _overlap_rank):
             exposed ring communication (per transfer, the modelled link time still left when the rank waits for
             it) against the ring's transfer time (the link model's seconds for the same calls), worst rank; beside
             it the emulated step less the same step free (run just before it) and the wait columns.
    compare  ours (ring, a2a) against an all-gather-KV baseline (every rank gathers all K/V, attends its queries
             under a global causal mask, backward all-reduces dK/dV) on N ranks, and one process's whole-sequence
             SDPA; and torch's own context_parallel (torch.distributed.tensor.experimental), whose error on CPU is
             recorded as it comes.
Figures: min and median over repeats (each repeat the slowest rank, after one warm-up); compare gives wall time (the
slowest rank) and CPU time (process time summed over the ranks: the work, whatever else loads the machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config.hardware import cpu_peak_flops, get_hardware
from ..parallel import cp_attn
from ..parallel.comm import collectives as comm, emulate
from ..run.spawn import run_ranks

PARTS = ("balance", "overlap", "compare")


def _shape(a) -> dict:
    return {"batch": a.batch, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "seq": a.seq}


def _qkv(sh: dict, s: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, h, hkv, d = sh["batch"], sh["heads"], sh["kv_heads"], sh["head_dim"]
    return tuple(torch.randn(b, n, s, d, generator=g) for n in (h, hkv, hkv, h))  # q, k, v, dout


# --- balance: every rank's blocks, timed in one process -------------------------------------------------------
def rank_blocks(split: str, rank: int, n: int, s: int) -> list[tuple[int, int, bool]]:
    """(query rows, key rows, causal) of each block rank `rank` computes for a sequence of s tokens."""
    s_loc, c = s // n, s // (2 * n)
    if split == "naive":  # its own causal block and every earlier rank's whole block; later ranks' are masked
        return [(s_loc, s_loc, True)] + [(s_loc, s_loc, False)] * rank
    return [(s_loc, s_loc, True)] + [(2 * c, c, False) if src < rank else (c, 2 * c, False)
                                     for src in range(n) if src != rank]


def _time_blocks(blocks, sh: dict, scale: float) -> float:
    """CPU seconds of the blocks' kernels, forward and backward (process time, one thread: what other load on the
    machine does not move, unlike wall time)."""
    t = 0.0
    for sq, sk, causal in blocks:
        q, k, v, dout = _qkv(sh, max(sq, sk))
        q, dout, k, v = q[:, :, :sq], dout[:, :, :sq], k[:, :, :sk], v[:, :, :sk]
        t0 = time.process_time()
        out, lse = cp_attn.block_attention(q, k, v, causal, scale)
        cp_attn.block_attention_backward(dout, q, k, v, out, lse, causal, scale)
        t += time.process_time() - t0
    return t


def balance(sh: dict, n: int, repeats: int) -> dict:
    """Slowest rank / mean per repeat (the two splits alternating, the ranks' order rotating repeat by repeat), and
    the same ratio of each rank's fastest time over the repeats (what load elsewhere on the machine moves least)."""
    scale = sh["head_dim"] ** -0.5
    times = {split: [[0.0] * n for _ in range(repeats)] for split in ("balanced", "naive")}
    _time_blocks(rank_blocks("naive", n - 1, n, sh["seq"]), sh, scale)  # warm-up
    for i in range(repeats):
        for split in ("balanced", "naive") if i % 2 else ("naive", "balanced"):
            for r in (list(range(n))[i % n:] + list(range(n))[:i % n]):
                times[split][i][r] = _time_blocks(rank_blocks(split, r, n, sh["seq"]), sh, scale)
    res = {}
    for split, rows in times.items():
        best = [min(t[r] for t in rows) for r in range(n)]
        res[split] = {"slowest_over_mean": _min_median([max(t) / statistics.mean(t) for t in rows]),
                      "of_per_rank_min": max(best) / statistics.mean(best), "per_rank_min_cpu_s": best}
    return res


# --- overlap: the real ring on gloo ranks, emulated links ------------------------------------------------------
class _LinkExposure:
    """Within `with`: each async P2P batch cp_attn posts (comm.batch_isend_irecv, wrapped for the measurement
    only) charges, when the rank starts waiting for it, the modelled link time still left (what the compute since
    its post did not cover). Unlike the wait column, a peer computing late (ranks sharing cores) is not in it.
    Per hop (`hops`, in post order): its name (phase, its index in the phase's post order, what travels: by tag,
    0 K/V and 1 dK|dV), its link seconds, the seconds it queued behind an earlier call still on the axis, and the
    part left exposed."""

    def __init__(self):
        self.exposed_s, self._real = 0.0, comm.batch_isend_irecv
        self.phase, self.hops, self._count = "forward", [], {}

    def __enter__(self):
        comm.batch_isend_irecv = self._post
        return self

    def __exit__(self, *exc):
        comm.batch_isend_irecv = self._real

    def _post(self, ops, axis: str = "pp", async_op: bool = False):
        m, t0 = emulate.ACTIVE, time.perf_counter()
        before = m.modelled_s[axis] if m else 0.0
        work = self._real(ops, axis=axis, async_op=async_op)
        if not async_op:
            return work
        what = " + ".join(HOP_KINDS.get(op.tag, f"tag {op.tag}") for op in ops if op.op is dist.isend)
        self._count[self.phase] = self._count.get(self.phase, 0) + 1
        link_s = (m.modelled_s[axis] - before) if m else 0.0
        hop = {"hop": f"{self.phase} {self._count[self.phase]}: {what}", "link_s": link_s,
               "queued_s": max(0.0, work.done_by - t0 - link_s) if work.done_by else 0.0, "exposed_s": 0.0}
        self.hops.append(hop)
        outer = self

        class _Charged:
            def wait(self):
                if work.done_by:
                    left = max(0.0, work.done_by - time.perf_counter())
                    outer.exposed_s += left
                    hop["exposed_s"] = left
                work.wait()
        return _Charged()


HOP_KINDS = {0: "K/V", 1: "dK|dV"}  # cp_attn's P2P tags


def hop_table(ranks: list[dict], repeats: int) -> dict:
    """Per hop of the worst rank of each repeat (the one the headline ratio takes): link, queued and exposed
    seconds and exposed / the ring's transfer time (these sum to the headline), min / median over repeats."""
    rows: dict[str, dict[str, list[float]]] = {}
    for i in range(repeats):
        worst = max(ranks, key=lambda r: r["emulated"][i]["exposed_s"] / r["emulated"][i]["transfer_s"])["emulated"][i]
        for h in worst["hops"]:
            row = rows.setdefault(h["hop"], {key: [] for key in ("link_s", "queued_s", "exposed_s",
                                                                 "exposed_over_transfer")})
            for key in ("link_s", "queued_s", "exposed_s"):
                row[key].append(h[key])
            row["exposed_over_transfer"].append(h["exposed_s"] / worst["transfer_s"])
    return {hop: {key: _min_median(xs) for key, xs in row.items()} for hop, row in rows.items()}


def format_hops(hops: dict) -> str:
    """The hop table as text: medians, seconds on the emulated (dilated) clock."""
    lines = [f"{'hop':<28} {'link s':>8} {'queued s':>9} {'exposed s':>10} {'exposed/transfer':>17}"]
    for hop, r in hops.items():
        lines.append(f"{hop:<28} {r['link_s']['median']:8.3f} {r['queued_s']['median']:9.3f} "
                     f"{r['exposed_s']['median']:10.3f} {r['exposed_over_transfer']['median']:17.3f}")
    return "\n".join(lines)


def _overlap_rank(rank: int, world: int, sh: dict, profile: str, node_size: int, dilation: float,
                  repeats: int) -> dict:
    """Per repeat the ring free, then emulated with the dilation scaled by the share of a core the ranks got in
    that free run while not waiting (the least over ranks): ranks slowed k-fold by sharing cores see links k-fold
    slower too, so the cluster's compute : link ratio holds."""
    ring = cp_attn.cp_ring(dist.group.WORLD)
    idx = cp_attn.balanced_order(sh["seq"], world).view(world, -1)[rank]
    q, k, v, dout = (t[:, :, idx].contiguous() for t in _qkv(sh, sh["seq"]))
    scale = sh["head_dim"] ** -0.5
    link = emulate.LinkModel(get_hardware(profile), node_size, dilation, rank)
    res = {"free": [], "emulated": []}
    share = torch.ones(1)
    for i in range(repeats + 1):  # the first a warm-up
        for mode in ("free", "emulated"):
            link.dilation = dilation * share.item()
            emulate.install(link if mode == "emulated" else None)
            link.modelled_s.clear()
            link.busy_until.clear()
            ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
            dist.barrier()
            comm.COMM.reset()
            t0, c0 = time.perf_counter(), time.process_time()
            with _LinkExposure() as seen:
                out = cp_attn.ring_attention(ql, kl, vl, ring, scale)
                seen.phase = "backward"
                out.backward(dout)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if mode == "free":  # CPU seconds per second the rank was not blocked on a peer
                share = torch.tensor([min(1.0, cpu / max(wall - comm.COMM.wait_s["cp"], 1e-9))])
                dist.all_reduce(share, op=dist.ReduceOp.MIN)
            if i:
                res[mode].append({"wall_s": wall, "wait_s": comm.COMM.wait_s["cp"], "exposed_s": seen.exposed_s,
                                  "transfer_s": link.modelled_s["cp"], "core_share": share.item(),
                                  "hops": seen.hops if mode == "emulated" else []})
    emulate.install(None)
    return res


def overlap(sh: dict, n: int, repeats: int, topology: str, dilation: float) -> dict:
    """Per rank and repeat: exposed link time / the ring's transfer time (the link model's seconds for its calls);
    the worst rank per repeat. Beside it the emulated step less the same step free (the `bench overlap` measure,
    which also moves with the machine's load) and the wait columns."""
    profile, _, per_node = topology.partition(":")
    hw = get_hardware(profile)
    node_size = int(per_node) if per_node else hw.devices_per_node
    if not dilation:  # this CPU's fp32 GEMMs stand for the emulated device's bf16 ones (what training runs at)
        dilation = cpu_peak_flops(1, "fp32") / emulate.emulated_peak_flops(hw, "bf16")
    ranks = run_ranks(_overlap_rank, n, (sh, profile, node_size, dilation, repeats), timeout=1800)
    out = {"topology": f"{profile}:{node_size}", "dilation": dilation}
    for m in ("free", "emulated"):
        out[m] = {key: _min_median([max(r[m][i][key] for r in ranks) for i in range(repeats)])
                  for key in ("wall_s", "wait_s", "exposed_s", "transfer_s", "core_share")}
    out["exposed_over_transfer"] = _min_median([max(r["emulated"][i]["exposed_s"] / r["emulated"][i]["transfer_s"]
                                                    for r in ranks) for i in range(repeats)])
    out["step_less_free_over_transfer"] = _min_median(
        [(max(r["emulated"][i]["wall_s"] for r in ranks) - max(r["free"][i]["wall_s"] for r in ranks))
         / max(r["emulated"][i]["transfer_s"] for r in ranks) for i in range(repeats)])
    out["hops"] = hop_table(ranks, repeats)
    return out


def _min_median(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs)}


# --- compare: ours against an all-gather-KV baseline, one process and torch's context_parallel -----------------
class _GatherSeq(torch.autograd.Function):
    """All ranks' (B, H, S_loc, D) concatenated on the sequence in rank order; backward sums the gradient over
    the ranks and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group, rank, n):
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.rank, ctx.s = group, rank, x.shape[2]
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g[:, :, ctx.rank * ctx.s:(ctx.rank + 1) * ctx.s], None, None, None


def allgather_kv_attention(q, k, v, ring, scale: float):
    """The baseline: gather every rank's K/V, attend this rank's queries under the global causal mask."""
    n, s_loc = ring.size, q.shape[2]
    pos = cp_attn.balanced_order(n * s_loc, n)  # global position of each gathered key (rank order)
    mine = pos.view(n, -1)[ring.rank]
    kk, vv = (_GatherSeq.apply(t, ring.group, ring.rank, n) for t in (k, v))
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mine[:, None] >= pos[None, :], scale=scale,
                                          enable_gqa=True)


IMPLS = {"ring": cp_attn.ring_attention, "a2a": cp_attn.ulysses_attention, "allgather-kv": allgather_kv_attention}


def _compare_rank(rank: int, world: int, sh: dict, repeats: int) -> dict:
    ring = cp_attn.cp_ring(dist.group.WORLD)
    idx = cp_attn.balanced_order(sh["seq"], world).view(world, -1)[rank]
    q, k, v, dout = (t[:, :, idx].contiguous() for t in _qkv(sh, sh["seq"]))
    scale = sh["head_dim"] ** -0.5
    res = {name: [] for name in IMPLS}
    for i in range(repeats + 1):  # the first a warm-up; the implementations interleaved repeat by repeat
        for name, fn in IMPLS.items():
            ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn(ql, kl, vl, ring, scale).backward(dout)
            if i:
                res[name].append((time.perf_counter() - t0, time.process_time() - c0))
    res["torch_context_parallel"] = _try_torch_cp(world, sh)
    return res


def _try_torch_cp(world: int, sh: dict) -> str:
    """torch's own CP (the ring it installs around SDPA) on this backend: "ok", or its error's first line."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    q, k, v, _ = _qkv(sh, sh["seq"])
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):  # shards them in place
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).sum().backward()
        return "ok"
    except Exception as e:  # noqa: BLE001 - the measurement is the error itself
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"


def compare(sh: dict, n: int, repeats: int) -> dict:
    ranks = run_ranks(_compare_rank, n, (sh, repeats), timeout=1800)
    out = {name: {"wall_s (slowest rank)": _min_median([max(r[name][i][0] for r in ranks) for i in range(repeats)]),
                  "cpu_s (all ranks)": _min_median([sum(r[name][i][1] for r in ranks) for i in range(repeats)])}
           for name in IMPLS}
    q, k, v, dout = _qkv(sh, sh["seq"])
    whole = []
    for i in range(repeats + 1):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        t0, c0 = time.perf_counter(), time.process_time()
        F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True).backward(dout)
        if i:
            whole.append((time.perf_counter() - t0, time.process_time() - c0))
    out["whole-seq sdpa (1 process)"] = {"wall_s": _min_median([w for w, _ in whole]),
                                         "cpu_s": _min_median([c for _, c in whole])}
    out["torch_context_parallel"] = ranks[0]["torch_context_parallel"]
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan bench cp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096, help="whole sequence, tokens (a multiple of 2 * cp)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--topology", default="h100-sxm:8", help="overlap: PROFILE[:RANKS_PER_NODE] emulated")
    ap.add_argument("--dilation", type=float, default=0.0, help="overlap: emulated = modelled / this (0: auto)")
    ap.add_argument("--out", default="", help="also write the results as JSON here")
    a = ap.parse_args(argv)
    if a.seq % (2 * a.cp):
        raise SystemExit(f"--seq ({a.seq}) must be a multiple of 2 * --cp ({2 * a.cp})")
    torch.set_num_threads(1)
    sh, res = _shape(a), {"shape": _shape(a), "cp": a.cp, "repeats": a.repeats, "load_before": os.getloadavg()}
    if "balance" in a.part:
        res["balance"] = balance(sh, a.cp, a.repeats)
        print(json.dumps({"balance": res["balance"]}, indent=1), flush=True)
    if "overlap" in a.part:
        res["overlap"] = overlap(sh, a.cp, a.repeats, a.topology, a.dilation)
        print(json.dumps({"overlap": {k: v for k, v in res["overlap"].items() if k != "hops"}}, indent=1), flush=True)
        print("per hop, the worst rank of each repeat (median over repeats):\n" + format_hops(res["overlap"]["hops"]),
              flush=True)
    if "compare" in a.part:
        res["compare"] = compare(sh, a.cp, a.repeats)
        print(json.dumps({"compare": res["compare"]}, indent=1), flush=True)
    res["load_after"] = os.getloadavg()  # the 1/5/15-minute load: wall-time figures move with it
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0
