"""Context parallel over packed documents: the balanced split against zigzag, per CP rank (docs/cp.md, "The split").

    nanotitan bench cp_docs [--seq 16384] [--cp 4] [--long 8192] [--long-p 0.1] [--windows 3] [--heads 8]
                            [--head-dim 64] [--reps 3] [--threads 1]

Each window of S tokens packs documents drawn one by one: `--long` tokens with probability `--long-p`, else a length
uniform in [16, 1024) (so ~90% of the documents are under 1k and a few are long), cut at the window's end; a fixed
seed per window. For each split (parallel.cp_split zigzag and docs) and each CP rank, the rank's attention work (the
document-masked causal area of its queries: `cp_split.rank_work`) and its attention time: forward + backward of the
ring's own chunk-pair code (`cp_attn.doc_blocks_forward` / `doc_blocks_backward`) over every rank's keys, run in
this one process for each rank in turn, timed by the thread's CPU time (the ring's messages are the same size on
every rank and left out; no other rank competes for the core). Repetitions alternate the splits and ranks; the
first is a warm-up. Prints per rank work and min time, and per split slowest / mean of both.
"""

from __future__ import annotations

import argparse
import time

import torch

from ..model.docs import doc_starts
from ..parallel import cp_attn, cp_split

EOT = 1


def window(S: int, long: int, long_p: float, seed: int) -> torch.Tensor:
    """(1, S) token ids whose EOTs end documents: `long` tokens with probability long_p, else 16..1023."""
    g = torch.Generator().manual_seed(seed)
    x, at = torch.zeros(1, S, dtype=torch.long), 0
    while at < S:
        n = long if float(torch.rand(1, generator=g)) < long_p else int(torch.randint(16, 1024, (1,), generator=g))
        at += n
        if at <= S:
            x[0, at - 1] = EOT
    return x


def rank_attention(q, k, v, dout, docs: cp_attn.DocBlocks, me: int, n: int, scale: float) -> None:
    """Rank `me`'s share of the ring's attention, forward and backward: its queries over every rank's keys."""
    pos = [docs.layout.positions(r) for r in range(n)]
    ql, dl = q[:, :, pos[me]], dout[:, :, pos[me]]
    out = lse = None
    for step in range(n):
        src = (me - step) % n
        if docs.sees(me, src):
            out, lse = cp_attn.doc_blocks_forward(ql, k[:, :, pos[src]], v[:, :, pos[src]], src, me, scale, docs,
                                                  out, lse)
    dq = torch.zeros_like(ql)
    for src in range(n):
        if docs.sees(me, src):
            cp_attn.doc_blocks_backward(dl, ql, k[:, :, pos[src]], v[:, :, pos[src]], out, lse, src, me, scale, docs,
                                        dq)


def measure(S: int, n: int, starts: torch.Tensor, heads: int, head_dim: int, reps: int) -> dict:
    """{split: {"work": [per rank], "time": [per rank min seconds]}} for one window's document starts."""
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, heads, S, head_dim, generator=g) for _ in range(4))
    scale = head_dim ** -0.5
    blocks = {}
    for split in ("zigzag", "docs"):
        layout = cp_split.layout_of(split, starts, S, n)
        blocks[split] = [cp_attn.DocBlocks.of(starts, cp_attn.CPRing(None, r, n, 0, 0), layout) for r in range(n)]
    res = {split: {"work": cp_split.rank_work(b[0].layout, starts), "time": [float("inf")] * n}
           for split, b in blocks.items()}
    for rep in range(reps + 1):
        for split, per_rank in blocks.items():
            for r in range(n):
                t0 = time.thread_time()
                rank_attention(q, k, v, dout, per_rank[r], r, n, scale)
                if rep:  # the first rep warms up
                    res[split]["time"][r] = min(res[split]["time"][r], time.thread_time() - t0)
    return res


def slowest_over_mean(xs: list[float]) -> float:
    return max(xs) / (sum(xs) / len(xs))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan bench cp_docs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--long", type=int, default=8192, help="the long documents' length")
    ap.add_argument("--long-p", type=float, default=0.1, help="the chance that a document is long")
    ap.add_argument("--windows", type=int, default=3, help="windows (seeds 0..N-1)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (after one warm-up); the min is kept")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (thread CPU time counts one thread)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    S, n = args.seq, args.cp
    print(f"CP{n} attention forward+backward per rank, S={S}, H={args.heads} Dh={args.head_dim}, documents: "
          f"{args.long} tokens with p={args.long_p}, else 16..1023; thread CPU seconds (min of {args.reps})")
    ratios = {"zigzag": [], "docs": []}
    for seed in range(args.windows):
        starts = doc_starts(window(S, args.long, args.long_p, seed), EOT)
        opens = (starts[0] == torch.arange(S)).nonzero().flatten().tolist()
        lengths = [e - s for s, e in zip(opens, opens[1:] + [S])]
        short = sum(x < 1024 for x in lengths)
        print(f"window {seed}: {len(lengths)} documents, {short} under 1k, longest {max(lengths)}")
        res = measure(S, n, starts, args.heads, args.head_dim, args.reps)
        for split, r in res.items():
            w, t = r["work"], r["time"]
            mean_w = sum(w) / n
            ratios[split].append((slowest_over_mean(w), slowest_over_mean(t)))
            print(f"  {split:<7} work/mean {' '.join(f'{x / mean_w:5.2f}' for x in w)} | time s "
                  f"{' '.join(f'{x:6.3f}' for x in t)} | slowest/mean work {ratios[split][-1][0]:.2f} "
                  f"time {ratios[split][-1][1]:.2f}", flush=True)
    for split, rs in ratios.items():
        print(f"{split:<7} slowest/mean over windows: work {max(w for w, _ in rs):.2f} (worst) "
              f"time {max(t for _, t in rs):.2f} (worst), {sum(t for _, t in rs) / len(rs):.2f} (mean)")
    return 0
