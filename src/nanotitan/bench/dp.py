"""`nanotitan bench dp`: DP=2 on CPU/gloo, our Reducer vs torch DDP vs one process vs two independent
processes, in one run.

    nanotitan bench dp [--rounds 3] [--steps 12] [--bucket-mb 25] [--sweep 4,100]
    nanotitan bench dp --zero [--zero-worlds 2,4] [--zero-modes zero0,zero1,...] [--microbatches 1] [--rounds 2]
                              [--steps 6]   (sharded DP: zero 0/1/2/3 vs DDP, step time and peak bytes per rank)

Model: MID (docs/design.md) (d_model 256, 4 layers, 4 heads, seq 128, vocab 4096, 8 experts of 512, top-2),
8x128 random tokens per rank per step, M=1, AdamW(fused=True), 1 thread per rank. Modes run in
interleaved rounds (the machine is shared and noisy, so ratios are taken within the run):
  single       one process alone
  reducer      DP=2, nanotitan Reducer (scale 1/2, --bucket-mb)
  ddp          DP=2, torch DistributedDataParallel at the same bucket size
  independent  two processes, no communication (control: what 2 cores give without comm)
Reports per-step time min/median (rank 0; DP ranks are in lockstep), Reducer/DDP, and scaling
efficiency = tokens/s at DP=2 / (2 x tokens/s of one process) = median(single) / median(dp2).
Also reported: rank 0's process CPU time per step (all its threads, gloo's included) relative to the
single process — the CPU cost of communication, which is what competes with compute on 2 cores and is
far less sensitive than wall time to other jobs on a shared machine.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from ..config.config import ModelConfig
from ..model.transformer import Transformer
from ..parallel.comm.collectives import COMM
from ..parallel.dp.reducer import Reducer, wrap_ddp
from ..observe.dp_modes import BYTE_KEYS, PHASES, ZERO_MODES, zero_worker
from ..run.spawn import run_ranks

MID = ModelConfig(vocab_size=4096, d_model=256, n_layers=4, n_heads=4, ffn_dim=512, num_experts=8, top_k=2,
                  max_seq_len=128)
BATCH, SEQ = 8, 128


def _worker(rank: int, world: int, mode: str, bucket_mb: float, steps: int, warmup: int):
    # every mode runs under a process group (run_ranks makes one); only reducer and ddp communicate
    comm_world = mode in ("reducer", "ddp")
    model = Transformer(MID, seed=0)
    group = dist.group.WORLD if comm_world else None
    reducer = None
    if mode == "reducer":
        reducer = Reducer(list(model.named_parameters()), group, bucket_mb, scale=1.0 / world)
    elif mode == "ddp":
        model = wrap_ddp(model, group, bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, MID.vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(4)]
    times, wait_s, cpu_s = [], [], []
    for step in range(warmup + steps):
        tok = data[step % len(data)]
        COMM.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        if reducer is not None:
            reducer.zero_grad()
            reducer.prepare(sync=True)
        else:
            opt.zero_grad(set_to_none=False)
        loss, aux = model(tok[:, :-1], tok[:, 1:])
        (loss + 0.01 * aux).backward()
        if reducer is not None:
            reducer.finish()
        opt.step()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0  # process time: all threads, gloo's too
        if step >= warmup:
            times.append(dt)
            cpu_s.append(dc)
            wait_s.append(COMM.wait_s["dp"])
    if mode == "ddp":
        del model  # tear DDP down before the process group (the baselines: SIGABRT otherwise)
        dist.barrier()
    return times, wait_s, cpu_s


def run_mode(mode: str, bucket_mb: float, steps: int, warmup: int) -> dict:
    world = 1 if mode == "single" else 2
    out = run_ranks(_worker, world, (mode, bucket_mb, steps, warmup), timeout=900, pg_timeout=300)
    times0 = out[0][0]
    # independent processes are not in lockstep: charge each step the slower of the two
    times = [max(ts) for ts in zip(*(out[r][0] for r in range(world)))] if mode == "independent" else times0
    return {"times": times, "dp_wait": out[0][1], "cpu": out[0][2]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan bench dp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every mode (default 3)")
    ap.add_argument("--steps", type=int, default=12, help="timed steps per mode and round (default 12)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="Reducer and DDP bucket size (default 25)")
    ap.add_argument("--sweep", default="", help="extra Reducer bucket sizes (MB), comma-separated, e.g. 4,100")
    ap.add_argument("--zero", action="store_true",
                    help="instead: sharded DP, zero 0/1/2/3 and torch DDP side by side (step time, bytes per rank)")
    ap.add_argument("--zero-worlds", default="2,4", help="DP sizes for --zero (default 2,4)")
    ap.add_argument("--zero-modes", default=",".join(ZERO_MODES),
                    help=f"modes for --zero, comma-separated (default all: {','.join(ZERO_MODES)})")
    ap.add_argument("--ckpt", action="store_true",
                    help="--zero: also save and load a checkpoint of each mode (seconds per GiB of state, peak bytes)")
    ap.add_argument("--collectives", type=float, default=0.0, metavar="MB",
                    help="instead: gloo's all-reduce, reduce-scatter and all-gather of an MB buffer at 2 ranks, "
                         "native, as all-reduces and as ZeRO's direct exchanges (wall and process CPU per call)")
    ap.add_argument("--microbatches", type=int, default=1,
                    help="--zero: microbatches per step, the same 8 sequences per rank split M ways (default 1)")
    args = ap.parse_args(argv)
    if args.collectives:
        return collectives_main(args.collectives)
    if args.zero:
        return zero_main(args)
    modes = [("single", args.bucket_mb), ("reducer", args.bucket_mb), ("ddp", args.bucket_mb),
             ("independent", args.bucket_mb)]
    modes += [("reducer", float(b)) for b in args.sweep.split(",") if b]
    results: dict[tuple, list[float]] = {m: [] for m in modes}
    waits: dict[tuple, list[float]] = {m: [] for m in modes}
    cpus: dict[tuple, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes:
            res = run_mode(m[0], m[1], args.steps, args.warmup)
            results[m] += res["times"]
            waits[m] += res["dp_wait"]
            cpus[m] += res["cpu"]
            print(f"round {r} {m[0]:<11} bucket {m[1]:>5g} MB  median {statistics.median(res['times'])*1e3:7.1f} ms",
                  flush=True)
    tokens = BATCH * SEQ
    med = {m: statistics.median(v) for m, v in results.items()}
    single = med[modes[0]]
    print(f"\nMID model, {tokens} tokens/rank/step, AdamW(fused), 1 thread/rank, "
          f"{args.rounds} rounds x {args.steps} steps")
    print(f"{'mode':<12}{'bucket MB':>10}{'min ms':>9}{'median ms':>11}{'tok/s total':>13}{'efficiency':>12}"
          f"{'dp wait ms':>12}{'cpu ms':>9}{'cpu/single':>12}")
    for m, v in results.items():
        n = 1 if m[0] == "single" else 2
        eff = single / med[m] if n == 2 else 1.0
        print(f"{m[0]:<12}{m[1]:>10g}{min(v)*1e3:>9.1f}{med[m]*1e3:>11.1f}{n*tokens/med[m]:>13.0f}{eff:>12.3f}"
              f"{statistics.median(waits[m])*1e3:>12.1f}{statistics.median(cpus[m])*1e3:>9.1f}"
              f"{statistics.median(cpus[m]) / statistics.median(cpus[modes[0]]):>12.3f}")
    ratio = med[("reducer", args.bucket_mb)] / med[("ddp", args.bucket_mb)]
    print(f"\nReducer/DDP step time (median): {ratio:.3f}   "
          f"Reducer/DDP (min): {min(results[('reducer', args.bucket_mb)]) / min(results[('ddp', args.bucket_mb)]):.3f}")
    return 0


def zero_main(args) -> int:
    """Interleaved rounds of every (world, mode); step time and peak ratios to zero 0 of the same world."""
    worlds = [int(w) for w in args.zero_worlds.split(",") if w]
    modes = [m for m in args.zero_modes.split(",") if m]
    unknown = [m for m in modes if m not in ZERO_MODES]
    if unknown or "zero0" not in modes:
        raise SystemExit(f"--zero-modes {args.zero_modes}: each of {list(ZERO_MODES)}, zero0 among them "
                         "(the ratios' base)")
    runs = [(w, m) for w in worlds for m in modes]
    times = {r: [] for r in runs}
    cpus = {r: [] for r in runs}
    phases = {r: {k: [] for k in PHASES} for r in runs}
    nbytes = {}
    for rnd in range(args.rounds):
        for world, mode in runs:
            ckpt_dir = ""
            if args.ckpt:
                ckpt_dir = tempfile.mkdtemp(prefix="bench_ckpt_")
            out = run_ranks(zero_worker, world, (mode, args.bucket_mb, args.steps, args.warmup, args.microbatches,
                                                  MID, BATCH, ckpt_dir), timeout=1800, pg_timeout=600)
            if ckpt_dir:
                shutil.rmtree(ckpt_dir, ignore_errors=True)
            times[world, mode] += out[0][0]  # DP ranks are in lockstep: rank 0's clock
            cpus[world, mode] += out[0][3]
            for k in PHASES:
                phases[world, mode][k] += out[0][1][k]
            nbytes[world, mode] = [o[2] for o in out]
            print(f"round {rnd} DP={world} {mode:<11} median {statistics.median(out[0][0]) * 1e3:7.1f} ms  "
                  f"peak {max(o[2]['peak_tensor_bytes'] for o in out) / 2**20:.1f} MB", flush=True)
    n_params = sum(p.numel() for p in Transformer(MID, seed=0).parameters())
    acts = {w: max(r["act_peak_bytes"] for r in nbytes[w, "zero0"]) for w in worlds}
    print(f"\nMID model ({n_params / 1e6:.2f}M params), {BATCH}x{SEQ} tokens/rank/step in M={args.microbatches} "
          f"microbatches, AdamW(fused), 1 thread/rank, bucket {args.bucket_mb:g} MB, {args.rounds} rounds x "
          f"{args.steps} steps. Bytes: max over ranks; param/grad/optim live at the optimizer step; peak = high-water "
          "mark of all live tensors over a whole step (memory.PeakTensorBytes); heap = the same step's high-water "
          "mark by glibc's heap in use (memory.HeapInUse: the count's start plus the heap's rise); "
          "B/param = peak / params; "
          "-acts = (peak - zero 0's peak saved activations, "
          + ", ".join(f"DP={w}: {a / 2**20:.1f} MB" for w, a in acts.items()) + ") / params")
    print(f"{'DP':>3} {'mode':<12}{'min ms':>9}{'median ms':>11}{'/zero0':>8}{'cpu ms':>8}{'cpu/z0':>8}"
          + "".join(f"{k + ' ms':>13}" for k in PHASES)
          + f"{'param MB':>10}{'grad MB':>9}{'optim MB':>10}{'peak MB':>9}{'heap MB':>9}{'B/param':>9}{'-acts':>7}"
          + f"{'peak/z0':>9}"
          + f"{'optim/z0':>10}{'grad/z0':>9}{'param/z0':>10}")
    for world, mode in runs:
        med = statistics.median(times[world, mode])
        base = statistics.median(times[world, "zero0"])
        b = {k: max(r[k] for r in nbytes[world, mode]) for k in BYTE_KEYS}
        b0 = {k: max(r[k] for r in nbytes[world, "zero0"]) for k in BYTE_KEYS}
        cpu, cpu0 = statistics.median(cpus[world, mode]), statistics.median(cpus[world, "zero0"])
        print(f"{world:>3} {mode:<12}{min(times[world, mode]) * 1e3:>9.1f}{med * 1e3:>11.1f}{med / base:>8.3f}"
              f"{cpu * 1e3:>8.0f}{cpu / cpu0:>8.3f}"
              + "".join(f"{statistics.median(phases[world, mode][k]) * 1e3:>13.1f}" for k in PHASES)
              + "".join(f"{b[k] / 2**20:>{w}.1f}" for k, w in zip(BYTE_KEYS, (10, 9, 10, 9, 9)))
              + f"{b['peak_tensor_bytes'] / n_params:>9.2f}{(b['peak_tensor_bytes'] - acts[world]) / n_params:>7.2f}"
              + f"{b['peak_tensor_bytes'] / b0['peak_tensor_bytes']:>9.3f}"
              + f"{b['optim_bytes'] / b0['optim_bytes']:>10.3f}{b['grad_bytes'] / b0['grad_bytes']:>9.3f}"
              + f"{b['param_bytes'] / b0['param_bytes']:>10.3f}")
    if args.ckpt:  # the state of every rank together: what the checkpoint holds (replicas once)
        print(f"\n{'DP':>3} {'mode':<12}{'state GiB':>10}{'save s':>8}{'load s':>8}{'save s/GiB':>11}{'load s/GiB':>11}"
              f"{'save peak/state':>16}{'load peak/state':>16}   (last round; peaks: max over ranks)")
        for world, mode in runs:
            rows = nbytes[world, mode]
            if "save_s" not in rows[0]:
                continue
            zero = ZERO_MODES[mode][0]  # params are whole on each rank below zero 3, AdamW state at zero 0
            params = rows[0]["param_bytes"] * (world if zero == 3 else 1)
            gib = (params + rows[0]["optim_bytes"] * (1 if zero == 0 else world)) / 2**30
            save_s, load_s = rows[0]["save_s"], rows[0]["load_s"]
            print(f"{world:>3} {mode:<12}{gib:>10.3f}{save_s:>8.2f}{load_s:>8.2f}"
                  f"{save_s / gib:>11.1f}{load_s / gib:>11.1f}"
                  f"{max(r['save_ratio'] for r in rows):>16.3f}{max(r['load_ratio'] for r in rows):>16.3f}")
    return 0


# --- ZeRO's collectives on gloo, raw (nanotitan bench dp --collectives MB) --------------------------------------

def _fill_for_gather(out: torch.Tensor, inp: torch.Tensor, rank: int) -> None:
    """The old gloo path, kept here only as the comparison row: an all-gather as a SUM all-reduce of `out` holding
    `inp` in this rank's slice and zeros in the others' (x + 0 is x, exactly)."""
    from ..parallel.comm.collectives import own_slice
    n, flat = inp.numel(), out.view(-1)
    flat[:rank * n].zero_()
    flat[(rank + 1) * n:].zero_()
    own_slice(flat, rank, n).copy_(inp.view(-1))


def _collectives_worker(rank: int, world: int, mb: float, reps: int = 8):
    from ..parallel.comm import collectives as comm

    group = dist.group.WORLD
    n = int(mb * 2**20 / 4) // (16 * world) * 16 * world
    S = n // world
    full, shard = torch.randn(n), torch.randn(S)
    calls = {
        "all-reduce (zero 0)": lambda: comm.all_reduce(full, group, async_op=True).wait(),
        "reduce-scatter, gloo's own": lambda: dist.reduce_scatter_tensor(shard, full, group=group),
        "all-gather, gloo's own": lambda: dist.all_gather_into_tensor(full, shard, group=group),
        "all-gather as all-reduce": lambda: (_fill_for_gather(full, shard, rank),
                                             comm.all_reduce(full, group, async_op=True).wait()),
        "reduce-scatter, exchange": lambda: comm.reduce_scatter(comm.own_slice(full, rank, S), full, group).wait(),
        "all-gather, exchange": lambda: comm.all_gather(full, comm.own_slice(full, rank, S), group).wait(),
    }
    out = {}
    for name, fn in list(calls.items()) * 2:  # the second pass is the one kept (warm)
        wall, cpu = [], []
        for _ in range(reps):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        out[name] = (statistics.median(wall), statistics.median(cpu))
    return out


def collectives_main(mb: float) -> int:
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)
    out = run_ranks(_collectives_worker, 2, (mb,), timeout=900, pg_timeout=300)
    print(f"2 gloo ranks, {mb:g} MB fp32 buffer, median of 8 calls; rank 0's wall and process CPU (all threads)")
    print(f"{'call':<30}{'wall ms':>10}{'cpu ms':>10}")
    for name, (w, c) in out[0].items():
        print(f"{name:<30}{w * 1e3:>10.1f}{c * 1e3:>10.1f}")
    return 0
