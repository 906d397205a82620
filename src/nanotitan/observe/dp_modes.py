"""The DP flavours' memory and time, one mode per process: `nanotitan bench dp --zero`'s worker (bench/dp.py), and
the meters' test holding the trainer's peak to it (tests/observe/test_meters.py). A mode's count starts from a
process that held no other mode's model.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from ..config.config import ModelConfig
from ..model.transformer import Transformer

# mode -> (zero level, parallel.zero_accumulate, parallel.zero3_reshard); "zero2" and "zero3" are what `auto`
# gives without PP, the "/full" and "/never" modes the other choice of each (docs/dp.md "Peak memory")
ZERO_MODES = {"zero0": (0, "full", "never"), "zero1": (1, "full", "never"), "zero2": (2, "shard", "never"),
              "zero2/full": (2, "full", "never"), "zero3": (3, "shard", "always"),
              "zero3/never": (3, "full", "never"), "ddp": (0, "full", "never")}
PHASES = ("forward", "backward", "optimizer", "gather")


def zero_worker(rank: int, world: int, mode: str, bucket_mb: float, steps: int, warmup: int, M: int,
                 model_cfg: ModelConfig, batch: int, ckpt_dir: str = ""):
    """One DP=world run of `mode` with M microbatches per step: step times, per-phase times, the live bytes at
    the optimizer step, the high-water mark of live tensor bytes over one more (untimed) step beside glibc's heap
    over it (`heap_peak_bytes`: the count's start plus the heap's rise, observe/memory.py HeapInUse), and with
    `ckpt_dir` the seconds and the high-water mark of saving and loading a checkpoint of it (checkpoint.py).
    `batch` sequences of model_cfg.max_seq_len tokens per rank and step (`nanotitan bench dp --zero`: the MID
    model's 8x128)."""
    from ..observe.memory import HeapInUse, PeakTensorBytes, SavedActivations, live_tensor_bytes
    from ..optim.adamw import AdamW, decay_groups
    from ..parallel.dims import ParallelDims
    from ..parallel.dp.fsdp import FSDPSync
    from ..parallel.dp.sync import ReplicatedSync, TorchDDPSync
    from ..parallel.dp.zero import ZeroSync

    model = Transformer(model_cfg, seed=0)
    # the production GradSync flavours (what parallelize picks), all params replicated over the DP=world group
    args = (model, ParallelDims(world, 1, 1, rank=rank).build_groups(), [], list(model.named_parameters()))
    zero, accumulate, reshard = ZERO_MODES[mode]
    if mode == "ddp":
        sync = TorchDDPSync(*args, bucket_mb)
    elif zero == 0:
        sync = ReplicatedSync(*args, bucket_mb, 1.0 / world)
    elif zero in (1, 2):
        sync = ZeroSync(*args, bucket_mb, 1.0 / world, zero, accumulate=accumulate)
    else:
        sync = FSDPSync(*args, bucket_mb, 1.0 / world, accumulate, reshard)
    del args  # FSDPSync re-pointed its lists at the DTensor shards; nothing else may hold the full params
    step_model = sync.ddp if mode == "ddp" else model
    opt = AdamW(decay_groups(sync.param_groups(), 0.1), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, model_cfg.vocab_size, (batch, model_cfg.max_seq_len + 1), generator=g).chunk(M)
            for _ in range(4)]
    meter, heap, acts = PeakTensorBytes(torch.device("cpu")), HeapInUse(), SavedActivations(model)
    times, cpu, phases, nbytes = [], [], {k: [] for k in PHASES}, None
    for step in range(warmup + steps + 1):
        metered = step == warmup + steps  # one more step, untimed, under the meters (a Python call per op)
        with contextlib.ExitStack() as meters:
            if metered:  # the heap's start after the count's scan of the gc's objects (a list of them all)
                for m in (meter, heap, acts):
                    meters.enter_context(m)
            t0, c0 = time.perf_counter(), time.process_time()
            fwd = bwd = 0.0
            for i, tok in enumerate(data[step % len(data)]):
                last = i == M - 1
                ta = time.perf_counter()
                sync.prepare(sync=last)
                with contextlib.nullcontext() if mode != "ddp" or last else step_model.no_sync():
                    loss, aux = step_model(tok[:, :-1], tok[:, 1:])
                    tb = time.perf_counter()
                    ((loss + 0.01 * aux) / M).backward()
                fwd, bwd = fwd + tb - ta, bwd + time.perf_counter() - tb
            t1 = time.perf_counter()
            sync.finish()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            if step == warmup:  # live state at the optimizer step: params, grads (full or shards), AdamW moments
                nbytes = live_tensor_bytes(model, opt)
            sync.after_step()
            sync.zero_grad()
            t4 = time.perf_counter()
        if warmup <= step < warmup + steps:
            times.append(t4 - t0)
            cpu.append(time.process_time() - c0)  # all threads of the rank, gloo's included
            for k, dt in zip(PHASES, (fwd, bwd + t2 - t1, t3 - t2, t4 - t3)):
                phases[k].append(dt)
    nbytes["peak_tensor_bytes"], nbytes["act_peak_bytes"] = meter.peak, acts.peak_bytes
    nbytes["heap_peak_bytes"] = meter.start + heap.peak - heap.start
    if ckpt_dir and mode != "ddp":
        nbytes.update(_time_checkpoint(model, opt, sync, world, rank, ckpt_dir, sum(nbytes[k] for k in BYTE_KEYS[:3])))
    del step_model
    sync.close()  # tear DDP down before the process group (the baselines: SIGABRT otherwise)
    dist.barrier()
    return times, phases, nbytes, cpu


BYTE_KEYS = ("param_bytes", "grad_bytes", "optim_bytes", "peak_tensor_bytes", "heap_peak_bytes")


def _time_checkpoint(model, opt, sync, world: int, rank: int, ckpt_dir: str, steady: int) -> dict:
    """Save this state with checkpoint.save_checkpoint and load it back: wall seconds (rank 0's; the calls are
    collective) and each one's high-water mark of live tensor bytes over the rank's steady state."""
    from types import SimpleNamespace

    from ..state import checkpoint as ckpt
    from ..config.config import Config
    from ..observe.memory import PeakTensorBytes
    from ..parallel.dims import ParallelDims

    dims, shard = ParallelDims(world, 1, 1, rank=rank), SimpleNamespace(sync=sync)
    save, load = PeakTensorBytes(torch.device("cpu")), PeakTensorBytes(torch.device("cpu"))
    dist.barrier()
    t0 = time.perf_counter()
    with save:
        path = ckpt.save_checkpoint(ckpt_dir, 1, model, opt, dims, Config(), shard=shard)
    t1 = time.perf_counter()
    with load:
        ckpt.load_checkpoint(path, model, opt, dims, shard=shard)
    t2 = time.perf_counter()
    return {"save_s": t1 - t0, "load_s": t2 - t1, "save_ratio": (steady + save.peak - save.start) / steady,
            "load_ratio": (steady + load.peak - load.start) / steady}
