"""zb1's split cost on one stage: B (input gradient, weight GEMMs deferred) + W (the deferred GEMMs) against one
plain backward, on the MID model's last stage as `nanotitan bench pp` cuts it (`pp_layers auto`: 1.5 blocks +
head + CE), one thread, one microbatch of m=2 sequences at a time.

    python scripts/experiments/wgrad.py [--repeats 40] [--layers 4] [--ckpt]

Times are CPU seconds of the (one) thread (`time.thread_time`), so a machine shared with other jobs slows them
less than wall time; variants run round-robin (noise hits each alike); per variant the median over repeats of
forward, backward (B + W for the split), and the split's excess over the plain backward as the median of each
round's ratio (paired: a drift in the machine's speed moves both sides of a ratio alike). The process keeps its
freed memory as a training rank does (allocator.py). The forward is timed too: with a store
attached the stage's linears and experts run through model/wgrad.py's autograd Functions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nanotitan.run.allocator import keep_freed_memory
from nanotitan.model import wgrad
from nanotitan.model.spec import build_chunk_specs
from nanotitan.model.transformer import Transformer
from nanotitan.bench.pp import AUX_WEIGHT, MB, SEED, SEQ, mid_cfg


def measure(repeats: int, layers: int, ckpt: bool) -> dict:
    torch.set_num_threads(1)
    keep_freed_memory()  # as every training rank does (allocator.py): without it, page faults dominate W
    cfg = mid_cfg(layers, "auto", "zb1")
    spec = build_chunk_specs(cfg, 1, 0)[0]
    plain, split = (Transformer(cfg.model, spec, SEED) for _ in range(2))
    store = wgrad.WeightGradStore(fuse=True)  # as zb1's split stages make it (parallel/pp/schedules.py)
    wgrad.attach(split, store)
    for m in (plain, split):
        m.activation_checkpointing = ckpt
    g = torch.Generator().manual_seed(0)
    x = torch.randn(MB, SEQ, cfg.model.d_model, generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (MB, SEQ), generator=g)
    times = {k: [] for k in ("plain_fwd", "plain_bwd", "split_fwd", "split_B", "split_W")}

    def loss_of(model, tag):
        t0 = time.thread_time()
        ce, aux = model(x.clone().requires_grad_(True), y)
        loss = ce + AUX_WEIGHT * aux
        times[f"{tag}_fwd"].append(time.thread_time() - t0)
        return loss

    for r in range(repeats + 3):  # 3 warm-up rounds, not counted
        loss = loss_of(plain, "plain")
        t0 = time.thread_time()
        loss.backward()
        times["plain_bwd"].append(time.thread_time() - t0)
        loss = loss_of(split, "split")
        t0 = time.thread_time()
        with store.deferring():
            loss.backward()
        work = store.take()
        t1 = time.thread_time()
        wgrad.WeightGradStore.run(work)
        t2 = time.thread_time()
        times["split_B"].append(t1 - t0)
        times["split_W"].append(t2 - t1)
        if r < 3:
            for v in times.values():
                v.pop()
    med = {k: statistics.median(v) for k, v in times.items()}
    bw = [b + w for b, w in zip(times["split_B"], times["split_W"])]
    med["split_bwd"] = statistics.median(bw)
    # Paired: each round's split against the plain backward of the same round, so that a machine whose speed
    # drifts (a shared host) moves both sides of each ratio alike; the median of those ratios.
    med["split_cost"] = statistics.median(s / p for s, p in zip(bw, times["plain_bwd"])) - 1
    med["fwd_cost"] = statistics.median(s / p for s, p in zip(times["split_fwd"], times["plain_fwd"])) - 1
    return med


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/experiments/wgrad.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ckpt", action="store_true", help="activation checkpointing on the stage")
    args = ap.parse_args(argv)
    med = measure(args.repeats, args.layers, args.ckpt)
    ms = {k: f"{v * 1e3:.2f} ms" for k, v in med.items() if not k.endswith("cost")}
    print(f"MID stage 1 ({args.layers} layers, pp_layers auto, ckpt={args.ckpt}), medians of {args.repeats}: {ms}")
    print(f"split cost (B + W vs one backward): {med['split_cost']:+.1%}; forward with the store attached: "
          f"{med['fwd_cost']:+.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
