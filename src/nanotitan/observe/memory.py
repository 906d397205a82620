"""Memory that means something per layout: the bytes of live tensors, not the process's RSS.

- `live_tensor_bytes`: what a rank holds between steps (parameters, gradients, optimizer state).
- `SavedActivations`: the bytes autograd keeps for backward, live and peak.
- `PeakTensorBytes`: the high-water mark of every live tensor over a step (or a save, a load); `peak_mem_bytes`:
  the process's peak (CUDA max allocated, RSS on CPU).
- `HeapInUse`: glibc's in-use heap over the same span, the allocator-level check of the CPU count.
- `StepMeters`: the trainer's meters, on the steps it meters.

Every figure counts a storage once (views share their storage) at its current size: FSDP2 frees its gathered
parameters by resizing their storage to 0 and re-gathers into the same storage (`storage.resize_(n)`), which no op
dispatch shows, so the meters watch `UntypedStorage.resize_` while active (`watch_resizes`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import itertools
import resource
import sys
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .host_syncs import HostSyncs


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


# --- storage resizes: how FSDP2 frees and re-gathers its parameters -------------------------------------------
_RESIZE_WATCHERS: list = []  # callables given each storage that UntypedStorage.resize_ resized
_RESIZE_OWN: list = []  # the class's own resize_ before the patch (None: the C base class's, inherited)
_RESIZE_LOCK = threading.Lock()


def watch_resizes(watcher) -> None:
    """From now until `unwatch_resizes(watcher)`: watcher(storage) after every `UntypedStorage.resize_`. One
    patch of the class serves every watcher; the last one out restores it."""
    with _RESIZE_LOCK:
        if not _RESIZE_WATCHERS:
            _RESIZE_OWN.append(vars(torch.UntypedStorage).get("resize_"))
            resize = torch.UntypedStorage.resize_

            def watched_resize_(storage, size):
                out = resize(storage, size)
                for w in tuple(_RESIZE_WATCHERS):
                    w(storage)
                return out

            torch.UntypedStorage.resize_ = watched_resize_
        _RESIZE_WATCHERS.append(watcher)


def unwatch_resizes(watcher) -> None:
    with _RESIZE_LOCK:
        _RESIZE_WATCHERS.remove(watcher)
        if not _RESIZE_WATCHERS:
            own = _RESIZE_OWN.pop()
            if own is None:
                del torch.UntypedStorage.resize_
            else:
                torch.UntypedStorage.resize_ = own


# --- the activations autograd keeps for backward ---------------------------------------------------------------
class SavedActivations:
    """Bytes of the tensors autograd keeps for backward (the activations a schedule holds), live and peak.

        meter = SavedActivations(model)        # parameters are not activations: never counted
        with meter:                            # around forward and backward of a step
            ...
        meter.peak_bytes; meter.reset_peak()   # per step

    A `saved_tensors_hooks` pair wraps each saved tensor in a handle that counts its storage while autograd
    holds it, once per storage however many ops save it, at the storage's current size (a saved storage that is
    resized is recounted); backward frees the handles as it consumes them. Parameters are told apart by storage
    (the model's tensors when the meter is made: under ZeRO and FSDP2 this rank's shards) and by type (an
    nn.Parameter or a view of one: FSDP2's gathered parameters, which live only between its all-gather and its
    `resize_(0)`, whatever autograd saved). Under activation checkpointing, what a block recomputes during its own
    backward is not counted.
    """

    def __init__(self, model: torch.nn.Module | None = None):
        self.params = set()
        _storages_bytes(model.parameters() if model is not None else [], self.params)
        self.live: dict = {}  # storage key -> [handles alive, bytes counted]
        self.bytes = self.peak_bytes = 0
        # CUDA backward frees handles on autograd's device threads. Re-entrant: a garbage collection that starts
        # inside _add (it allocates) may free a handle on this very thread, whose __del__ then calls _add again.
        self.lock = threading.RLock()
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack_saved)

    def reset_peak(self):
        self.peak_bytes = self.bytes

    def __enter__(self):
        watch_resizes(self._resized)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        unwatch_resizes(self._resized)

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return t
        storage = t.untyped_storage()
        key = storage_key(storage)
        if key in self.params:
            return t
        # detach(): an op's saved output would otherwise hold its own grad_fn, a cycle gc cannot see (a node
        # that backward never runs, e.g. an unused z-loss, would then never free its tensors)
        return _SavedTensor(self, t.detach(), key, storage.nbytes())

    def _add(self, key, nbytes: int, sign: int):
        """One handle more (sign +1, the storage now `nbytes`) or fewer (-1) on the storage `key`."""
        with self.lock:
            entry = self.live.get(key)
            if entry is None and sign > 0:
                self.live[key] = [1, nbytes]
                self.bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.bytes)
                return
            entry[0] += sign
            if entry[0] == 0:
                del self.live[key]
                self.bytes -= entry[1]

    def _resized(self, storage) -> None:
        with self.lock:
            entry = self.live.get(storage_key(storage))
            if entry is not None:
                n = storage.nbytes()
                self.bytes += n - entry[1]
                entry[1] = n
                self.peak_bytes = max(self.peak_bytes, self.bytes)


class _SavedTensor:
    """What autograd stores instead of a saved tensor: the tensor, counted until autograd drops it."""
    __slots__ = ("key", "meter", "t")

    def __init__(self, meter: SavedActivations, t: torch.Tensor, key, nbytes: int):
        self.meter, self.t, self.key = meter, t, key
        meter._add(key, nbytes, +1)

    def __del__(self):
        self.meter._add(self.key, 0, -1)


def _unpack_saved(saved):
    return saved.t if isinstance(saved, _SavedTensor) else saved


# --- the high-water mark of live tensor bytes during a step (or a save, a load) ------------------------------
# The peak, not the steady state, decides whether a layout fits. CUDA's caching allocator counts it
# (max_memory_allocated); a CPU has no such counter, and its RSS counts glibc's arenas and freed pages, so on
# CPU the tensors themselves are counted.
_CUDA_PEAK_BEFORE_RESET: dict[int, int] = {}  # device index -> max_memory_allocated before a step meter reset it


def peak_mem_bytes(device: torch.device) -> int:
    """CUDA max allocated, or this process's peak RSS on CPU."""
    if device.type == "cuda":  # the run's peak, across the resets of PeakTensorBytes
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return int(max(torch.cuda.max_memory_allocated(device), _CUDA_PEAK_BEFORE_RESET.get(idx, 0)))
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kb * (1 if sys.platform == "darwin" else 1024))


class PeakTensorBytes:
    """High-water mark of this rank's live tensor bytes while active: parameters, gradients, optimizer state,
    activations, communication buffers, each storage once.

        meter = PeakTensorBytes(device)
        with meter:                      # around a whole step (or a checkpoint save or load)
            ...
        meter.start, meter.peak          # bytes live on entry, and the most live at any moment inside

    CUDA: the caching allocator's own counters (`memory_allocated`, `max_memory_allocated`, reset on entry;
    `peak_mem_bytes` still reports the run's peak). CPU: `_TensorCounter` counts storages as they are created,
    resized and freed (checked against glibc's heap by `HeapInUse`, tests/observe/test_meters.py). Its cost is a Python
    call per op (~10% of a step on the MID model) plus a scan of the garbage collector's objects on entry
    (~40 ms): run it on metered steps only, as SavedActivations.
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

    def peak_so_far(self) -> int:
        """The most bytes live at any moment so far (inside the `with`)."""
        if self._counter is not None:
            return self._counter.peak
        return int(torch.cuda.max_memory_allocated(self.device))

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
    long as the storage). Ops whose output aliases an input (views, in-place ops) are skipped, and so are meta
    storages: a FakeTensor says it is on the CPU, but its storage is meta (DTensor's sharding propagation makes
    fake arguments of the global shapes on a step's first call of each op: 4x the parameters at AdamW's first
    step). Not seen: memory a backend allocates outside torch's ops (gloo's scratch), and tensors only C++ holds
    on entry (none between steps: autograd's graph is gone).
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

    def __enter__(self):
        self._track_reachable()  # in a call of its own: no local of the scan keeps a tensor alive into the window
        watch_resizes(self.track_storage)
        self.mode.__enter__()
        # The baseline once the window is open: opening it allocates, and a garbage collection there may free
        # storages the scan counted (an earlier step's cycles); a peak taken before it would report them as the step's.
        with self.lock:
            self.peak = self.current
        return self

    def _track_reachable(self) -> None:
        """Count every storage the collector knows of: its plain tensors (cyclic garbage too) and each leaf's .grad."""
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

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        with self.lock:
            unwatch_resizes(self.track_storage)  # no resize counted after this
            self.live.clear()  # drops the weak references, and with them their callbacks

    def track(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # no storage of its own (a wrapper subclass)
            return
        self.track_storage(storage)

    def track_storage(self, storage) -> None:
        """Count `storage` at its current size (again, if it was resized since it was counted)."""
        dev = storage.device.type
        if dev == "meta" or self.device_type and dev != self.device_type:
            return
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
            return _subclass_op(func, types, args, kwargs)
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


def _subclass_op(func, types, args, kwargs):
    """An op on a tensor subclass, under a dispatch mode that counts plain tensors: a DTensor dispatches itself (its
    ops on local tensors come back to the mode); anything else (FakeTensor: DTensor's shape propagation) has no
    memory of ours and just runs."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # imported wherever a DTensor exists
    if dtensor is not None and any(issubclass(t, dtensor.DTensor) for t in types):
        return NotImplemented
    return func(*args, **(kwargs or {}))


# --- the allocator's figure: glibc's heap in use --------------------------------------------------------------
class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_MALLINFO2: list = []  # [glibc's mallinfo2, or None where there is none]


def heap_in_use() -> int | None:
    """Bytes glibc's malloc has handed out and not taken back (mallinfo2: `uordblks`, in its arenas, plus `hblkhd`,
    mmapped blocks); None without glibc 2.33+. Torch's CPU tensors are malloc'd (posix_memalign)."""
    if not _MALLINFO2:
        fn = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            fn = libc.mallinfo2
            fn.restype, fn.argtypes = _MallInfo2, []
        except (OSError, AttributeError):
            fn = None
        _MALLINFO2.append(fn)
    fn = _MALLINFO2[0]
    if fn is None:
        return None
    info = fn()
    return int(info.uordblks + info.hblkhd)


class HeapInUse(TorchDispatchMode):
    """glibc's in-use heap (`heap_in_use`), sampled after every op and every storage resize while active: the
    allocator-level figure beside `PeakTensorBytes`' count on CPU.

        with HeapInUse() as heap:        # around a step
            ...
        heap.start, heap.peak            # in-use bytes on entry, and the most seen inside (0, 0 without glibc)

    The heap also holds what is no tensor (torch's and Python's larger objects, gloo's buffers), so its rise,
    `peak - start`, is what compares with the tensor count's. Sampled where the count moves: a kernel's scratch,
    freed before the op returns, is in neither; gloo's, allocated on its own threads, only when a sample falls
    inside a collective.
    """

    def __init__(self):
        super().__init__()
        self.start = self.peak = 0

    def __enter__(self):
        self.start = self.peak = heap_in_use() or 0
        watch_resizes(self.sample)
        return super().__enter__()

    def __exit__(self, *exc):
        unwatch_resizes(self.sample)
        self.sample()
        return super().__exit__(*exc)

    def sample(self, *_) -> None:
        self.peak = max(self.peak, heap_in_use() or 0)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _PLAIN_TENSOR_SET.issuperset(types):
            return _subclass_op(func, types, args, kwargs)
        out = func(*args, **(kwargs or {}))
        self.sample()
        return out


# --- the trainer's meters ---------------------------------------------------------------------------------------
_UNMETERED = contextlib.nullcontext(False)  # reusable: `with` it yields False (not metered) and does nothing


class StepMeters:
    """The memory meters, on some steps (each costs a Python call per tensor or op, so the other steps run
    unmetered): `step_peak`, the high-water mark of every live tensor over the whole step (PeakTensorBytes), and
    `saved_acts`, the bytes autograd keeps for backward (SavedActivations).

        with meters.step(logged) as metered:    # around the whole step
            with meters.activations(metered):   # around the forwards and backwards
                ...
        meters.act_peak_bytes, meters.peak_tensor_bytes      # over the run
        meters.take_interval_peak(), take_interval_acts()    # since the previous record (then reset; None: none);
                                                             # inside a step, its peak so far counts with this record

    Metered: the process's first two steps (under train.compile the 2nd and 3rd), and the 1st and every `peak_every`-th
    logged step (run.peak_every; 0: none, for runs that only need the numbers, such as `nanotitan verify`'s): a
    step's peaks vary little from step to step, and a metered step costs much more than a plain one (the default
    8-rank job: saved activations alone +10 ms of CPU per rank, ~17%; the step peak more, with its scan of the garbage
    collector's objects). The second step is the first steady one: the first makes AdamW's
    moments only in its update, after the activations are freed (on MID at DP4, zero 0: 300 MiB against 420 MiB every
    later step), and FSDP2 initialises itself in it.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, peak_every: int = 1, compiled: bool = False):
        # train.compile: dynamo runs no compiled code under a dispatch mode (the step peak's), so the first step,
        # which compiles the blocks, is never metered, and metered steps run the blocks eagerly (parallel/compile.py)
        self.compiled = compiled
        self.saved_acts = SavedActivations(model)
        self.step_peak = PeakTensorBytes(device)
        self.device = device
        self.peak_every, self._logged, self._steps = peak_every, 0, 0
        self.act_peak_bytes = self.peak_tensor_bytes = 0
        # since the last record; None: no metered step (on every rank alike)
        self._interval_peak = self._interval_acts = self._interval_syncs = None
        self._inside = self._taken = False  # in a metered step; its peak taken (so far) by a record

    def step(self, logged: bool):
        """Around a whole step; its context yields whether it is metered (an unmetered step: a shared no-op
        context, no generator: every step enters it)."""
        self._steps += 1
        if logged:
            self._logged += 1
        if not self.peak_every or (self.compiled and self._steps == 1) or \
                (self._steps > 2 + self.compiled and (not logged or (self._logged - 1) % self.peak_every)):
            return _UNMETERED
        return self._metered_step()

    @contextlib.contextmanager
    def _metered_step(self):
        self._inside, self._taken = True, False
        try:
            with self.step_peak, torch.compiler.set_stance("force_eager") if self.compiled else \
                    contextlib.nullcontext():
                yield True
        finally:
            self._inside = False
        if not self._taken:  # a record taken inside the step counted it already
            self._interval_peak = max(self._interval_peak or 0, self.step_peak.peak)
        self.peak_tensor_bytes = max(self.peak_tensor_bytes, self.step_peak.peak)

    def host_syncs(self, metered: bool):
        """Around the step proper (train.py `_step`): its host reads counted on a metered step (host_syncs.py)."""
        return self._metered_syncs() if metered else _UNMETERED

    @contextlib.contextmanager
    def _metered_syncs(self):
        meter = HostSyncs(self.device)
        with meter:
            yield
        self._interval_syncs = meter.count  # the interval's latest metered step

    def take_interval_syncs(self) -> int | None:
        """The host reads of the latest metered step since the previous record (then reset; None: none)."""
        syncs, self._interval_syncs = self._interval_syncs, None
        return syncs

    def activations(self, metered: bool):
        return self._metered_activations() if metered else _UNMETERED

    @contextlib.contextmanager
    def _metered_activations(self):
        self.saved_acts.reset_peak()
        with self.saved_acts:
            yield
        self._interval_acts = max(self._interval_acts or 0, self.saved_acts.peak_bytes)
        self.act_peak_bytes = max(self.act_peak_bytes, self.saved_acts.peak_bytes)

    def take_interval_acts(self) -> int | None:
        acts, self._interval_acts = self._interval_acts, None
        return acts

    def take_interval_peak(self) -> int | None:
        """The highest metered step peak since the previous record (then reset; None: none). Inside a metered step (a
        record's step, as parallel/step.py reduces its figures at its end) that step's peak so far counts, and the
        step belongs to this record, not the next."""
        peak, self._interval_peak = self._interval_peak, None
        if self._inside:
            peak, self._taken = max(peak or 0, self.step_peak.peak_so_far()), True
        return peak
