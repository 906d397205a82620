"""Data parallelism: the bucketed gradient Reducer (seed, DP section), its naive oracle, and torch DDP.

Contract of every implementation here: after `finish()`, each parameter's `.grad` equals
`scale * SUM over the group of the local .grad` (group None = this rank alone: only the scale).
The trainer passes `scale = 1/(DP*EP)` and the parameter's group (non-expert-DP for replicated
params, expert-DP for expert shards), which gives DESIGN §4's averages.

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
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm


@dataclass
class _Bucket:
    flat: torch.Tensor  # the one buffer the grads of `params` are views into
    params: list[nn.Parameter]
    views: list[torch.Tensor]  # views[i] is params[i].grad
    pending: int = 0  # params not yet ready in this step's final microbatch
    work: comm.TimedWork | None = None
    launched: bool = False
    names: list[str] = field(default_factory=list)


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
        if bucket_mb <= 0:
            raise ValueError(f"parallel.bucket_mb={bucket_mb} must be > 0 (--parallel.bucket_mb)")
        self.group, self.scale = group, float(scale)
        self.reduce_dtype = reduce_dtype  # None: reduce in the gradients' own dtype (fp32)
        self.buckets: list[_Bucket] = []
        self._sync = False
        self._next_launch = 0  # index of the first bucket whose all-reduce has not started
        for entries in _plan_buckets(named_params, bucket_mb * 2**20, self._bucket_kind):
            self.buckets.append(self._make_bucket(entries))
        for bi, b in enumerate(self.buckets):
            for pi, p in enumerate(b.params):
                p.register_post_accumulate_grad_hook(self._make_hook(bi, pi))

    @staticmethod
    def _bucket_kind(p: nn.Parameter) -> tuple:
        """Params of one bucket share this (one flat buffer has one dtype and device)."""
        return p.dtype, p.device

    def _make_bucket(self, entries: list[tuple[str, nn.Parameter]]) -> _Bucket:
        p0 = entries[0][1]
        flat = torch.zeros(sum(p.numel() for _, p in entries), dtype=p0.dtype, device=p0.device)
        b = _Bucket(flat=flat, params=[p for _, p in entries], views=[], names=[n for n, _ in entries])
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

    def _launch(self, b: _Bucket) -> None:
        if self.scale != 1.0:
            b.flat.mul_(self.scale)  # pre-scale: the collective reads this memory next anyway
        if self.group is not None and self.reduce_dtype not in (None, b.flat.dtype):
            low = b.flat.to(self.reduce_dtype)
            b.work = _CopyBack(comm.all_reduce(low, group=self.group, axis="dp", async_op=True), low, b.flat)
        elif self.group is not None:
            b.work = comm.all_reduce(b.flat, group=self.group, axis="dp", async_op=True)
        b.launched = True

    def finish(self) -> None:
        """Launch what is left (params that got no gradient are reduced as zeros), wait for all."""
        if not self._sync:
            raise RuntimeError("Reducer.finish() without prepare(sync=True) before the final backward")
        for b in self.buckets[self._next_launch:]:
            b.pending = 0
        self._launch_ready()
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
        self._sync = False

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Zero the flat buffers (grads stay bound to them; never None)."""
        for b in self.buckets:
            b.flat.zero_()
        self._bind_views()

    @torch.no_grad()
    def _bind_views(self) -> None:
        """Re-point any .grad that was replaced (e.g. optimizer.zero_grad(set_to_none=True)) at its view,
        keeping its value (None = zero). A bound .grad is accumulated in place by autograd; an unbound
        one would be replaced by a fresh tensor and escape the bucket."""
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                g = p.grad
                if g is None:
                    view.zero_()
                    p.grad = view
                elif g.data_ptr() != view.data_ptr():
                    view.copy_(g)
                    p.grad = view


@dataclass
class _ShardBucket(_Bucket):
    """A Reducer bucket whose params, gradients and optimizer state are split into `world` equal slices."""
    offsets: list[int] = field(default_factory=list)  # params[i] occupies [offsets[i], offsets[i] + numel)
    padded: int = 0  # numel rounded up to a multiple of 16 * the group size
    decay: bool = True  # matrices (weight decay) or vectors (none): one optimizer group per bucket
    pflat: torch.Tensor | None = None  # the params' storage: every param's .data is a view into it
    shard: nn.Parameter | None = None  # this rank's slice of pflat: what the optimizer steps
    shard_grad: torch.Tensor | None = None  # its reduced gradient (zero 1: a slice of flat; zero 2: its own)
    gather: comm.TimedWork | None = None


# Each rank's slice is a multiple of 16 elements (64 bytes for fp32: a cache line, one AVX-512 vector), so
# vectorised kernels such as fused AdamW never run a scalar tail over a slice they would not run over the
# whole tensors.
_SHARD_ALIGN = 16


class ShardedReducer(Reducer):
    """ZeRO-1/2 over `group`: the Reducer's buckets and per-step protocol, but each bucket is
    reduce-scattered (not all-reduced) and each rank updates only its 1/N slice of every bucket.

    Per step, as the Reducer: `prepare(sync)` before each microbatch's backward, `finish()` after the
    last; then clip `shard_params` (their .grad is this rank's slice of `scale * SUM over group`), step
    an optimizer built on `param_groups()`, `gather_params()` (the full params again on every rank),
    `zero_grad()`. Between finish() and the next step only the shard grads mean anything.

    Layout: each bucket holds params of one dtype and one weight-decay kind (decay on matrices only, as
    the trainer's AdamW), in a flat param buffer padded to a multiple of 16 * N; the model's params are views
    into it, and the shard param is a view of this rank's slice [r*S, (r+1)*S). An elementwise optimizer
    (AdamW) gives exactly the same update on a slice as on the whole tensor; padding stays zero.

    zero=1: gradients accumulate over microbatches in the full flat buffer (gradient-as-bucket-view);
            the final backward reduce-scatters each bucket in place, so the shard grad is a slice of it.
    zero=2: the same during the step, then the full buffers are freed as soon as their reduce-scatter
            has landed in the persistent shard grad, and allocated again (zeroed) by the next step's
            first prepare(): between steps (clip, optimizer, checkpoint, eval) a rank holds 1/N of the
            gradients. Still one reduce-scatter per bucket per step, whatever M (docs/dp.md).
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], group, bucket_mb: float, scale: float,
                 zero: int, reduce_dtype: torch.dtype | None = None):
        if zero not in (1, 2):
            raise ValueError(f"ShardedReducer implements parallel.zero 1 and 2, got {zero} (zero 3 is fsdp.py)")
        self.zero = zero
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        super().__init__(named_params, group, bucket_mb, scale, reduce_dtype)

    @staticmethod
    def _bucket_kind(p: nn.Parameter) -> tuple:
        return p.dtype, p.device, p.dim() >= 2

    @torch.no_grad()
    def _make_bucket(self, entries: list[tuple[str, nn.Parameter]]) -> _ShardBucket:
        params = [p for _, p in entries]
        p0, N = params[0], self.world
        numel = sum(p.numel() for p in params)
        padded = -(-numel // (N * _SHARD_ALIGN)) * N * _SHARD_ALIGN
        S = padded // N
        b = _ShardBucket(flat=None, params=params, views=[], names=[n for n, _ in entries], padded=padded,
                         decay=p0.dim() >= 2, pflat=torch.zeros(padded, dtype=p0.dtype, device=p0.device))
        offset = 0
        for p in params:
            b.offsets.append(offset)
            view = b.pflat[offset:offset + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view  # the model now reads and writes its weights in the bucket
            offset += p.numel()
        b.shard = nn.Parameter(b.pflat[self.rank * S:(self.rank + 1) * S])
        self._alloc_grads(b)  # keeps a .grad accumulated before the reducer existed
        b.shard_grad = b.flat[self.rank * S:(self.rank + 1) * S] if self.zero == 1 else b.flat.new_zeros(S)
        b.shard.grad = b.shard_grad
        return b

    @torch.no_grad()
    def _alloc_grads(self, b: _ShardBucket) -> None:
        """The full gradient buffer of a bucket, zeroed, with every param's .grad a view into it."""
        p0 = b.params[0]
        b.flat = torch.zeros(b.padded, dtype=p0.dtype, device=p0.device)
        b.views = [b.flat[o:o + p.numel()].view_as(p) for o, p in zip(b.offsets, b.params)]
        for p, view in zip(b.params, b.views):
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view

    # --- per step ------------------------------------------------------------------------------
    def _bind_views(self) -> None:
        for b in self.buckets:
            if b.flat is None:  # zero 2: freed by the last finish()
                self._alloc_grads(b)
            if b.shard.grad is None or b.shard.grad.data_ptr() != b.shard_grad.data_ptr():
                b.shard.grad = b.shard_grad  # e.g. optimizer.zero_grad(set_to_none=True)
        super()._bind_views()

    def _launch(self, b: _ShardBucket) -> None:
        if self.scale != 1.0:
            b.flat.mul_(self.scale)  # pre-scale: the collective reads this memory next anyway
        if self.group is not None and self.reduce_dtype not in (None, b.flat.dtype):
            low = b.flat.to(self.reduce_dtype)  # parallel.reduce_dtype: reduce a narrowed copy, widen the slice
            out = low.new_empty(b.shard_grad.shape)
            b.work = _CopyBack(comm.reduce_scatter(out, low, self.group), out, b.shard_grad)
        elif self.group is not None:
            # zero 1: in place (the output is this rank's slice of the input, as NCCL allows)
            b.work = comm.reduce_scatter(b.shard_grad, b.flat, self.group)
        elif self.zero == 2:
            b.shard_grad.copy_(b.flat)
        b.launched = True

    def finish(self) -> None:
        super().finish()
        if self.zero == 2:
            for b in self.buckets:  # the reduced slice is in shard_grad: drop the full buffer
                for p in b.params:
                    p.grad = None
                b.flat, b.views = None, []

    @torch.no_grad()
    def zero_grad(self) -> None:
        for b in self.buckets:
            if b.flat is not None:
                b.flat.zero_()  # zero 1: shard_grad is a slice of it
            if self.zero == 2:
                b.shard_grad.zero_()
        if self.zero == 1:
            self._bind_views()

    # --- optimizer side ---------------------------------------------------------------------------
    @property
    def shard_params(self) -> list[nn.Parameter]:
        return [b.shard for b in self.buckets]

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW groups over the shard params: decay on matrices only (the trainer's rule)."""
        return [{"params": [b.shard for b in self.buckets if b.decay], "weight_decay": weight_decay},
                {"params": [b.shard for b in self.buckets if not b.decay], "weight_decay": 0.0}]

    def start_gather(self) -> None:
        """After the optimizer step: all-gather every bucket's updated slices (async, in place)."""
        if self.group is None:
            return  # one rank: the shard is the whole buffer, already updated
        for b in self.buckets:
            b.gather = comm.all_gather(b.pflat, b.shard.detach(), self.group)

    def wait_gather(self) -> None:
        for b in self.buckets:
            if b.gather is not None:
                b.gather.wait()
                b.gather = None

    def gather_params(self) -> None:
        """Every rank's params are the full updated params again."""
        self.start_gather()
        self.wait_gather()


class _CopyBack:
    """An async collective on a narrowed copy (parallel.reduce_dtype): wait() widens the result into `dst`."""

    def __init__(self, work: comm.TimedWork, low: torch.Tensor, dst: torch.Tensor):
        self.work, self.low, self.dst = work, low, dst

    def wait(self) -> None:
        self.work.wait()
        self.dst.copy_(self.low)


class DataParallelNaive:
    """Oracle: after the whole backward, one blocking all-reduce per parameter (picotron's naive DP)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], group, scale: float):
        self.params = [p for _, p in named_params if p.requires_grad]
        self.group, self.scale = group, scale

    @torch.no_grad()
    def finish(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.group is not None:
                comm.all_reduce(p.grad, group=self.group, axis="dp")
            p.grad.mul_(self.scale)


def wrap_ddp(model: nn.Module, group, bucket_mb: float) -> nn.Module:
    """torch DDP over `group` with the same bucket size, for side-by-side measurement (dp_impl="torch_ddp").

    DDP averages over its group, i.e. scale = 1/group size: this matches our Reducer only when the
    group is the whole data world (ep == 1). Use `no_sync(model)` on non-final microbatches, and
    drop the DDP module before destroy_process_group (BASELINES: SIGABRT at exit otherwise).
    With group None (one rank) the model is returned unwrapped.
    """
    if group is None:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mb,
                                   forward_sync_buffers=False, gradient_as_bucket_view=True)


def no_sync(model: nn.Module):
    """DDP's no_sync() for a wrapped model, a no-op context otherwise."""
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


# --- memory: live bytes of params, gradients and optimizer state ------------------------------------

def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def live_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once, the whole buffer)."""
    seen: dict[tuple, int] = {}
    for t in tensors:
        if t is None:
            continue
        s = _local(t).untyped_storage()
        seen[(s.device, s.data_ptr())] = s.nbytes()  # a storage freed by FSDP has nbytes() == 0
    return sum(seen.values())


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                reducers: list | tuple = ()) -> dict[str, int]:
    """Live bytes on this rank: `param_bytes` (the model's params and any shard params), `grad_bytes`
    (their .grad: Reducer buckets, full and shard buffers), `optim_bytes` (every tensor of the optimizer
    state). Deduplicated by storage, so views into flat buffers count once."""
    params = list(model.parameters())
    for r in reducers:
        params += getattr(r, "shard_params", [])
    optim = []
    if optimizer is not None:
        for st in optimizer.state.values():
            optim += [v for v in st.values() if torch.is_tensor(v)]
    return {"param_bytes": live_bytes(params), "grad_bytes": live_bytes(p.grad for p in params),
            "optim_bytes": live_bytes(optim)}


# --- checkpoints: optimizer state in global per-parameter form ---------------------------------------

@torch.no_grad()
def sharded_optim_state_to_full(reducers: list, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    """{param name: {state key: tensor}} for every param of these sharded reducers, as a replicated
    optimizer would hold it: each bucket's state slices are all-gathered over its group and cut per param
    (fresh tensors; a scalar such as AdamW's `step` is shared by every param of the bucket).
    Collective over each reducer's group; an optimizer that has not stepped yet gives zero moments, step 0."""
    out: dict[str, dict] = {}
    for r in reducers:
        for b in r.buckets:
            state = _bucket_state(optimizer, b)
            for key in sorted(state):  # same collective order on every rank
                v = state[key]
                if v.dim() == 0:
                    for name in b.names:
                        out.setdefault(name, {})[key] = v.detach().clone()
                    continue
                full = v.new_empty(b.padded)
                if r.group is not None:
                    comm.all_gather(full, v, r.group).wait()
                else:
                    full.copy_(v)
                for name, p, o in zip(b.names, b.params, b.offsets):
                    out.setdefault(name, {})[key] = full[o:o + p.numel()].view_as(p)
    return out


@torch.no_grad()
def full_optim_state_to_sharded(reducers: list, optimizer: torch.optim.Optimizer, full: dict[str, dict]) -> None:
    """Inverse of `sharded_optim_state_to_full`: copy this rank's slice of every bucket out of the
    per-param state `full` (e.g. read from a checkpoint written at any zero level) into the optimizer."""
    for r in reducers:
        for b in r.buckets:
            state = _bucket_state(optimizer, b)
            S = b.padded // r.world
            for key, v in state.items():
                if v.dim() == 0:
                    v.copy_(full[b.names[0]][key])
                    continue
                flat = v.new_zeros(b.padded)
                for name, p, o in zip(b.names, b.params, b.offsets):
                    flat[o:o + p.numel()].copy_(full[name][key].reshape(-1))
                v.copy_(flat[r.rank * S:(r.rank + 1) * S])


def _bucket_state(optimizer: torch.optim.Optimizer, b: _ShardBucket) -> dict:
    """The optimizer state of a bucket's shard param, created as Adam(W)'s lazy init would if empty."""
    state = optimizer.state[b.shard]
    if not state:
        group = next(g for g in optimizer.param_groups if any(q is b.shard for q in g["params"]))
        on_device = group.get("fused") or group.get("capturable")
        state["step"] = torch.zeros((), dtype=torch.float32, device=b.shard.device if on_device else "cpu")
        state["exp_avg"] = torch.zeros_like(b.shard)
        state["exp_avg_sq"] = torch.zeros_like(b.shard)
    return state
