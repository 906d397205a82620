"""Document-masked attention against plain causal SDPA, side by side (docs/packed.md).

    nanotitan bench packed [--seq 8192,16384] [--mean 512,2048] [--heads 8] [--head-dim 64] [--reps 5]
                           [--device cpu|cuda] [--threads N]

For each sequence length S and mean document length L: one window of S tokens cut into documents whose lengths are
drawn from a geometric distribution of mean L (a fixed seed), then forward + backward of one attention layer's core,
(B=1, H heads, S, Dh), timed `--reps` times each, interleaved: causal SDPA over the whole window (what
model.attn_mask=causal runs) and model/tokens.py's `doc_attention` (SDPA per document: what attn_mask=doc runs on
one device). Prints min and median per side and the ratio doc / causal of both (the machine may be shared: only the
ratios, taken within one run, mean anything). The attention work of a document mask is the sum over documents of
their causal areas, about S * L / 2 pairs against causal's S^2 / 2.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..model.docs import doc_starts
from ..model.tokens import causal_attention, doc_attention

EOT = 1  # the separator of the synthetic windows (any id: only the layout is read)


def window(S: int, mean: int, seed: int = 0) -> torch.Tensor:
    """(1, S) token ids whose EOTs cut documents of geometric lengths with mean `mean` (at least one token each)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.empty(2 * S // mean + 16).geometric_(1.0 / mean, generator=g).long()
    ends = lengths.cumsum(0) - 1  # each document's last position: its EOT
    x = torch.zeros(1, S, dtype=torch.long)
    x[0, ends[ends < S]] = EOT
    return x


def time_both(S: int, mean: int, heads: int, head_dim: int, reps: int, device: torch.device) -> dict:
    """{causal: [seconds], doc: [seconds], docs: n documents} of forward + backward, interleaved rep by rep."""
    starts = doc_starts(window(S, mean), EOT).to(device)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, heads, S, head_dim, generator=g).to(device).requires_grad_() for _ in range(3))
    dy = torch.randn(1, heads, S, head_dim, generator=g).to(device)
    runs = {"causal": lambda: causal_attention(q, k, v), "doc": lambda: doc_attention(q, k, v, starts)}
    out = {name: [] for name in runs}
    for rep in range(reps + 1):  # the first rep warms up (allocator, kernels) and is not kept
        for name, fn in runs.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.autograd.grad(fn(), (q, k, v), dy)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if rep:
                out[name].append(time.perf_counter() - t0)
    out["docs"] = int((starts[0] == torch.arange(S, device=device)).sum())
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan bench packed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", default="8192,16384", help="sequence lengths, comma-separated")
    ap.add_argument("--mean", default="512,2048", help="mean document lengths, comma-separated")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per side (after one warm-up)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"attention forward+backward, B=1 H={args.heads} Dh={args.head_dim} on {device} ({args.reps} reps): "
          "seconds min / median, and doc / causal")
    print(f"{'S':>6} {'mean':>5} {'docs':>5} | {'causal min':>10} {'median':>8} | {'doc min':>8} {'median':>8} | "
          f"{'ratio min':>9} {'median':>7}")
    for S in (int(s) for s in args.seq.split(",")):
        for mean in (int(m) for m in args.mean.split(",")):
            t = time_both(S, mean, args.heads, args.head_dim, args.reps, device)
            c, d = t["causal"], t["doc"]
            print(f"{S:>6} {mean:>5} {t['docs']:>5} | {min(c):>10.4f} {statistics.median(c):>8.4f} | "
                  f"{min(d):>8.4f} {statistics.median(d):>8.4f} | {min(d) / min(c):>9.2f} "
                  f"{statistics.median(d) / statistics.median(c):>7.2f}", flush=True)
    return 0
