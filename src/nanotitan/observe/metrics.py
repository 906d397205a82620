"""MFU's peak FLOP/s (device and job), the bf16 advice, and the per-step record's writers: metrics.jsonl (torn tail
dropped on resume), TensorBoard and W&B (global rank 0). Console lines are report.py's; memory meters memory.py's."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

from ..config.errors import first_line
from ..config.errors import StorageError, os_reason
from ..config.hardware import (GPU_PEAKS, cpu_native_bf16, cpu_peak_env, cpu_peak_flops,  # noqa: F401 (re-used names)
                               fmt_bytes, isa_limit)  # noqa: F401


def bf16_advice(threads: int) -> str:
    """'' unless bf16 GEMMs are emulated here: a CPU without native bf16 (no AMX-BF16 or AVX512-BF16 in
    /proc/cpuinfo), or one whose bf16 kernels an ISA cap in the environment turns off (ONEDNN_MAX_CPU_ISA,
    ATEN_CPU_CAPABILITY). Then, if the measured bf16 GEMM (bounded, cached) is slower than fp32, one line with
    both rates and the advice to train in fp32. Emulated bf16 ran at 1.2 GFLOP/s against 69-83 in fp32 on a
    2-core AVX2 machine."""
    native, limit = cpu_native_bf16(), isa_limit()
    if native is None or (native and not limit):
        return ""
    bf16, fp32 = cpu_peak_flops(threads, "bf16"), cpu_peak_flops(threads, "fp32")
    if bf16 >= fp32:  # emulated but no slower (a future kernel, a cap that keeps bf16): nothing to advise
        return ""
    why = f"with its kernels capped by {limit}" if native else \
        "on a CPU without native bf16 (no amx_bf16 or avx512_bf16 in /proc/cpuinfo)"
    return (f"warning: train.dtype=bf16 {why}: a bf16 GEMM runs at {bf16 / 1e9:.1f} GFLOP/s against "
            f"{fp32 / 1e9:.1f} in fp32 ({fp32 / bf16:.0f}x slower) on {threads} thread{'s' if threads > 1 else ''}; "
            f"use --train.dtype fp32")


def device_peak_flops(device: torch.device, dtype: str, threads: int) -> float:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in GPU_PEAKS.items():
            if key in name:
                return peaks["bf16" if dtype == "bf16" else "fp32"]
        return GPU_PEAKS["A100"]["bf16" if dtype == "bf16" else "fp32"]
    return cpu_peak_flops(threads, dtype)


def job_peak_flops(device: torch.device, dtype: str, threads: int, world: int, per_rank: float = 0.0) -> float:
    """The FLOP/s that bound the job's MFU: per-rank peak (given, or measured/datasheet) times the ranks that can
    run at it at once. On CPU, ranks beyond the cores share them, so the machine's peak bounds MFU."""
    per_rank = per_rank or device_peak_flops(device, dtype, threads)
    ranks_at_peak = world if device.type == "cuda" else max(1, min(world, (os.cpu_count() or 1) // threads))
    return per_rank * ranks_at_peak


def finite_or_none(x):
    """The record with every non-finite float replaced by None (JSON null), recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_or_none(v) for v in x]
    return x


def drop_torn_tail(path: Path, tail_bytes: int = 1 << 16) -> str:
    """Truncate `path` (JSON lines) after its last complete line when its last line is torn: no newline at the
    end (a crash mid-write), or not JSON (a crash can leave NUL bytes). '' when there was nothing to drop, else
    the warning line. Only the last line: one written whole and damaged later is not ours to guess about."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return ""
    if size == 0:
        return ""
    with open(path, "rb+") as f:
        f.seek(max(0, size - tail_bytes))
        tail = f.read()
        whole = tail.endswith(b"\n")
        body, sep, last = (tail[:-1] if whole else tail).rpartition(b"\n")
        if not sep and len(tail) < size:  # the last line is longer than the window: look further back
            return drop_torn_tail(path, 4 * tail_bytes)
        if whole:
            try:
                json.loads(last)
                return ""
            except ValueError:
                pass
        cut = size - len(tail) + len(body) + len(sep)  # just after the last complete line's newline
        f.truncate(cut)
    return (f"warning: {path}: dropped a torn last line ({size - cut} bytes, from a crash mid-write); "
            "the file is strict JSON lines again")


class MetricsWriter:
    """metrics.jsonl + TensorBoard (+ Weights & Biases with `wandb_project`) on global rank 0; a no-op elsewhere."""

    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool, append: bool = False,
                 wandb_project: str = "", config: dict | None = None):
        self.enabled = enabled
        self.tb = self.wandb = None
        if not enabled:
            return
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(run_dir) / "metrics.jsonl"
        if append and (line := drop_torn_tail(self.path)):  # a crash mid-write: strict JSON lines again
            print(line, flush=True)
        self.f = open(self.path, "a" if append else "w")  # a resumed run continues the same file
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(run_dir, "tb"))
            except ImportError:  # tensorboard is a dependency, but never fail a run over it
                self.tb = None
        if wandb_project:
            self.wandb = open_wandb(wandb_project, run_dir, config or {})

    def _append(self, obj: dict):
        """One strict JSON line (a non-finite float, e.g. a diverged loss, is written as null, never as a bare
        NaN token), flushed; a write the disk refuses ends the run with one line (StorageError)."""
        try:
            self.f.write(json.dumps(finite_or_none(obj), allow_nan=False) + "\n")
            self.f.flush()
        except OSError as e:
            from ..state.manifest import storage_line

            raise StorageError(storage_line(self.path.parent, f"writing {self.path} failed: {os_reason(e)}")) from None

    def write(self, record: dict):
        if not self.enabled:
            return
        self._append(record)
        if self.tb is not None:
            step = record["step"]
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])  # the same record, lists (expert_load) as JSON

    def start_run(self, config_toml: str, start_step: int) -> None:
        """RUN_DIR/config.toml (the resolved config), once the run has started (a failed resume leaves the old one
        in place); after a torchelastic restart, a "restart" event, so replayed steps can be told apart."""
        if not self.enabled:
            return
        (self.path.parent / "config.toml").write_text(config_toml)
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if attempt > 0:
            self.event({"event": "restart", "attempt": attempt, "from_step": start_step})

    def event(self, event: dict):
        """A line that is not a step record (e.g. {"event": "restart", ...}): metrics.jsonl only."""
        if self.enabled:
            self._append(event)

    def close(self):
        if self.enabled:
            self.f.close()
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.finish()


def open_wandb(project: str, run_dir: str, config: dict):
    """A W&B run named after the run dir, with the resolved config; None (and one line saying how to enable
    it) when the package or a login is missing. Files go to $WANDB_DIR, else the run dir."""
    try:
        import wandb
    except ImportError:
        print("nanotitan: run.wandb=true but the wandb package is missing: pip install 'nanotitan[wandb]' "
              "(logging to metrics.jsonl only)", file=sys.stderr, flush=True)
        return None
    try:
        return wandb.init(project=project, name=Path(run_dir).name, config=config,
                          dir=os.environ.get("WANDB_DIR", run_dir))
    except Exception as e:  # noqa: BLE001 - no login, no network: W&B is optional, the run goes on
        print(f"nanotitan: W&B disabled ({first_line(e)}): run `wandb login`, or set WANDB_MODE=offline and "
              "`wandb sync` later (logging to metrics.jsonl only)", file=sys.stderr, flush=True)
        return None
