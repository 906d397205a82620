"""Hardware profiles for the layout planner: what one device computes, holds and moves per second.

A profile gives peak FLOP/s (dense, no sparsity), memory, and the bandwidth/latency of each
collective inside a node and across nodes. Built-in profiles quote the vendor datasheet figure in
a comment; the *effective* numbers the planner uses (an achieved fraction of peak, a bus
bandwidth NCCL actually reaches) are stated next to it with the reason. `nanotitan plan --measure`
writes a profile of this machine in the same JSON shape (`save_hardware` / `load_hardware`).

Conventions:
- Bandwidths are bytes/s per device in one direction. `allreduce_bw` is NCCL's "bus bandwidth"
  (a ring all-reduce of n bytes over g ranks takes 2(g-1)/g * n / allreduce_bw); `a2a_bw` is what
  one device sends per second in an all-to-all; `p2p_bw` is one send/recv pair.
- Ranks fill nodes in order: rank r lives on node r // devices_per_node.

`detect_hardware()` picks the profile of the device this process would train on: a profile given
explicitly, else the CUDA GPU by name, else a generic CPU node built from this host's cores and memory
(`cpu_profile`). The calibrated `cpu-gloo` profile describes one 2-core machine: it is used only by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

GB = 1e9
GiB = 2**30
TFLOPS = 1e12


@dataclass(frozen=True)
class Link:
    allreduce_bw: float  # bytes/s, ring bus bandwidth
    a2a_bw: float  # bytes/s each device sends in an all-to-all
    p2p_bw: float  # bytes/s of one send/recv
    latency_s: float  # per collective step / per message

    @staticmethod
    def uniform(bw: float, latency_s: float) -> "Link":
        return Link(bw, bw, bw, latency_s)


def ring_allreduce_s(nbytes: float, g: int, bw: float, lat: float) -> float:
    """Ring all-reduce: 2(g-1)/g of the buffer crosses each link, 2(g-1) latency steps. The planner prices the DP
    sync with it and the network emulator (parallel/comm/emulate.py) holds every all-reduce to it."""
    return 0.0 if g < 2 or nbytes == 0 else 2 * (g - 1) / g * nbytes / bw + 2 * (g - 1) * lat


def ring_half_s(nbytes: float, g: int, bw: float, lat: float) -> float:
    """Ring reduce-scatter or all-gather of a `nbytes` buffer: half a ring all-reduce (NCCL's all-reduce is one
    of each)."""
    return 0.5 * ring_allreduce_s(nbytes, g, bw, lat)


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops_bf16: float  # dense FLOP/s per device
    peak_flops_fp32: float
    compute_efficiency: float  # achieved fraction of peak on large GEMMs in a training step
    gemm_half_rows: int  # GEMM rows at which efficiency is half of compute_efficiency (small-GEMM penalty)
    mem_bytes: float  # per device
    mem_reserved_bytes: float  # per rank: runtime/context/allocator overhead outside our tensors
    mem_bw: float  # device memory bytes/s (the optimizer step is memory bound)
    devices_per_node: int
    intra: Link  # between devices of one node
    inter: Link  # between nodes (per device: its share of the node's NICs)
    dp_overlap: float  # fraction of the last backward that can hide DP all-reduce (0: comm competes for the cores)
    cores_per_node: int = 0  # CPU only: local ranks share these cores and the node's memory (0 = one device per rank)
    gemm_flops_by_threads: dict[int, float] = field(default_factory=dict)  # CPU: measured fp32 GEMM FLOP/s
    # CPU: measured bf16 GEMM FLOP/s (empty: unmeasured, the fp32 table stands in)
    gemm_bf16_flops_by_threads: dict[int, float] = field(default_factory=dict)
    layer_overhead_s: float = 0.0  # per layer per microbatch (fwd+bwd): launches, Python, dispatch bookkeeping
    # Fixed host costs per call / per step beyond bandwidth and link latency (0 on GPU profiles; on CPU+gloo
    # fitted by `nanotitan plan --calibrate`): an all-to-all call (wrapper, split-size host sync, packing),
    # a P2P send or recv, and one rank's per-step work outside microbatches (zero_grad, clipping, logging).
    a2a_call_s: float = 0.0
    p2p_call_s: float = 0.0
    step_overhead_s: float = 0.0
    source: str = ""  # where the figures come from
    # Dense FP8 tensor-core FLOP/s (e4m3, fp32 accumulate); Blackwell runs MXFP8 at the same rate. 0: no FP8 units
    # (A100, RTX 30xx, CPUs): the FP8 GEMMs are emulated at the fp32 rate (plan/fp8.py).
    peak_flops_fp8: float = 0.0
    # Dense MXFP8 (e4m3 with e8m0 block scales) tensor-core FLOP/s: Blackwell's block-scaled GEMM. 0: no MXFP8
    # units (Hopper, Ampere): train.fp8 mxfp8 is refused there by the planner; a CPU emulates it (plan/fp8.py).
    peak_flops_mxfp8: float = 0.0

    def peak_flops(self, dtype: str, ranks_on_node: int = 1) -> float:
        """FLOP/s of one rank while it runs. A CPU node's cores are split among its ranks (at least one
        thread each); ranks that outnumber the cores time-share them (`time_shared`)."""
        if not self.cores_per_node:
            return self.peak_flops_bf16 if dtype == "bf16" else self.peak_flops_fp32
        threads = max(1, self.cores_per_node // ranks_on_node)
        table = self.gemm_bf16_flops_by_threads if dtype == "bf16" and self.gemm_bf16_flops_by_threads \
            else self.gemm_flops_by_threads
        known = sorted(t for t in table if t <= threads) or [min(table)]
        return table[known[-1]] * threads / known[-1]  # linear past the largest measured

    def shares_cores(self, ranks_on_node: int) -> bool:
        """CPU node with more ranks than cores: ranks time-share the cores."""
        return bool(self.cores_per_node) and ranks_on_node > self.cores_per_node

    def time_shared(self, step_s: float, costs: dict[str, float], work: dict[str, float], nodes: int,
                    ranks_on_node: int, held: dict[str, float] | None = None) -> tuple[float, dict[str, float]]:
        """(step seconds, seconds by cause) once ranks that outnumber a CPU node's cores time-share them.

        `step_s`/`costs` are the critical path of ranks that own their device; `work` is the CPU seconds
        of every rank together, by cause. A rank idling in a pipeline bubble or waiting on a peer lends its
        core to another rank, so the step is also bounded below by the nodes' work / their cores; gloo's
        communication is CPU work too (copies, the host sync). `held`: the waits every rank takes at once (an
        emulated link's hold at the step's end: the DP sync's exposed part, the grad norm's all-reduce), which no
        rank's work fills, on top of that bound. Devices that are not shared (GPUs, a core per rank) keep the
        critical path."""
        if not self.shares_cores(ranks_on_node):
            return step_s, costs
        cpus, held = nodes * self.cores_per_node, held or {}
        if sum(work.values()) / cpus + sum(held.values()) <= step_s:
            return step_s, costs
        shared = {k: v / cpus for k, v in work.items()} | {"bubble": 0.0}
        for k, v in held.items():
            shared[k] = shared.get(k, 0.0) + v
        return sum(shared.values()), shared

    def mem_per_rank(self, ranks_on_node: int) -> float:
        """Memory one rank may use: its device, or its share of a CPU node."""
        return self.mem_bytes / ranks_on_node if self.cores_per_node else self.mem_bytes


# --- built-in profiles ---------------------------------------------------------------------------
# Effective-vs-datasheet choices shared by the GPU profiles:
# - compute_efficiency 0.45: large bf16 GEMM-bound training steps reach ~40-55% of dense peak
#   (Megatron-LM reports 41-48% MFU at scale on A100/H100); fp32 uses the same fraction.
# - NVLink all-reduce bus bandwidth ~ 80% of the per-direction datasheet figure (nccl-tests),
#   all-to-all ~ 70% of it; InfiniBand ~ 90% of line rate.
# - mem_reserved 1.5 GiB: CUDA context + NCCL buffers + allocator fragmentation.
_GPU_COMMON = dict(compute_efficiency=0.45, gemm_half_rows=128, mem_reserved_bytes=1.5 * GiB, dp_overlap=0.9,
                   layer_overhead_s=50e-6)


def _nvlink(per_direction_bw: float) -> Link:
    return Link(0.8 * per_direction_bw, 0.7 * per_direction_bw, 0.8 * per_direction_bw, 10e-6)


def _network(per_gpu_bw: float) -> Link:
    return Link(0.9 * per_gpu_bw, 0.9 * per_gpu_bw, 0.9 * per_gpu_bw, 20e-6)


BUILTIN: dict[str, Hardware] = {
    # NVIDIA H100 SXM5 datasheet: 989.4 TFLOPS BF16 dense (1,979 with sparsity), 1,978.9 FP8 dense, 66.9 TFLOPS FP32,
    # 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s total (450 GB/s per direction). Network: one
    # ConnectX-7 400 Gb/s NIC per GPU (DGX H100) = 50 GB/s.
    "h100-sxm": Hardware("h100-sxm", 989.4 * TFLOPS, 66.9 * TFLOPS, mem_bytes=80 * GB, mem_bw=3.35e12,
                         devices_per_node=8, intra=_nvlink(450 * GB), inter=_network(50 * GB),
                         peak_flops_fp8=1978.9 * TFLOPS, source="NVIDIA H100 datasheet (SXM5)", **_GPU_COMMON),
    # NVIDIA H800 SXM: the H100 SXM compute (FP8 included) and memory with NVLink cut to 400 GB/s total
    # (200 GB/s per direction). DeepSeek-V3 report (sec. 3.2.2) measures ~160 GB/s NVLink and 50 GB/s IB
    # per GPU (8 x 400 Gb/s per node), which is what we use directly.
    "h800": Hardware("h800", 989.4 * TFLOPS, 66.9 * TFLOPS, mem_bytes=80 * GB, mem_bw=3.35e12,
                     devices_per_node=8, intra=Link(160 * GB, 160 * GB, 160 * GB, 10e-6),
                     inter=Link(50 * GB, 50 * GB, 50 * GB, 20e-6), peak_flops_fp8=1978.9 * TFLOPS,
                     source="NVIDIA H800 SXM spec; DeepSeek-V3 technical report sec. 3.2.2", **_GPU_COMMON),
    # NVIDIA H200 SXM datasheet: 989 TFLOPS BF16 dense, 1,979 FP8 dense, 67 TFLOPS FP32, 141 GB HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s total; one 400 Gb/s NIC per GPU (HGX H200).
    "h200": Hardware("h200", 989.4 * TFLOPS, 66.9 * TFLOPS, mem_bytes=141 * GB, mem_bw=4.8e12,
                     devices_per_node=8, intra=_nvlink(450 * GB), inter=_network(50 * GB),
                     peak_flops_fp8=1978.9 * TFLOPS, source="NVIDIA H200 datasheet (SXM)", **_GPU_COMMON),
    # NVIDIA HGX B200 datasheet, per GPU: 2.25 PFLOPS BF16 dense (4.5 with sparsity), 4.5 PFLOPS FP8/MXFP8 dense,
    # 75 TFLOPS FP32, 180 GB HBM3e at 7.7 TB/s, NVLink 5 1.8 TB/s total (900 GB/s per direction); one 400 Gb/s
    # NIC per GPU (DGX B200).
    "b200": Hardware("b200", 2250 * TFLOPS, 75 * TFLOPS, mem_bytes=180 * GB, mem_bw=7.7e12, devices_per_node=8,
                     intra=_nvlink(900 * GB), inter=_network(50 * GB), peak_flops_fp8=4500 * TFLOPS,
                     peak_flops_mxfp8=4500 * TFLOPS, source="NVIDIA HGX B200 datasheet", **_GPU_COMMON),
    # NVIDIA GB300 NVL72 datasheet, per GPU (the rack's figures / 72, dense = half the sparse figure): 2.5 PFLOPS
    # BF16 dense, 5 PFLOPS FP8/MXFP8 dense, 288 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s total in a 72-GPU domain; one
    # 800 Gb/s ConnectX-8 NIC per GPU. FP32 taken as B200's 75 TFLOPS.
    "gb300": Hardware("gb300", 2500 * TFLOPS, 75 * TFLOPS, mem_bytes=288 * GB, mem_bw=8e12, devices_per_node=72,
                      intra=_nvlink(900 * GB), inter=_network(100 * GB), peak_flops_fp8=5000 * TFLOPS,
                      peak_flops_mxfp8=5000 * TFLOPS, source="NVIDIA GB300 NVL72 datasheet", **_GPU_COMMON),
    # NVIDIA A100 80GB SXM datasheet: 312 TFLOPS BF16 dense, 19.5 TFLOPS FP32, 80 GB HBM2e at
    # 2,039 GB/s, NVLink 3 600 GB/s total (300 per direction); DGX A100: one 200 Gb/s HDR NIC per GPU = 25 GB/s.
    "a100-80gb": Hardware("a100-80gb", 312 * TFLOPS, 19.5 * TFLOPS, mem_bytes=80 * GB, mem_bw=2.039e12,
                          devices_per_node=8, intra=_nvlink(300 * GB), inter=_network(25 * GB),
                          source="NVIDIA A100 datasheet (80GB SXM)", **_GPU_COMMON),
    # NVIDIA RTX 3090 (GA102 whitepaper): 71 TFLOPS FP16/BF16 tensor with FP32 accumulate (142 with FP16
    # accumulate), 35.6 TFLOPS FP32, 24 GB GDDR6X at 936 GB/s. Rented boxes (the seed's vast.ai) have no
    # NVLink bridge and GeForce cards have no PCIe peer-to-peer, so NCCL stages through host memory:
    # PCIe 4.0 x16 is 31.5 GB/s per direction, we assume ~10 GB/s bus bandwidth. Nodes: 10 GbE.
    "rtx3090": Hardware("rtx3090", 71 * TFLOPS, 35.6 * TFLOPS, compute_efficiency=0.45, gemm_half_rows=128,
                        mem_bytes=24 * GB, mem_reserved_bytes=1.0 * GiB, mem_bw=936 * GB, devices_per_node=8,
                        intra=Link(10 * GB, 8 * GB, 10 * GB, 20e-6), inter=Link.uniform(1.1 * GB, 50e-6),
                        dp_overlap=0.9, layer_overhead_s=50e-6, source="NVIDIA GA102 whitepaper (RTX 3090)"),
    # NVIDIA RTX 3060 12GB (GA106): 25.6 TFLOPS FP16/BF16 tensor with FP32 accumulate (51.2 with FP16
    # accumulate), 12.7 TFLOPS FP32, 12 GB GDDR6 at 360 GB/s, PCIe 4.0 x16; same PCIe caveats as the 3090.
    "rtx3060": Hardware("rtx3060", 25.6 * TFLOPS, 12.7 * TFLOPS, compute_efficiency=0.45, gemm_half_rows=128,
                        mem_bytes=12 * GB, mem_reserved_bytes=1.0 * GiB, mem_bw=360 * GB, devices_per_node=8,
                        intra=Link(10 * GB, 8 * GB, 10 * GB, 20e-6), inter=Link.uniform(1.1 * GB, 50e-6),
                        dp_overlap=0.9, layer_overhead_s=50e-6, source="NVIDIA GA106 spec (RTX 3060 12GB)"),
    # This project's CPU machine, calibrated (docs/calibration.md): 2 cores, 24 GiB; used by name only (another
    # host gets `cpu_profile` of its own cores and memory, which borrows these figures). `nanotitan plan --measure`
    # (quiet machine): fp32 GEMM 1024^2 115 GFLOP/s on 1 thread, 222 on 2 (the baselines: ~142/270 at 2048^2);
    # gloo all-reduce 1.5 GB/s bus bandwidth, all-to-all 1.9 GB/s, send/recv 3.7 GB/s, 54 us per call.
    # `nanotitan plan --calibrate` on 17 measured layouts (N = 2, 4, 8): a step reaches 59% of GEMM peak;
    # an EP all-to-all costs ~0.8 ms of host time beyond its bytes (split-size host sync, packing, autograd),
    # a P2P send or recv ~0.6 ms, a rank's per-step work outside microbatches ~3 ms; a rank's RSS before its
    # model's tensors ~436 MiB (torch, gloo, DCP, data, allocator). Gloo runs on the same cores as compute,
    # so it cannot hide behind backward (dp_overlap 0). All ranks are local (one node).
    "cpu-gloo": Hardware("cpu-gloo", 115e9, 115e9, compute_efficiency=0.59, gemm_half_rows=16,
                         mem_bytes=24 * GiB, mem_reserved_bytes=436 * 2**20, mem_bw=19 * GB, devices_per_node=64,
                         intra=Link(1.5 * GB, 1.9 * GB, 3.7 * GB, 54e-6), inter=Link.uniform(0.1 * GB, 500e-6),
                         dp_overlap=0.0, cores_per_node=2, gemm_flops_by_threads={1: 115e9, 2: 222e9},
                         layer_overhead_s=0.3e-3, a2a_call_s=0.8e-3, p2p_call_s=0.6e-3, step_overhead_s=3e-3,
                         source="nanotitan plan --measure + --calibrate on the project's 2-core CPU machine "
                                "(docs/calibration.md), torch 2.13, gloo"),
}
ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb", "3090": "rtx3090", "3060": "rtx3060", "cpu": "cpu-gloo",
           "h800-sxm": "h800", "h200-sxm": "h200", "rtx-3090": "rtx3090", "rtx-3060": "rtx3060", "b200-sxm": "b200",
           "gb300-nvl72": "gb300"}
# torch.cuda.get_device_name() substring -> built-in profile (first match wins).
GPU_NAMES = {"GB300": "gb300", "B200": "b200", "H800": "h800", "H200": "h200", "H100": "h100-sxm", "A100": "a100-80gb",
             "3090": "rtx3090", "3060": "rtx3060"}
# Dense datasheet peaks (FLOP/s) by device-name substring: what MFU divides by (metrics.device_peak_flops).
GPU_PEAKS = {key: {"bf16": BUILTIN[p].peak_flops_bf16, "fp32": BUILTIN[p].peak_flops_fp32}
             for key, p in GPU_NAMES.items()}


def save_hardware(hw: Hardware, path: str | Path) -> None:
    Path(path).write_text(json.dumps(dataclasses.asdict(hw), indent=2) + "\n")


def load_hardware(path: str | Path) -> Hardware:
    d = json.loads(Path(path).read_text())
    try:
        d["intra"], d["inter"] = Link(**d["intra"]), Link(**d["inter"])
        for key in ("gemm_flops_by_threads", "gemm_bf16_flops_by_threads"):  # JSON keys are strings
            d[key] = {int(k): float(v) for k, v in d.get(key, {}).items()}
        return Hardware(**d)
    except (KeyError, TypeError) as e:
        raise ValueError(f"hardware profile {path} is not a nanotitan profile ({e}); "
                         f"write one with `nanotitan plan --measure --out {path}`") from None


def get_hardware(name_or_path: str | Hardware) -> Hardware:
    """A built-in profile by name (case-insensitive), or a JSON profile file."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    key = name_or_path.lower()
    key = ALIASES.get(key, key)
    if key in BUILTIN:
        return BUILTIN[key]
    if Path(name_or_path).is_file():
        return load_hardware(name_or_path)
    raise ValueError(f"unknown hardware {name_or_path!r}: use one of {', '.join(BUILTIN)} or a profile JSON file "
                     f"(--hardware NAME|FILE)")


PEAK_BUDGET_S = 1.0  # per measurement: a bf16 launch measures bf16 and fp32 at most, so <= ~2 s before ranks start
MAX_GEMM_N = 2048  # the size the first waves measured at (the baselines, docs/design.md): growth stops here
PEAK_CACHE = "hardware/gemm_peak.json"  # under the cache root: measured once per machine, dtype, threads, torch


def measure_cpu_gemm_flops(threads: int, n: int = 0, repeats: int = 5, dtype: str = "fp32",
                           budget_s: float = PEAK_BUDGET_S) -> float:
    """Best-of-repeats n x n matmul FLOP/s on `threads` threads (best: the machine may be shared), in `dtype`
    ("fp32", or "bf16": bf16 inputs and output, fp32 accumulation, the GEMM autocast runs; AMX or AVX512-BF16
    make it several times the fp32 rate, a CPU without them emulates it ~50-70x slower than fp32).

    Bounded by `budget_s`: with n=0 the size grows from 128 by doubling up to MAX_GEMM_N while the next size
    (8x the work) still fits the time left, then repeats run while time is left. A fixed 2048^2 bf16 GEMM took
    ~14 s per call on a CPU without native bf16 (six minutes per launch); grown, it stops at 256^2.
    A fixed `n` (`nanotitan plan --measure`) is timed at least once, repeats within the budget.
    The rate returned is the best over every size timed: a peak, and the rate is not monotonic in the size
    where bf16 is emulated (AMD AVX2 here: 3.0 GFLOP/s at 128^2, 0.2 at 256^2), so the last size's rate alone
    put the default job's bf16 MFU at 119%.
    The MFU peak on CPU (metrics, through `cached_cpu_gemm_flops`) and `nanotitan plan --measure` use this."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    deadline = time.perf_counter() + budget_s

    def once(a, b) -> float:
        t0 = time.perf_counter()
        a @ b
        return time.perf_counter() - t0

    try:
        size, peak = n or 128, 0.0
        while True:
            a, b = torch.randn(size, size, dtype=dt), torch.randn(size, size, dtype=dt)
            if size == (n or 128):
                a @ b  # warm up the thread pool (the growth steps warm the larger sizes)
            best = once(a, b)
            peak = max(peak, 2 * size**3 / best)
            # the next size costs ~8x: grow only while a call there, and one repeat, fit the time left
            if n or size >= MAX_GEMM_N or 2 * 8 * best > deadline - time.perf_counter():
                break
            size *= 2
        for _ in range(repeats - 1):
            if time.perf_counter() + best > deadline:
                break
            best = min(best, once(a, b))
        return max(peak, 2 * size**3 / best)
    finally:
        torch.set_num_threads(old)


def cache_root() -> Path:
    """$NANOTITAN_CACHE, else ~/.cache/nanotitan (data.cache_dir overrides it for prepared data)."""
    return Path(os.environ.get("NANOTITAN_CACHE") or "~/.cache/nanotitan").expanduser()


def _cpu_model() -> str:
    import platform

    return next((line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines()
                 if line.startswith("model name")), platform.processor() or platform.machine())


def _machine_key(dtype: str, threads: int) -> str:
    """What a GEMM rate depends on: this host and its CPU model, the dtype, the threads, the torch build."""
    import platform

    import torch

    limit = isa_limit()
    # "best of sizes": figures cached before the peak was the best over every size (the last size's rate) re-measure
    return (f"{platform.node()}|{_cpu_model()}{'|' + limit if limit else ''}|{dtype}|{threads} threads|"
            f"torch {torch.__version__}|best of sizes")


def machine_kind() -> str:
    """What a planner calibration holds for: the CPU model, the cores this process may use, the kernel ISA caps and
    the torch build; not the host name, so every machine of one kind (a cloud instance type) shares it."""
    import torch

    limit = isa_limit()
    return f"{_cpu_model()}|{host_cores()} cores{'|' + limit if limit else ''}|torch {torch.__version__}"


CALIBRATION_CACHE = "hardware/calibration.json"  # under the cache root: one planner calibration per machine kind
# The profile fields a machine calibration sets (plan/fit/machine.py fits them on this machine's measured steps)
CALIBRATED_FIELDS = ("compute_efficiency", "a2a_call_s", "p2p_call_s", "step_overhead_s", "layer_overhead_s",
                     "mem_bw", "mem_reserved_bytes")


def calibration_path(cache_dir: str | Path | None = None) -> Path:
    return Path(cache_dir or cache_root()) / CALIBRATION_CACHE


def cached_calibration(kind: str | None = None, cache_dir: str | Path | None = None) -> dict | None:
    """This machine kind's planner calibration (`plan --calibrate-machine`), or None: none was made, or the cache
    cannot be read (a calibration that cannot be read is one to make again, never a failure)."""
    try:
        entry = json.loads(calibration_path(cache_dir).read_text()).get(kind or machine_kind())
    except (OSError, ValueError, AttributeError):
        return None
    return entry if isinstance(entry, dict) and isinstance(entry.get("profile"), dict) else None


def save_calibration(entry: dict, kind: str | None = None, cache_dir: str | Path | None = None) -> Path:
    """Store `entry` as this machine kind's calibration (write-then-rename, other kinds' entries kept)."""
    path = calibration_path(cache_dir)
    try:
        table = json.loads(path.read_text())
        table = table if isinstance(table, dict) else {}
    except (OSError, ValueError):
        table = {}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({**table, kind or machine_kind(): entry}, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def with_calibration(hw: Hardware, entry: dict) -> Hardware:
    """`hw` with a machine calibration's fitted fields and its measured per-core GEMM rates."""
    prof = entry["profile"]
    fields = {k: float(prof[k]) for k in CALIBRATED_FIELDS if k in prof}
    rates = {}
    for key in ("gemm_flops_by_threads", "gemm_bf16_flops_by_threads"):
        if prof.get(key):
            rates[key] = {int(t): float(v) for t, v in prof[key].items()}
    if "gemm_flops_by_threads" in rates:
        rates["peak_flops_fp32"] = rates["gemm_flops_by_threads"][min(rates["gemm_flops_by_threads"])]
    if "gemm_bf16_flops_by_threads" in rates:
        rates["peak_flops_bf16"] = rates["gemm_bf16_flops_by_threads"][min(rates["gemm_bf16_flops_by_threads"])]
    return dataclasses.replace(hw, **fields, **rates,
                               source=f"{hw.source}; calibrated on this machine kind: {entry.get('source', '')}")


ISA_LIMIT_ENV = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")  # oneDNN's and ATen's kernel ISA caps


def isa_limit() -> str:
    """The kernel ISA caps set in the environment ('' if none): they change the GEMM rates (capped to AVX2,
    this AMX host's bf16 GEMM falls from ~1300 to ~2.4 GFLOP/s, as on a CPU without native bf16)."""
    return ",".join(f"{k}={os.environ[k]}" for k in ISA_LIMIT_ENV if os.environ.get(k))


def cached_cpu_gemm_flops(threads: int, dtype: str = "fp32", cache_dir: str | Path | None = None) -> float:
    """`measure_cpu_gemm_flops` (bounded), measured once per machine, dtype, threads and torch version and kept
    in CACHE/hardware/gemm_peak.json (`cache_dir`, else `cache_root()`). A cache that cannot be read or written
    costs a measurement, never a failure."""
    path = Path(cache_dir or cache_root()) / PEAK_CACHE
    key = _machine_key(dtype, threads)
    try:
        table = json.loads(path.read_text())
        if isinstance(table, dict) and isinstance(table.get(key), (int, float)) and table[key] > 0:
            return float(table[key])
    except (OSError, ValueError):
        table = {}
    table = table if isinstance(table, dict) else {}
    flops = measure_cpu_gemm_flops(threads, dtype=dtype)
    try:  # write-then-rename: ranks or launches measuring at once never read half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({**table, key: flops}, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass
    return flops


def _cpuinfo(path: str = "/proc/cpuinfo") -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # x86 /proc/cpuinfo flags; aarch64 lists "bf16" under Features


def cpu_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU computes bf16 GEMMs natively (AMX-BF16 or AVX512-BF16 on x86, the BF16 extension on
    aarch64), from /proc/cpuinfo; None where there is none to read (macOS: unknown, say nothing)."""
    text = _cpuinfo(cpuinfo)
    flags = set()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            flags.update(value.split())
    if not flags:
        return None
    return bool(flags & {*NATIVE_BF16_FLAGS, "bf16"})


def host_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def host_memory_bytes(meminfo: str = "/proc/meminfo") -> float:
    """Physical memory of this host: MemTotal of /proc/meminfo, else the page count (macOS)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def cpu_profile(cores: int, mem_bytes: float, dtype: str = "fp32", calibrated: bool = True) -> Hardware:
    """A CPU node: its own cores and memory. Where this machine kind has a planner calibration
    (`cached_calibration`, made by `nanotitan plan --calibrate-machine`), its measured per-core GEMM rate and
    its fitted host costs; otherwise the per-core GEMM rate, memory bandwidth, gloo link figures and the host
    costs of our code (per call, per step, the per-rank reserve) are nominal, taken from the calibrated `cpu-gloo`
    machine. For a bf16 plan the bf16 rate is that nominal
    fp32 rate times this host's measured bf16/fp32 GEMM ratio (1 thread, bounded and cached:
    `cached_cpu_gemm_flops`), so a CPU without native bf16 is planned at its ~1/60 of fp32, and one with AMX
    at its several times. `calibrated=False`: the nominal profile, whatever the cache holds (what a calibration
    starts from)."""
    ref = BUILTIN["cpu-gloo"]
    per_core = ref.gemm_flops_by_threads[1]
    bf16, note = {}, ""  # empty: the fp32 table stands in (Hardware.peak_flops)
    if dtype == "bf16":
        ratio = cached_cpu_gemm_flops(1, "bf16") / cached_cpu_gemm_flops(1, "fp32")
        bf16, note = {1: per_core * ratio}, f"; bf16 {ratio:.2g} x fp32 (measured here)"
    hw = dataclasses.replace(ref, name=f"cpu-{cores}core", cores_per_node=cores, mem_bytes=float(mem_bytes),
                             gemm_flops_by_threads={1: per_core}, gemm_bf16_flops_by_threads=bf16,
                             peak_flops_bf16=bf16.get(1, ref.peak_flops_bf16),
                             devices_per_node=max(ref.devices_per_node, cores),
                             source=f"detected: {cores} cores, {mem_bytes / GiB:.1f} GiB; GEMM {per_core / 1e9:.0f} "
                                    f"GFLOP/s per core and gloo/host costs nominal (cpu-gloo's){note}")
    entry = cached_calibration() if calibrated and cores == host_cores() else None  # this machine kind's
    if entry is None:
        return hw
    hw = dataclasses.replace(with_calibration(hw, entry), name=f"cpu-{cores}core-calibrated")
    if dtype == "bf16" and not entry["profile"].get("gemm_bf16_flops_by_threads"):  # fp32 measured: the ratio
        fp32 = hw.gemm_flops_by_threads[min(hw.gemm_flops_by_threads)]
        hw = dataclasses.replace(hw, gemm_bf16_flops_by_threads={1: fp32 * ratio}, peak_flops_bf16=fp32 * ratio)
    return hw


def detect_hardware(profile: str | Hardware | None = None, dtype: str = "fp32") -> Hardware:
    """The profile of the device this process would train on: `profile` (a built-in name or a JSON file),
    else the one in $NANOTITAN_HARDWARE, else the CUDA GPU by name, else a generic profile of this CPU host
    (`cpu_profile` of its cores and memory; `dtype` "bf16" measures its bf16 rate). A calibrated profile is
    used only when named."""
    import torch

    profile = profile or os.environ.get("NANOTITAN_HARDWARE")
    if profile:
        return get_hardware(profile)
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).upper()
        # an unknown GPU gets a middle-of-the-road datacenter profile
        return BUILTIN[next((p for needle, p in GPU_NAMES.items() if needle in name), "a100-80gb")]
    return cpu_profile(host_cores(), host_memory_bytes(), dtype)


def cpu_peak_env(dtype: str) -> str:
    """The variable that carries the launcher's measured CPU GEMM peak of `dtype` to the ranks."""
    return "NANOTITAN_CPU_PEAK_FLOPS" + ("_BF16" if dtype == "bf16" else "")


def cpu_peak_flops(threads: int, dtype: str = "fp32") -> float:
    """Measured GEMM peak at `threads` in the compute dtype (bf16 under mixed precision): bounded (~1 s) and
    cached per machine, dtype, threads and torch version (`hardware.cached_cpu_gemm_flops`). Ranks that share
    the cores would measure each other, so the launcher measures once before starting them and hands the figure
    down in `cpu_peak_env(dtype)` (one variable per dtype: an fp32 figure never bounds a bf16 run)."""
    env = os.environ.get(cpu_peak_env(dtype))
    if env:
        return float(env)
    return cached_cpu_gemm_flops(threads, dtype)


def fmt_bytes(n: float) -> str:
    """A byte count as people read it: 1.5 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
