"""Measure this machine for the planner (`nanotitan plan --measure`) and count live tensor bytes.

- `measure_hardware(out)`: fp32 and bf16 GEMM FLOP/s per thread count (`hardware.measure_cpu_gemm_flops`),
  fused-AdamW memory throughput, all-reduce / all-to-all / P2P bandwidth and latency over real gloo
  between 2 spawned local processes, the node's cores and memory, and the RSS of a rank before its
  model exists (the trainer's imports + a gloo group); writes a JSON profile that `--hardware FILE` reads.
- `TensorBytesMeter`: peak bytes of tensors allocated by torch ops while it is active. Peak RSS on
  CPU is noisy (allocator caching, glibc arenas, shared pages), so the planner's memory model is
  checked against this exact count instead: every op output's storage is added when it first
  appears and removed when its storage is freed.
"""

from __future__ import annotations

import importlib
import resource
import socket
import statistics
import time
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ...config.hardware import GiB, Hardware, Link, host_cores, host_memory_bytes, measure_cpu_gemm_flops, save_hardware
from ...observe.memory import storage_key
from ...parallel.comm import collectives as comm
from ...run.spawn import run_ranks


class TensorBytesMeter(TorchDispatchMode):
    """`with TensorBytesMeter(known=tensors) as m: ...` then m.peak / m.current (bytes).
    Storages of `known` tensors (parameters, inputs) are never counted, so their views are not either.
    Storages are told apart by identity (`memory.storage_key`), so fake and meta tensors count too (plan/dryrun.py)."""

    def __init__(self, known: list[torch.Tensor] = ()):
        super().__init__()
        self.skip = {storage_key(t.untyped_storage()) for t in known}
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    # FSDP2 (zero 3) frees a module's gathered params with storage.resize_(0) and re-gathers into the same storage
    # with resize_(n): no op a dispatch mode sees, and the storage lives on. While active, resize_ is counted too.
    def __enter__(self):
        meter, resize = self, torch.UntypedStorage.resize_
        self._own = vars(torch.UntypedStorage).get("resize_")  # None: the C base class's, inherited

        def resize_(storage, size):
            out = resize(storage, size)
            meter._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        if self._own is None:
            del torch.UntypedStorage.resize_
        else:
            torch.UntypedStorage.resize_ = self._own
        return super().__exit__(*exc)

    def _resized(self, s) -> None:
        key = storage_key(s)
        if key in self.skip:
            return
        if key not in self.live:  # allocated before the meter (or empty until now)
            if s.nbytes() == 0:
                return
            self.live[key] = 0
            weakref.finalize(s, self._free, key)
        self.current += s.nbytes() - self.live[key]
        self.live[key] = s.nbytes()
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _storage_holders(tree_flatten(out)[0]):
            s = t.untyped_storage()
            key = storage_key(s)
            if key in self.live or key in self.skip or s.nbytes() == 0:
                continue
            self.live[key] = s.nbytes()
            self.current += s.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(s, self._free, key)  # storages keep their Python object: fires when freed
        return out


def _storage_holders(tensors) -> list[torch.Tensor]:
    """The tensors whose storages hold the bytes: a wrapper subclass's own storage is the whole tensor's size in its
    reported dtype, so its inner tensors instead (a DTensor's local shard at zero 3; an FP8 weight's bits and scales,
    model/fp8_weight.py)."""
    out = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if hasattr(t, "to_local"):
            out.append(t.to_local())
        elif type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            out += _storage_holders([getattr(t, name) for name in t.__tensor_flatten__()[0]])
        else:
            out.append(t)
    return out


# --- compute --------------------------------------------------------------------------------------
def adamw_bytes_per_s(n_params: int = 2_000_000, repeats: int = 5) -> float:
    """Effective memory bandwidth of a fused fp32 AdamW step (28 bytes touched per parameter)."""
    p = torch.nn.Parameter(torch.randn(n_params))
    p.grad = torch.randn(n_params)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    opt.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return 28 * n_params / statistics.median(times)


# --- communication (2 local gloo ranks) -----------------------------------------------------------
def _timed(fn, repeats: int) -> float:
    fn()
    dist.barrier()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _comm_worker(rank: int, world: int, nbytes: int) -> dict:
    # What a training rank holds before it builds its model: the trainer's imports (data, metrics, DCP)
    # and an initialised gloo group (spawn.run_ranks made it). The planner adds the model's tensors on top.
    for module in ("torch.distributed.checkpoint", "nanotitan.train"):
        importlib.import_module(module)
    dist.barrier()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak RSS so far, no model yet
    big, small = torch.zeros(nbytes // 4), torch.zeros(1)
    out = {"rss": rss}
    for name, t in (("bw", big), ("lat", small)):
        reps = 5 if name == "bw" else 50
        out[f"ar_{name}"] = _timed(lambda: comm.all_reduce(t, axis="dp"), reps)
        recv = torch.empty_like(t if t.numel() % world == 0 else torch.zeros(world))
        send = t if t.numel() % world == 0 else torch.zeros(world)
        out[f"a2a_{name}"] = _timed(lambda: comm.all_to_all_single(recv, send, axis="ep"), reps)

        def ping_pong(t=t):  # half a round trip = one send/recv
            if rank == 0:
                comm.send(t, 1, axis="pp")
                comm.recv(t, 1, axis="pp")
            elif rank == 1:
                comm.recv(t, 0, axis="pp")
                comm.send(t, 0, axis="pp")
        out[f"p2p_{name}"] = _timed(ping_pong, reps) / 2
    return out


def measure_comm(nbytes: int = 16 * 2**20, timeout: float = 120.0) -> dict:
    out = run_ranks(_comm_worker, 2, (nbytes,), timeout=timeout)[0]
    n, g = nbytes, 2
    out["allreduce_bw"] = 2 * (g - 1) / g * n / max(out["ar_bw"] - 2 * (g - 1) * out["ar_lat"], 1e-9)
    out["a2a_bw"] = (g - 1) / g * n / max(out["a2a_bw"] - out["a2a_lat"], 1e-9)
    out["p2p_bw"] = n / max(out["p2p_bw"] - out["p2p_lat"], 1e-9)
    return out


def measure_hardware(out_path: str) -> Hardware:
    """Profile this machine (CPU + gloo) and write it to out_path as JSON."""
    cores = host_cores()
    threads = sorted({1, cores} | {t for t in (2, 4, 8, 16, 32) if t < cores})
    by_threads = {t: measure_cpu_gemm_flops(t, n=1024) for t in threads}
    bf16_by_threads = {t: measure_cpu_gemm_flops(t, n=1024, dtype="bf16") for t in threads}
    c = measure_comm()
    lat = statistics.median([c["ar_lat"] / 2, c["a2a_lat"], c["p2p_lat"]])
    intra = Link(c["allreduce_bw"], c["a2a_bw"], c["p2p_bw"], lat)
    hw = Hardware(name=f"measured-{socket.gethostname()}", peak_flops_bf16=bf16_by_threads[1],
                  peak_flops_fp32=by_threads[1],
                  compute_efficiency=0.5, gemm_half_rows=16, mem_bytes=host_memory_bytes(),
                  mem_reserved_bytes=float(c["rss"]), mem_bw=adamw_bytes_per_s(), devices_per_node=max(64, cores),
                  intra=intra, inter=Link.uniform(0.1e9, 500e-6), dp_overlap=0.0, cores_per_node=cores,
                  gemm_flops_by_threads=by_threads, gemm_bf16_flops_by_threads=bf16_by_threads,
                  layer_overhead_s=0.3e-3,
                  source=f"nanotitan plan --measure, {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}; "
                         f"compute_efficiency, layer_overhead and call costs are defaults until "
                         f"`nanotitan plan --calibrate`")
    save_hardware(hw, out_path)
    return hw


if __name__ == "__main__":
    import sys

    hw = measure_hardware(sys.argv[1] if len(sys.argv) > 1 else "hardware.json")
    print(hw, f"mem {hw.mem_bytes / GiB:.1f} GiB")
