"""One thin layer for every collective and P2P, recording calls, bytes and wait time per axis.

Every call first checks that a CPU tensor is not headed for an NCCL group (`check_device`), and is entered
in this rank's stall record (`stall.RECORD`: axis, op, sequence number, peers, shapes, times) so that a hang
names the rank that stopped and the call every other rank waits in.
Axes: "dp" (gradient all-reduce), "ep" (token all-to-all), "pp" (activation send/recv),
"other" (broadcasts, norms, metrics). Wait time is the wall time the calling thread spent blocked:
the whole call for blocking ops, the `wait()` for async ones. `COMM.snapshot_and_reset()` gives the
per-step figures that go to metrics.jsonl.
With parallel.emulate (emulate.py) every call is also held until a modelled link would have delivered it: inside
its profiler label, before a blocking call returns or in an async one's wait(), so the wait columns include it.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.autograd import profiler as _profiler  # _is_profiler_enabled: read per call, a module attribute
from torch.profiler import record_function

from . import emulate
from .stall import RECORD

AXES = ("dp", "ep", "pp", "tp", "cp", "other")


class CommStats:
    def __init__(self):
        self.reset()

    def reset(self):
        self.calls = defaultdict(int)
        self.bytes = defaultdict(int)
        self.wait_s = defaultdict(float)

    def record(self, axis: str, nbytes: int, wait_s: float, calls: int = 1):
        self.calls[axis] += calls
        self.bytes[axis] += nbytes
        self.wait_s[axis] += wait_s

    def snapshot_and_reset(self) -> dict:
        out = {}
        for a in AXES:
            out[f"comm_{a}_calls"] = self.calls[a]
            out[f"comm_{a}_bytes"] = self.bytes[a]
            out[f"comm_{a}_wait_s"] = round(self.wait_s[a], 6)
        self.reset()
        return out


COMM = CommStats()


# Backends that take CPU tensors. NCCL takes only CUDA tensors: a CPU one fails deep inside NCCL, or hangs.
# "fake" (torch's FakeProcessGroup) moves nothing: `nanotitan plan --dry-run` builds ranks on it.
_CPU_BACKENDS = ("gloo", "mpi", "fake")
_BACKEND: dict[int, tuple] = {}  # id(process group) -> (a weak reference to it, its backend's name, takes CPU)


def _group_entry(group) -> tuple:
    """(weakref, backend name, takes CPU tensors) of the group, looked up once per group (dist.get_backend costs
    microseconds on every call, and a step makes dozens). Keyed by id and checked by the weak reference (a
    WeakKeyDictionary builds a weakref per lookup): a re-initialised world is a new group, its id maybe a freed
    one's."""
    pg = group if group is not None else dist.group.WORLD
    hit = _BACKEND.get(id(pg))
    if hit is not None and hit[0]() is pg:
        return hit
    name = str(dist.get_backend(group))
    # A mixed backend ("cpu:gloo,cuda:nccl") takes both.
    hit = (weakref.ref(pg) if pg is not None else lambda: None, name, any(b in name for b in _CPU_BACKENDS))
    if pg is not None:
        _BACKEND[id(pg)] = hit
    return hit


def backend(group) -> str:
    """The group's backend name (cached per group)."""
    return _group_entry(group)[1]


def check_device(t: torch.Tensor, group=None) -> torch.Tensor:
    """Refuse a CPU tensor on a collective whose backend cannot take it (a GPU job's NCCL groups), naming it.
    Only CPU tensors pay for the lookup (cached per group; read here, not through `_group_entry`: a Python call
    less on every collective of a CPU job)."""
    if not t.is_cpu:
        return t
    hit = _BACKEND.get(id(group)) if group is not None else None
    if hit is None or hit[0]() is not group:
        hit = _group_entry(group)
    if not hit[2]:
        raise RuntimeError(f"a CPU tensor {tuple(t.shape)} {t.dtype} reached a {backend(group)} collective: "
                           f"allocate it on the job's device (NCCL groups take CUDA tensors only)")
    return t


def _label(axis: str, op: str):
    """Names the call in profiler traces by axis, e.g. "EP all-to-all" (profiling.py sums time per label).
    Only while a profiler records: an unobserved record_function still costs a dispatcher op on enter and exit
    (~6 us), and a step of the default job makes dozens of calls on each of 8 ranks sharing 2 cores."""
    if _profiler._is_profiler_enabled:
        return record_function(f"{axis.upper()} {op}")
    return _NO_LABEL


_NO_LABEL = contextlib.nullcontext()  # reusable: entering it does nothing


def _enter_label(axis: str, op: str):
    """`_label` entered, for the hot paths below, which close it in their own `finally` and enter the stall record
    by hand: two context managers per call cost more than the call's record itself on a busy host (the default
    8-rank job makes ~55 calls per rank per step)."""
    label = record_function(f"{axis.upper()} {op}")
    label.__enter__()
    return label


class TimedWork:
    """Wraps an async Work so that its wait() is charged to an axis; `then` runs once it has landed."""

    def __init__(self, work, axis: str, ticket: int = 0, done_by: float = 0.0, then=None):
        self.work, self.axis, self.ticket = work, axis, ticket  # ticket: its stall-record entry (0: none)
        self.done_by = done_by  # parallel.emulate: when the modelled link delivers it (0.0: not emulated)
        self.then = then

    def wait(self):
        t0 = time.perf_counter()
        label = _enter_label(self.axis, "wait") if _profiler._is_profiler_enabled else None
        try:
            self.work.wait()
            if self.done_by:
                emulate.hold(self.done_by)
        except BaseException as e:
            if self.ticket:
                RECORD.fail(self.ticket, e)
            raise
        finally:
            if label is not None:
                label.__exit__(None, None, None)
        if self.then is not None:
            self.then()
            self.then = None
        if self.ticket:
            RECORD.leave(self.ticket)
        COMM.record(self.axis, 0, time.perf_counter() - t0, calls=0)


def _issue(axis: str, op: str, tensors, group, post, nbytes: int, async_op: bool, peers: str | None = None,
           calls: int = 1):
    """What every collective shares around its torch call: the stall record's entry, the profiler label, the
    emulated link's hold and the axis accounting. `post()` issues the op and returns (work, done_by)."""
    t0 = time.perf_counter()
    ticket = RECORD.enter(axis, op, tensors, group, peers)
    label = _enter_label(axis, op) if _profiler._is_profiler_enabled else None
    try:
        work, done_by = post(t0)
        if done_by and not async_op:
            emulate.hold(done_by)
    except BaseException as e:
        RECORD.fail(ticket, e)
        raise
    finally:
        if label is not None:
            label.__exit__(None, None, None)
    if not async_op:
        RECORD.leave(ticket)
    COMM.record(axis, nbytes, time.perf_counter() - t0, calls=calls)
    return TimedWork(work, axis, ticket, done_by) if async_op else None


def all_reduce(t: torch.Tensor, group=None, axis: str = "dp", op=dist.ReduceOp.SUM, async_op: bool = False):
    pg = _checked_pg(t, group)

    def post(t0):
        opts = dist.AllreduceOptions()
        opts.reduceOp, opts.asyncOp = op, async_op
        work = pg.allreduce([t], opts)  # what dist.all_reduce issues, without its wrapper's checks (`_checked_pg`)
        if not async_op:
            work.wait()
        return work, 0.0 if emulate.ACTIVE is None else emulate.collective(t0, axis, "all-reduce", t.nbytes, group)
    return _issue(axis, "all-reduce", (t,), group, post, t.nbytes, async_op)


def _checked_pg(t: torch.Tensor, group):
    """`check_device(t, group)`, then the ProcessGroup to issue on (WORLD for None), from the same cached entry.
    all_reduce and all_to_all_single call the group's own method, as torch.distributed's wrappers do after their
    checks (tensor subclasses, complex views, membership: ~25 Python calls per collective, a quarter of the
    default job's calls): comm.py's tensors are plain and real, and every caller is a member of its group."""
    hit = _BACKEND.get(id(group)) if group is not None else None
    if hit is None or hit[0]() is not group:
        hit = _group_entry(group)
    if t.is_cpu and not hit[2]:
        check_device(t, group)  # raises, naming the tensor
    return hit[0]()


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, axis: str = "dp", average: bool = False) -> TimedWork:
    """Async SUM reduce-scatter of the flat `inp` (N slices) into `out` (this rank's slice's size; it may be that
    slice of `inp` itself: in place) over `group` (ZeRO gradients); `average` divides the sum by N (ReduceOp.AVG).
    On the backends SHARDED_BY_EXCHANGE names, a direct exchange between the ranks (`_exchange_reduce_scatter`)."""
    return _async_sharded("reduce-scatter", out, inp, inp, group, axis, average)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, axis: str = "dp") -> TimedWork:
    """Async all-gather of every rank's `inp` into the flat `out` (N times its size; `inp` may be this rank's slice
    of it: in place) over `group` (ZeRO params). On the backends SHARDED_BY_EXCHANGE names, a direct exchange
    between the ranks (`_exchange_all_gather`)."""
    return _async_sharded("all-gather", out, inp, out, group, axis, False)


# Backends on which reduce_scatter and all_gather run as direct send/recv exchanges between the ranks of the
# group: gloo's own reduce-scatter and all-gather each cost about twice its (ring) all-reduce of the full buffer
# (2 ranks, 4-32 MiB, this host: all-reduce 34-38 ms, reduce-scatter 63-78, all-gather 67-70), where a ring moves
# half an all-reduce's bytes, and so do the exchanges. NCCL keeps its own collectives. (tests/parallel/test_zero.py
# empties it in its ranks so that gloo also runs the collectives NCCL runs.)
SHARDED_BY_EXCHANGE = ("gloo",)


def _async_sharded(op: str, out: torch.Tensor, inp: torch.Tensor, full: torch.Tensor, group, axis: str,
                   average: bool) -> TimedWork:
    """Launch `op` asynchronously; `full` (the unsharded side) is what is checked, recorded and counted, and the
    emulated link (if any) models the collective, whichever way it runs here."""
    check_device(full, group)
    t0 = time.perf_counter()
    then = None
    with _label(axis, op), RECORD.call(axis, op, (full,), group, done=False) as ticket:
        if backend(group) in SHARDED_BY_EXCHANGE:
            exchange = _exchange_reduce_scatter if op == "reduce-scatter" else _exchange_all_gather
            work, then = exchange(out, inp, group, average)
        elif op == "reduce-scatter":
            work = _REDUCE_SCATTER(out, inp, op=dist.ReduceOp.AVG if average else dist.ReduceOp.SUM, group=group,
                                   async_op=True)
        else:
            work = _ALL_GATHER(out, inp, group=group, async_op=True)
    COMM.record(axis, full.nbytes, time.perf_counter() - t0)
    return TimedWork(work, axis, ticket, emulate.collective(t0, axis, op, full.nbytes, group), then)


def _exchange_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, average: bool):
    """(Work, what to run once it lands) of a SUM reduce-scatter by direct exchange: each rank sends every peer that
    peer's slice of `inp` and receives its own slice from every peer into a scratch buffer; when it lands the
    peers' parts are added into this rank's slice of `inp` in rank order, then copied to `out` unless `out` is
    that slice (in place); `average` divides the sum by N (as gloo's AVG). Each rank sends and receives (N-1)·S
    elements, a ring reduce-scatter's. At N = 2 the sum has two terms: the same bits as any other reduce-scatter.
    Scratch: (N-1)·S elements until the wait (none at N = 2 with `out` apart from `inp`: the peer's part is
    received into `out`)."""
    N, r = dist.get_world_size(group), dist.get_rank(group)
    flat = inp.view(-1)
    S = flat.numel() // N
    mine = own_slice(flat, r, S)
    into_out = N == 2 and out.data_ptr() != mine.data_ptr()  # the peer's part lands in `out`: no scratch, no copy
    scratch = out.view(-1) if into_out else flat.new_empty((N - 1) * S)
    ops = []
    for i, p in enumerate(q for q in range(N) if q != r):
        ops.append(dist.P2POp(dist.isend, own_slice(flat, p, S), group=group, group_peer=p))
        ops.append(dist.P2POp(dist.irecv, scratch[i * S:(i + 1) * S], group=group, group_peer=p))

    def land() -> None:
        if into_out:
            scratch.add_(mine)  # peer + mine: two terms, the same bits as mine + peer
        else:
            for i in range(N - 1):
                mine.add_(scratch[i * S:(i + 1) * S])
            if out.data_ptr() != mine.data_ptr():
                out.view(-1).copy_(mine)
        if average:
            out.div_(N)

    return _AllOf(dist.batch_isend_irecv(ops)), land


def _exchange_all_gather(out: torch.Tensor, inp: torch.Tensor, group, average: bool = False):
    """(Work, None) of an all-gather by direct exchange: this rank's slice of the flat `out` is `inp` (copied there
    unless it is that slice already: in place), sent to every peer, and each peer's slice is received straight
    into `out`. (N-1)·S elements each way per rank, a ring's; nothing zeroed, nothing added, a copy of the bits."""
    N, r = dist.get_world_size(group), dist.get_rank(group)
    flat = out.view(-1)
    S = inp.numel()
    mine = own_slice(flat, r, S)
    if mine.data_ptr() != inp.data_ptr():
        mine.copy_(inp.view(-1))
    ops = []
    for p in range(N):
        if p != r:
            ops.append(dist.P2POp(dist.isend, mine, group=group, group_peer=p))
            ops.append(dist.P2POp(dist.irecv, own_slice(flat, p, S), group=group, group_peer=p))
    return _AllOf(dist.batch_isend_irecv(ops)), None


def own_slice(full: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s slice of n elements of the flat `full` (a view)."""
    return full.view(-1)[rank * n:(rank + 1) * n]


# torch 2.13 renamed these (the old names warn); torch 2.6 only has the old ones.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def broadcast(t: torch.Tensor, src: int, group=None, axis: str = "other"):
    check_device(t, group)
    t0 = time.perf_counter()
    with _label(axis, "broadcast"), RECORD.call(axis, "broadcast", (t,), group):
        dist.broadcast(t, src=src, group=group)
        emulate.hold(emulate.collective(t0, axis, "broadcast", t.nbytes, group))
    COMM.record(axis, t.nbytes, time.perf_counter() - t0)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None, group=None,
                      axis: str = "ep", async_op: bool = False):
    """Uneven all-to-all of rows (gloo needs `inp` contiguous). async_op: post it and return a TimedWork; neither
    buffer may be touched before its wait(). The hot path of EP (20 calls per rank-step in the default job):
    `_issue`'s work written out inline, the op issued on the ProcessGroup itself (`_checked_pg`)."""
    pg = _checked_pg(inp if inp.is_cpu else out, group)  # both checked: a CPU tensor is refused whichever it is
    inp = inp.contiguous()
    if emulate.ACTIVE is not None or _profiler._is_profiler_enabled:  # the general path: label, emulated link

        def post(t0):
            work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=async_op)
            return work, 0.0 if emulate.ACTIVE is None else emulate.all_to_all(
                t0, axis, inp.nbytes, inp.shape[0] if inp.dim() else 1, in_splits, out_splits, group)
        return _issue(axis, "all-to-all", (inp,), group, post, inp.nbytes, async_op)
    t0 = time.perf_counter()
    ticket = RECORD.enter(axis, "all-to-all", (inp,), group)
    try:
        opts = dist.AllToAllOptions()
        opts.asyncOp = async_op
        work = pg.all_to_all_single(out, inp, [] if out_splits is None else out_splits,
                                       [] if in_splits is None else in_splits, opts)
        if not async_op:
            work.wait()
    except BaseException as e:
        RECORD.fail(ticket, e)
        raise
    if not async_op:
        RECORD.leave(ticket)
    COMM.record(axis, inp.nbytes, time.perf_counter() - t0)
    return TimedWork(work, axis, ticket) if async_op else None


def send(t: torch.Tensor, dst: int, group=None, axis: str = "pp"):
    pg = _checked_pg(t, group)
    t0 = time.perf_counter()
    with _label(axis, "send"), RECORD.call(axis, "send", (t,), peers=f"to {dst}"):
        pg.send([t.contiguous()], _group_peer(group, dst), 0).wait()  # dist.send's op, without its wrapper
        if emulate.ACTIVE is not None:
            emulate.hold(emulate.p2p(t0, axis, [(dst, t.nbytes, True)]))
    COMM.record(axis, t.nbytes, time.perf_counter() - t0)


def recv(t: torch.Tensor, src: int, group=None, axis: str = "pp"):
    pg = _checked_pg(t, group)
    t0 = time.perf_counter()
    with _label(axis, "recv"), RECORD.call(axis, "recv", (t,), peers=f"from {src}"):
        pg.recv([t], _group_peer(group, src), 0).wait()  # dist.recv's op, without its wrapper
        if emulate.ACTIVE is not None:
            emulate.hold(emulate.p2p(t0, axis, [(src, t.nbytes, False)]))
    COMM.record(axis, t.nbytes, time.perf_counter() - t0)


_PEERS: dict[tuple, tuple] = {}  # (id(group), global rank) -> (a weak reference to the group, the rank in it)


def _group_peer(group, rank: int) -> int:
    """`rank` (global) as a rank of `group` (None: the world), cached per group as `_group_entry` caches."""
    if group is None:
        return rank
    hit = _PEERS.get((id(group), rank))
    if hit is None or hit[0]() is not group:
        hit = _PEERS[(id(group), rank)] = (weakref.ref(group), dist.get_group_rank(group, rank))
    return hit[1]


def batch_isend_irecv(ops: list, axis: str = "pp", async_op: bool = False):
    """Issue paired P2P ops together and wait for all of them (no blocking pair can deadlock). async_op: post
    them and return a TimedWork whose wait() completes them all (the caller computes meanwhile); the caller
    keeps the tensors alive until then. CPU tensors (gloo, which does not coalesce) are posted op by op on their
    group as dist.batch_isend_irecv posts them (its isend/irecv, without their wrappers); device tensors go through
    dist.batch_isend_irecv, which coalesces them on NCCL."""
    for op in ops:
        _checked_pg(op.tensor, op.group)
    peers = ", ".join(f"{'to' if op.op is dist.isend else 'from'} {op.peer}" for op in ops)

    def post(t0):
        if not ops[0].tensor.is_cpu:  # a device backend (NCCL): torch coalesces the batch
            works = dist.batch_isend_irecv(ops)
        else:
            works = [_p2p_pg(op).send([op.tensor], op.group_peer, op.tag) if op.op is dist.isend else
                     _p2p_pg(op).recv([op.tensor], op.group_peer, op.tag) for op in ops]
        if not async_op:
            for w in works:
                w.wait()
        return _AllOf(works), 0.0 if emulate.ACTIVE is None else \
            emulate.p2p(t0, axis, [(op.peer, op.tensor.nbytes, op.op is dist.isend) for op in ops])
    return _issue(axis, "send/recv", [op.tensor for op in ops], None, post,
                  sum(op.tensor.nbytes for op in ops), async_op, peers=peers, calls=len(ops))


def _p2p_pg(op):
    return op.group if op.group is not None else dist.group.WORLD


class _AllOf:
    """The Works of one batch_isend_irecv, waited for as one."""

    def __init__(self, works: list):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()


# --- agreement over the default group: every rank reaches the same decision before anyone acts -------------
# (checkpoints, manifests and the launcher's rank-local checks use these, so that a failure one rank sees
# never leaves the others inside a collective)

_LINE_BYTES = 4096  # an agreed error line, broadcast from the rank that has it


def distributed() -> bool:
    """A default process group exists (a job of one process has none)."""
    return dist.is_available() and dist.is_initialized()


def world_rank() -> int:
    """This process's rank in the default group (0 without one)."""
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    """Ranks in the default group (1 without one)."""
    return dist.get_world_size() if distributed() else 1


def collective_device() -> torch.device:
    """Where collective buffers live: CUDA on NCCL, CPU on gloo."""
    if distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_rows(row: list[float]) -> list[list[float]]:
    """Every rank's `row` (an all-gather as an all-reduce of a [world, k] float64 tensor holding only this
    rank's row, so that it goes through comm.py on gloo and NCCL alike). Collective."""
    if not distributed():
        return [list(row)]
    t = torch.zeros(world_size(), len(row), dtype=torch.float64, device=collective_device())
    t[world_rank()] = torch.tensor(row, dtype=torch.float64)
    all_reduce(t, axis="other")
    return t.tolist()


def barrier() -> None:
    """Barrier over the default group as a one-element all-reduce (works on gloo, and on NCCL with a
    CUDA tensor; `dist.barrier` on NCCL guesses a device), accounted under the "other" axis."""
    if distributed():
        all_reduce(torch.zeros(1, device=collective_device()), axis="other")


def any_rank(flag: bool) -> int:
    """Lowest rank for which `flag` is true (-1 when none); collective over the default group."""
    bad = [r for r, (f,) in enumerate(all_rows([float(flag)])) if f]
    return bad[0] if bad else -1


def agree(err: str, what: str) -> str:
    """Collective: '' when no rank has an error; else the first failing rank's own line, on every rank (the
    launcher shows the line of whichever rank reports first, so each must say what happened)."""
    bad = any_rank(bool(err))
    if bad < 0 or not distributed():
        return "" if bad < 0 else err
    buf = torch.zeros(_LINE_BYTES, dtype=torch.uint8)
    if world_rank() == bad:
        raw = err.encode()[:_LINE_BYTES]
        buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    buf = buf.to(collective_device())
    broadcast(buf, src=bad)
    line = bytes(buf.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
    return line or f"{what} failed on rank {bad} (see its error)"
