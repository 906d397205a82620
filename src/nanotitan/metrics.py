"""Throughput, MFU, memory and the per-step record: console, metrics.jsonl and TensorBoard (global rank 0)."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

# Datasheet dense peaks (FLOP/s) per GPU for MFU when train.peak_flops is 0.
GPU_PEAKS = {
    "H100": {"bf16": 989e12, "fp32": 67e12},  # H100 SXM datasheet (dense)
    "H200": {"bf16": 989e12, "fp32": 67e12},  # same GH100 die as H100 SXM
    "H800": {"bf16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},  # A100 datasheet (dense, non-TF32 fp32)
    "3090": {"bf16": 71e12, "fp32": 35.6e12},  # GA102 datasheet (dense tensor bf16)
}


def measure_cpu_gemm_flops(threads: int, n: int = 2048, reps: int = 5) -> float:
    """Best-of-reps fp32 GEMM throughput of this process at its thread count (FLOP/s)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(old)
    return 2 * n**3 / best


def cpu_peak_flops(threads: int) -> float:
    """Measured fp32 GEMM peak at `threads`. Ranks that share the cores would measure each other, so the
    launcher measures once before starting them and hands the figure down in NANOTITAN_CPU_PEAK_FLOPS."""
    env = os.environ.get("NANOTITAN_CPU_PEAK_FLOPS")
    if env:
        return float(env)
    return measure_cpu_gemm_flops(threads)


def device_peak_flops(device: torch.device, dtype: str, threads: int) -> float:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in GPU_PEAKS.items():
            if key in name:
                return peaks["bf16" if dtype == "bf16" else "fp32"]
        return GPU_PEAKS["A100"]["bf16" if dtype == "bf16" else "fp32"]
    return cpu_peak_flops(threads)


def peak_mem_bytes(device: torch.device) -> int:
    """CUDA max allocated, or this process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kb * (1 if sys.platform == "darwin" else 1024))


class MetricsWriter:
    """metrics.jsonl + TensorBoard on global rank 0; a no-op elsewhere."""

    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool, append: bool = False):
        self.enabled = enabled
        self.tb = None
        if not enabled:
            return
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(run_dir) / "metrics.jsonl"
        self.f = open(self.path, "a" if append else "w")  # a resumed run continues the same file
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(run_dir, "tb"))
            except ImportError:  # tensorboard is a dependency, but never fail a run over it
                self.tb = None

    def write(self, record: dict):
        if not self.enabled:
            return
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()
        if self.tb is not None:
            step = record["step"]
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, step)

    def close(self):
        if self.enabled:
            self.f.close()
            if self.tb is not None:
                self.tb.close()


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
