"""Throughput, MFU, memory and the per-step record: console, metrics.jsonl and TensorBoard (global rank 0)."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import threading
from pathlib import Path

import torch

from .hardware import GPU_PEAKS, measure_cpu_gemm_flops  # datasheet peaks (MFU when train.peak_flops is 0)


def cpu_peak_env(dtype: str) -> str:
    """The variable that carries the launcher's measured CPU GEMM peak of `dtype` to the ranks."""
    return "NANOTITAN_CPU_PEAK_FLOPS" + ("_BF16" if dtype == "bf16" else "")


def cpu_peak_flops(threads: int, dtype: str = "fp32") -> float:
    """Measured GEMM peak at `threads` in the compute dtype (bf16 under mixed precision). Ranks that share the
    cores would measure each other, so the launcher measures once before starting them and hands the figure
    down in `cpu_peak_env(dtype)` (one variable per dtype: an fp32 figure never bounds a bf16 run)."""
    env = os.environ.get(cpu_peak_env(dtype))
    if env:
        return float(env)
    return measure_cpu_gemm_flops(threads, dtype=dtype)


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


def peak_mem_bytes(device: torch.device) -> int:
    """CUDA max allocated, or this process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kb * (1 if sys.platform == "darwin" else 1024))


def finite_or_none(x):
    """The record with every non-finite float replaced by None (JSON null), recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_or_none(v) for v in x]
    return x


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
        self.f = open(self.path, "a" if append else "w")  # a resumed run continues the same file
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(run_dir, "tb"))
            except ImportError:  # tensorboard is a dependency, but never fail a run over it
                self.tb = None
        if wandb_project:
            self.wandb = open_wandb(wandb_project, run_dir, config or {})

    def write(self, record: dict):
        if not self.enabled:
            return
        # Strict JSON: a non-finite float (a diverged loss) is written as null, never as a bare NaN token.
        self.f.write(json.dumps(finite_or_none(record), allow_nan=False) + "\n")
        self.f.flush()
        if self.tb is not None:
            step = record["step"]
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])  # the same record, lists (expert_load) as JSON

    def event(self, event: dict):
        """A line that is not a step record (e.g. {"event": "restart", ...}): metrics.jsonl only."""
        if self.enabled:
            self.f.write(json.dumps(finite_or_none(event), allow_nan=False) + "\n")
            self.f.flush()

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
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"nanotitan: W&B disabled ({first}): run `wandb login`, or set WANDB_MODE=offline and "
              "`wandb sync` later (logging to metrics.jsonl only)", file=sys.stderr, flush=True)
        return None


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# --- memory that means something per layout: live tensors, not the process's RSS ------------------------------
def _storages_bytes(tensors, seen: set) -> int:
    """Bytes of the distinct storages behind `tensors` that are not in `seen` yet (then added to it)."""
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 DTensor: this rank's shard
        storage = t.untyped_storage()
        key = (storage.data_ptr(), str(t.device))
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def live_tensor_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Bytes this rank holds in parameters, gradients and optimizer state, each storage counted once (the
    Reducer's gradients are views of flat bucket buffers: the buffers are what is allocated). Tensors the
    optimizer updates that are not the model's parameters (ZeRO's flat shards) count as optimizer state."""
    seen: set = set()
    params = list(model.parameters())
    own = [q for g in optimizer.param_groups for q in g["params"]] if optimizer is not None else []
    state = [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)] if own else []
    param_bytes = _storages_bytes(params, seen)
    grad_bytes = _storages_bytes([q.grad for q in params + own if q.grad is not None], seen)
    return {"param_bytes": param_bytes, "grad_bytes": grad_bytes, "optim_bytes": _storages_bytes(own + state, seen)}


class SavedActivations:
    """Bytes of the tensors autograd keeps for backward (the activations a schedule holds), live and peak.

        meter = SavedActivations(model)        # the model's parameters are not activations: not counted
        with meter:                            # around forward and backward of a step
            ...
        meter.peak_bytes; meter.reset_peak()   # per step

    A `saved_tensors_hooks` pair wraps each saved tensor in a handle that counts its storage while autograd
    holds it (once per storage, however many ops save it); backward frees the handles as it consumes them.
    Under activation checkpointing, what a block recomputes during its own backward is not counted.
    """

    def __init__(self, model: torch.nn.Module | None = None):
        self.params = set()
        _storages_bytes(model.parameters() if model is not None else [], self.params)
        self.live: dict = {}  # storage key -> [handles alive, bytes]
        self.bytes = self.peak_bytes = 0
        self.lock = threading.Lock()  # CUDA backward frees handles on autograd's device threads
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack_saved)

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    def reset_peak(self):
        self.peak_bytes = self.bytes

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = (storage.data_ptr(), str(t.device))
        if key in self.params:
            return t
        # detach(): an op's saved output would otherwise hold its own grad_fn, a cycle gc cannot see (a node
        # that backward never runs, e.g. an unused z-loss, would then never free its tensors)
        return _SavedTensor(self, t.detach(), key, storage.nbytes())

    def _add(self, key, nbytes: int, sign: int):
        with self.lock:
            entry = self.live.setdefault(key, [0, nbytes])
            entry[0] += sign
            if entry[0] == 0:
                del self.live[key]
                self.bytes -= entry[1]
            elif entry[0] == 1 and sign > 0:
                self.bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.bytes)


class _SavedTensor:
    """What autograd stores instead of a saved tensor: the tensor, counted until autograd drops it."""
    __slots__ = ("key", "meter", "nbytes", "t")

    def __init__(self, meter: SavedActivations, t: torch.Tensor, key, nbytes: int):
        self.meter, self.t, self.key, self.nbytes = meter, t, key, nbytes
        meter._add(key, nbytes, +1)

    def __del__(self):
        self.meter._add(self.key, self.nbytes, -1)


def _unpack_saved(saved):
    return saved.t if isinstance(saved, _SavedTensor) else saved
