"""Throughput, MFU, memory and the per-step record: console, metrics.jsonl and TensorBoard (global rank 0)."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import resource
import sys
import threading
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..config.errors import first_line
from ..config.errors import StorageError, os_reason
from ..config.hardware import GPU_PEAKS, cpu_native_bf16, cpu_peak_env, cpu_peak_flops, fmt_bytes, isa_limit  # noqa: F401 (re-used names)


def bf16_advice(threads: int) -> str:
    """'' unless bf16 GEMMs are emulated here: a CPU without native bf16 (no AMX-BF16 or AVX512-BF16 in
    /proc/cpuinfo), or one whose bf16 kernels an ISA cap in the environment turns off (ONEDNN_MAX_CPU_ISA,
    ATEN_CPU_CAPABILITY). Then, if the measured bf16 GEMM (bounded, cached) is slower than fp32, one line with
    both rates and the advice to train in fp32. Emulated bf16 ran at 1.2 GFLOP/s against 69-83 in fp32 on a
    2-core AVX2 machine (issue 27)."""
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


def peak_mem_bytes(device: torch.device) -> int:
    """CUDA max allocated, or this process's peak RSS on CPU."""
    if device.type == "cuda":  # the run's peak, across the resets of PeakTensorBytes
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return int(max(torch.cuda.max_memory_allocated(device), _CUDA_PEAK_BEFORE_RESET.get(idx, 0)))
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


# --- memory that means something per layout: live tensors, not the process's RSS ------------------------------
def storage_key(storage) -> int:
    """Identity of a storage while it lives: its StorageImpl, which views share. data_ptr() would do on a real
    device, but is 0 for every meta and fake tensor (`nanotitan plan --dry-run` counts those)."""
    return storage._cdata


def _storages_bytes(tensors, seen: set) -> int:
    """Bytes of the distinct storages behind `tensors` that are not in `seen` yet (then added to it)."""
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 DTensor: this rank's shard
        storage = t.untyped_storage()
        key = storage_key(storage)
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
        # CUDA backward frees handles on autograd's device threads. Re-entrant: a garbage collection that starts
        # inside _add (it allocates) may free a handle on this very thread, whose __del__ then calls _add again.
        self.lock = threading.RLock()
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
        key = storage_key(storage)
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


# --- the high-water mark of live tensor bytes during a step (or a save, a load) ------------------------------
# The peak, not the steady state, decides whether a layout fits (issue 23). CUDA's caching allocator counts it
# (max_memory_allocated); a CPU has no such counter, and its RSS counts glibc's arenas and freed pages, so on
# CPU the tensors themselves are counted.
_CUDA_PEAK_BEFORE_RESET: dict[int, int] = {}  # device index -> max_memory_allocated before a step meter reset it


class PeakTensorBytes:
    """High-water mark of this rank's live tensor bytes while active: parameters, gradients, optimizer state,
    activations, communication buffers, each storage once.

        meter = PeakTensorBytes(device)
        with meter:                      # around a whole step (or a checkpoint save or load)
            ...
        meter.start, meter.peak          # bytes live on entry, and the most live at any moment inside

    CUDA: the caching allocator's own counters (`memory_allocated`, `max_memory_allocated`, reset on entry;
    `peak_mem_bytes` still reports the run's peak). CPU: `_TensorCounter` counts storages as they are created,
    resized and freed. Its cost is a Python call per op (~10% of a step on the MID model) plus a scan of the
    garbage collector's objects on entry (~40 ms): run it on metered steps only, as SavedActivations.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.start = self.peak = 0
        self._counter: _TensorCounter | None = None

    def __enter__(self):
        if self.device.type == "cuda":
            idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
            before = torch.cuda.max_memory_allocated(idx)
            _CUDA_PEAK_BEFORE_RESET[idx] = max(_CUDA_PEAK_BEFORE_RESET.get(idx, 0), before)
            torch.cuda.reset_peak_memory_stats(idx)
            self.start = int(torch.cuda.memory_allocated(idx))
        else:
            self._counter = _TensorCounter().__enter__()
            self.start = self._counter.current
        return self

    def __exit__(self, *exc):
        if self._counter is not None:
            self._counter.__exit__(*exc)
            self.peak, self._counter = self._counter.peak, None
        else:
            self.peak = int(torch.cuda.max_memory_allocated(self.device))

    def live(self) -> int:
        """Bytes live right now (inside the `with`)."""
        if self._counter is not None:
            return self._counter.current
        return int(torch.cuda.memory_allocated(self.device))


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_PLAIN_TENSOR_SET = frozenset(_PLAIN_TENSOR_TYPES)


class _TensorCounter:
    """Live tensor bytes on CPU, counted storage by storage (`PeakTensorBytes`).

    On entry: every storage Python can reach (the garbage collector's plain tensors and parameters, and each
    leaf's .grad, which autograd may have created without a Python object). While active: every storage an op
    returns (a TorchDispatchMode sees each op's outputs; a tensor subclass such as FSDP2's DTensor is let through
    to its own dispatch, whose ops on local tensors are then seen) and every `UntypedStorage.resize_` (FSDP2 frees
    and re-allocates its gathered parameters by resizing their storage, which no op dispatch shows). A storage
    leaves the count when it is freed (a weak reference's callback: the storage's Python object lives exactly as
    long as the storage). Ops whose output aliases an input (views, in-place ops) are skipped. Not seen: memory a
    backend allocates outside torch's ops (gloo's scratch), and tensors only C++ holds on entry (none between
    steps: autograd's graph is gone).
    """

    def __init__(self, device_type: str = ""):
        self.device_type = device_type  # count only storages on this kind of device ("": all)
        self.live: dict[int, list] = {}  # id(storage) -> [bytes counted, a weak reference that uncounts it when freed]
        self.current = self.peak = 0
        # A storage may be freed on gloo's or autograd's threads. Re-entrant: a garbage collection that starts inside
        # track_storage (it allocates) may free a storage on this very thread, whose callback then takes the lock
        # again.
        self.lock = threading.RLock()
        self.mode = _CountOps(self)
        self._resize = None

    def __enter__(self):
        import gc

        # The tensors among the collector's objects, picked in C (map/compress): a Python loop over the ~300k
        # objects of a rank was most of a metered step's extra CPU (the default 8-rank job, every 100th step).
        objs = gc.get_objects()
        tensors = list(itertools.compress(objs, map(_PLAIN_TENSOR_SET.__contains__, map(type, objs))))
        del objs
        with torch.no_grad():
            for obj in tensors:
                self.track(obj)
                if obj.is_leaf and obj.requires_grad and obj.grad is not None:
                    self.track(obj.grad)
        self.peak = self.current
        counter, self._resize = self, vars(torch.UntypedStorage).get("resize_")
        resize = torch.UntypedStorage.resize_

        def counted_resize_(storage, size):
            out = resize(storage, size)
            if not counter.device_type or storage.device.type == counter.device_type:
                counter.track_storage(storage)
            return out

        torch.UntypedStorage.resize_ = counted_resize_
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        if self._resize is None:
            del torch.UntypedStorage.resize_
        else:
            torch.UntypedStorage.resize_ = self._resize
        with self.lock:
            self.live.clear()  # drops the weak references, and with them their callbacks

    def track(self, t: torch.Tensor) -> None:
        dev = t.device.type
        if dev == "meta" or self.device_type and dev != self.device_type:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # no storage of its own (a wrapper subclass)
            return
        self.track_storage(storage)

    def track_storage(self, storage) -> None:
        """Count `storage` at its current size (again, if it was resized since it was counted)."""
        n = storage.nbytes()
        with self.lock:
            key = id(storage)
            entry = self.live.get(key)
            if entry is None:
                self.live[key] = [n, weakref.ref(storage, lambda _, key=key: self._free(key))]
                self.current += n
            elif entry[0] != n:
                self.current += n - entry[0]
                entry[0] = n
            else:
                return
            self.peak = max(self.peak, self.current)

    def _free(self, key: int) -> None:
        with self.lock:
            entry = self.live.pop(key, None)
            if entry is not None:
                self.current -= entry[0]


_ALIASES: dict = {}  # op -> every output aliases an input (from its schema)


class _CountOps(TorchDispatchMode):
    """Hands every plain tensor an op returns to a `_TensorCounter`."""

    def __init__(self, counter: _TensorCounter):
        super().__init__()
        self.counter = counter

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing here is compiled: spare every op torch's dynamo-disabling wrapper (half the cost)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _PLAIN_TENSOR_SET.issuperset(types):
            dtensor = sys.modules.get("torch.distributed.tensor")  # imported wherever a DTensor exists
            if dtensor is not None and any(issubclass(t, dtensor.DTensor) for t in types):
                return NotImplemented  # DTensor dispatches itself; the ops on its local tensors come back here
            return func(*args, **(kwargs or {}))  # FakeTensor (DTensor's shape propagation): no memory
        out = func(*args, **(kwargs or {}))
        aliases = _ALIASES.get(func)
        if aliases is None:
            aliases = _ALIASES[func] = all(r.alias_info is not None for r in func._schema.returns)
        if aliases:  # a view or an in-place op: its storage is an input's, counted (or not ours) already
            return out
        if isinstance(out, torch.Tensor):  # most ops: one tensor (pytree's general flatten costs more than the op)
            self.counter.track(out)
        elif isinstance(out, (tuple, list)):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.counter.track(t)
        return out


class StepMeters:
    """The memory meters, on some of the steps that are logged (each costs a Python call per tensor or op, so the
    other steps run unmetered): `step_peak`, the high-water mark of every live tensor over the whole step
    (PeakTensorBytes), and `saved_acts`, the bytes autograd keeps for backward (SavedActivations).

        with meters.step(logged) as metered:    # around the whole step
            with meters.activations(metered):   # around the forwards and backwards
                ...
        meters.act_peak_bytes, meters.peak_tensor_bytes      # over the run
        meters.take_interval_peak(), take_interval_acts()    # since the previous record (then reset; None: none)

    Both run on the 1st and every `peak_every`-th logged step (run.peak_every): a step's peaks vary little from step
    to step, and a metered step costs much more than a plain one (the default 8-rank job: saved activations alone
    +10 ms of CPU per rank, ~17%; the step peak more, with its scan of the garbage collector's objects).
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, peak_every: int = 1):
        self.saved_acts = SavedActivations(model)
        self.step_peak = PeakTensorBytes(device)
        self.peak_every, self._logged = peak_every, 0  # metered: the 1st and every peak_every-th logged step
        self.act_peak_bytes = self.peak_tensor_bytes = 0
        self._interval_peak = self._interval_acts = None  # since the last record; None: no metered step (every rank alike)

    @contextlib.contextmanager
    def step(self, logged: bool):
        """Around a whole step; yields whether it is metered."""
        if logged:
            self._logged += 1
        if not logged or (self._logged - 1) % self.peak_every:
            yield False
            return
        with self.step_peak:
            yield True
        self._interval_peak = max(self._interval_peak or 0, self.step_peak.peak)
        self.peak_tensor_bytes = max(self.peak_tensor_bytes, self.step_peak.peak)

    @contextlib.contextmanager
    def activations(self, metered: bool):
        if not metered:
            yield
            return
        self.saved_acts.reset_peak()
        with self.saved_acts:
            yield
        self._interval_acts = max(self._interval_acts or 0, self.saved_acts.peak_bytes)
        self.act_peak_bytes = max(self.act_peak_bytes, self.saved_acts.peak_bytes)

    def take_interval_acts(self) -> int | None:
        acts, self._interval_acts = self._interval_acts, None
        return acts

    def take_interval_peak(self) -> int | None:
        peak, self._interval_peak = self._interval_peak, None
        return peak
