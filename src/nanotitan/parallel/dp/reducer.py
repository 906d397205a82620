"""Data parallelism: the bucketed gradient Reducer (seed, DP section) and the torch DDP baseline.

ZeRO-1/2 (sharded buckets) is zero.py, ZeRO-3 fsdp.py; sync.py puts each behind one protocol.

Contract of every implementation here: after `finish()`, each parameter's `.grad` equals
`scale * SUM over the group of the local .grad` (group None = this rank alone: only the scale).
The trainer passes `scale = 1/(DP*EP)` and the parameter's group (non-expert-DP for replicated
params, expert-DP for expert shards), which gives docs/design.md §4's averages.

How the Reducer gets communication out of the way of compute:
- Gradient-as-bucket-view: each param's `.grad` is a view into one flat buffer per bucket,
  allocated once. Autograd accumulates into an existing `.grad` in place, so microbatches
  accumulate straight into the buffer and the all-reduce needs no copy in or out.
- Buckets are filled in reverse registration order (roughly the order backward produces
  gradients). A post-accumulate-grad hook marks each param ready on the final microbatch; a
  bucket's async all-reduce starts as soon as it is full and every earlier bucket has started,
  so all ranks issue collectives in the same order even if one rank's params finish in another.
- The scale is applied to the flat buffer just before its all-reduce (one pass over memory that
  the collective is about to read anyway), never in a separate pass after the wait.
- `reduce_dtype` (parallel.reduce_dtype=bf16): the scaled fp32 bucket is narrowed to a bf16 copy, that copy
  is reduced (half the bytes; the sum rounds to bf16) and widened back into the fp32 bucket at wait().
- `skip_rows`: rows (dim 0) of named params left out of the all-reduce (still scaled): expert placement's empty
  slots (zero gradient) and replicated copies, which parallel/rebalance.py reduces itself. A bucket with skipped
  rows all-reduces a packed copy of the rest and copies it back at wait().
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ...model.wgrad import accumulate_into, set_grad_sink
from ..comm import collectives as comm


@dataclass
class Bucket:
    """One flat gradient buffer and the params whose .grad are views into it (ZeRO-1/2 extend it: zero.py)."""

    flat: torch.Tensor  # the one buffer the grads of `params` are views into
    params: list[nn.Parameter]
    views: list[torch.Tensor]  # views[i] is params[i].grad
    pending: int = 0  # params not yet ready in this step's final microbatch
    work: comm.TimedWork | None = None
    launched: bool = False
    names: list[str] = field(default_factory=list)
    runs: list[tuple[int, int]] | None = None  # `skip_rows`: the [a, b) ranges of flat reduced; None: all of it


def bucket_bytes(bucket_mb: float) -> float:
    """The most gradient bytes one bucket holds (parallel.bucket_mb MiB): the one sizing rule of the Reducer's and
    ZeRO-1/2's buckets (their params are packed up to it), which the planner's memory model reads too."""
    if bucket_mb <= 0:
        raise ValueError(f"parallel.bucket_mb={bucket_mb} must be > 0 (--parallel.bucket_mb)")
    return bucket_mb * 2**20


def _plan_buckets(named_params, cap_bytes: float, kind) -> list[list[tuple[str, nn.Parameter]]]:
    """Trainable params in reverse registration order (roughly the order backward produces their
    gradients), packed into buckets of at most `cap_bytes`, one open bucket per `kind(p)`; buckets are
    ordered by their last param, i.e. by when backward should fill them. A tied param is listed once."""
    seen, ordered = set(), []
    for name, p in named_params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            ordered.append((name, p))
    plan: list[list[tuple[str, nn.Parameter]]] = []
    size, last, open_bucket = [], [], {}
    for pos, (name, p) in enumerate(reversed(ordered)):
        nbytes = p.numel() * p.element_size()
        i = open_bucket.get(kind(p))
        if i is None or size[i] + nbytes > cap_bytes:
            i = open_bucket[kind(p)] = len(plan)
            plan.append([])
            size.append(0)
            last.append(pos)
        plan[i].append((name, p))
        size[i] += nbytes
        last[i] = pos
    return [plan[i] for i in sorted(range(len(plan)), key=last.__getitem__)]


class Reducer:
    """Bucketed, overlapped SUM all-reduce of gradients over `group`, scaled by `scale`.

    Per step: `prepare(sync=False)` before each non-final microbatch's backward,
    `prepare(sync=True)` before the final one, then `finish()`; `zero_grad()` before the next step
    (it replaces `optimizer.zero_grad()`, which must not set grads to None).
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], group, bucket_mb: float, scale: float,
                 reduce_dtype: torch.dtype | None = None):
        cap = bucket_bytes(bucket_mb)
        self.group, self.scale = group, float(scale)
        self.reduce_dtype = reduce_dtype  # None: reduce in the gradients' own dtype (fp32)
        self.buckets: list[Bucket] = []
        self._sync = False
        self._next_launch = 0  # index of the first bucket whose all-reduce has not started
        for entries in _plan_buckets(named_params, cap, self._bucket_kind):
            self.buckets.append(self._make_bucket(entries))
        for bi, b in enumerate(self.buckets):
            for pi, p in enumerate(b.params):
                hook = self._make_hook(bi, pi)
                p.register_post_accumulate_grad_hook(hook)
                set_grad_sink(p, self._make_sink(b, hook))  # a deferred weight gradient (model/wgrad.py) lands here

    @staticmethod
    def _bucket_kind(p: nn.Parameter) -> tuple:
        """Params of one bucket share this (one flat buffer has one dtype and device)."""
        return p.dtype, p.device

    def _make_bucket(self, entries: list[tuple[str, nn.Parameter]]) -> Bucket:
        p0 = entries[0][1]
        flat = torch.zeros(sum(p.numel() for _, p in entries), dtype=p0.dtype, device=p0.device)
        b = Bucket(flat=flat, params=[p for _, p in entries], views=[], names=[n for n, _ in entries])
        offset = 0
        for _, p in entries:
            view = flat[offset:offset + p.numel()].view_as(p)
            if p.grad is not None:  # keep what was accumulated before the Reducer existed
                view.copy_(p.grad)
            p.grad = view
            b.views.append(view)
            offset += p.numel()
        return b

    def _make_hook(self, bi: int, pi: int):
        b = self.buckets[bi]
        name = b.names[pi]

        def hook(p: nn.Parameter) -> None:
            if not self._sync:
                return  # gradient accumulation: keep summing locally, no communication
            if b.launched:
                raise RuntimeError(
                    f"{name} received a gradient after its bucket's all-reduce started: the final "
                    f"microbatch must run a single backward (combine losses before .backward())")
            b.pending -= 1
            if b.pending == 0:
                self._launch_ready()

        return hook

    def _make_sink(self, b: Bucket, hook):
        """A gradient term computed outside autograd (zb1's deferred weight GEMMs, model/wgrad.py): accumulate it
        as AccumulateGrad would, then count the param ready as the post-accumulate hook would."""

        def sink(p: nn.Parameter, g: torch.Tensor) -> None:
            self._before_accumulate(b)
            accumulate_into(p, g)
            hook(p)

        return sink

    def _before_accumulate(self, b: Bucket) -> None:
        pass  # the bucket's views are bound since prepare()

    # --- per step ------------------------------------------------------------------------------
    def prepare(self, sync: bool) -> None:
        """Call before each microbatch's backward; sync=True only for the step's final microbatch."""
        assert not any(b.work for b in self.buckets), "finish() was not called after the last sync backward"
        self._bind_views()
        self._sync = sync
        if sync:
            self._next_launch = 0
            for b in self.buckets:
                b.pending, b.launched = len(b.params), False

    def _launch_ready(self) -> None:
        """Start every bucket that is full, in bucket order, stopping at the first one that is not."""
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def skip_rows(self, rows: dict[str, list[int]]) -> set[str]:
        """From the next launch on, leave rows[name] (indices along dim 0) of the named params out of the all-reduce
        (they are still scaled); {} reduces everything again. Every rank of the group must skip the same rows.
        Returns the names found here."""
        found = set()
        for b in self.buckets:
            keep, at = [], 0
            for name, p in zip(b.names, b.params):
                skip = set(rows.get(name, ()))
                if skip:
                    found.add(name)
                    row = p.numel() // p.shape[0]
                    keep += [(at + s * row, at + (s + 1) * row) for s in range(p.shape[0]) if s not in skip]
                else:
                    keep.append((at, at + p.numel()))
                at += p.numel()
            runs: list[tuple[int, int]] = []
            for a, z in keep:  # adjacent ranges as one
                if runs and runs[-1][1] == a:
                    runs[-1] = (runs[-1][0], z)
                elif z > a:
                    runs.append((a, z))
            b.runs = None if runs == [(0, b.flat.numel())] else runs
        return found

    def _launch(self, b: Bucket) -> None:
        if self.scale != 1.0:
            b.flat.mul_(self.scale)  # pre-scale: the collective reads this memory next anyway
        b.launched = True
        if self.group is None or b.runs == []:  # alone, or every row skipped
            return
        src = b.flat if b.runs is None else torch.cat([b.flat[a:z] for a, z in b.runs])
        if self.reduce_dtype not in (None, src.dtype):
            src = src.to(self.reduce_dtype)
        work = comm.all_reduce(src, group=self.group, axis="dp", async_op=True)
        b.work = work if src is b.flat else CopyBack(work, src, b.flat, b.runs)

    def launch_rest(self) -> None:
        """Launch what is left (params that got no gradient are reduced as zeros), without waiting: every bucket is
        then scaled, its skipped rows included (parallel/rebalance.py reads those next)."""
        if not self._sync:
            raise RuntimeError("Reducer.finish() without prepare(sync=True) before the final backward")
        for b in self.buckets[self._next_launch:]:
            b.pending = 0
        self._launch_ready()

    def finish(self) -> None:
        """Launch what is left, wait for all."""
        self.launch_rest()
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
        self._sync = False

    def zero_grad(self) -> None:
        """Zero the flat buffers (grads stay bound to them; never None). No autograd: the buffers are plain."""
        for b in self.buckets:
            b.flat.zero_()
        self._bind_views()

    def _bind_views(self) -> None:
        """Re-point any .grad that was replaced (e.g. optimizer.zero_grad(set_to_none=True)) at its view,
        keeping its value (None = zero). A bound .grad is accumulated in place by autograd; an unbound
        one would be replaced by a fresh tensor and escape the bucket. Bound is the common case, checked by
        identity (p.grad hands back the Python object it was set to): no call per parameter."""
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                if p.grad is not view:
                    _rebind(p, view)


@torch.no_grad()
def _rebind(p: nn.Parameter, view: torch.Tensor) -> None:
    g = p.grad
    if g is None:
        view.zero_()
    elif g.data_ptr() != view.data_ptr():
        view.copy_(g)
    p.grad = view


class CopyBack:
    """An async collective on a copy (narrowed: parallel.reduce_dtype; packed: `Reducer.skip_rows`): wait() writes the
    result back into `dst` (widened), into its ranges `runs` [a, b) when packed."""

    def __init__(self, work: comm.TimedWork, low: torch.Tensor, dst: torch.Tensor,
                 runs: list[tuple[int, int]] | None = None):
        self.work, self.low, self.dst, self.runs = work, low, dst, runs

    def wait(self) -> None:
        self.work.wait()
        if self.runs is None:
            self.dst.copy_(self.low)
            return
        at = 0
        for a, z in self.runs:
            self.dst[a:z].copy_(self.low[at:at + z - a])
            at += z - a


def wrap_ddp(model: nn.Module, group, bucket_mb: float) -> nn.Module:
    """torch DDP over `group` with the same bucket size, for side-by-side measurement (dp_impl="torch_ddp").

    DDP averages over its group, i.e. scale = 1/group size: this matches our Reducer only when the
    group is the whole data world (ep == 1). Use `model.no_sync()` on non-final microbatches, and
    drop the DDP module before destroy_process_group (the baselines: SIGABRT at exit otherwise).
    With group None (one rank) the model is returned unwrapped.
    """
    if group is None:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mb,
                                   forward_sync_buffers=False, gradient_as_bucket_view=True)
