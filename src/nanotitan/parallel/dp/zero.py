"""ZeRO-1/2: the Reducer's buckets, reduce-scattered instead of all-reduced, each rank updating 1/N of them.

`ShardedReducer` is the mechanism (one per gradient group), `ZeroSync` the GradSync flavour over them
(sync.py), whose `sharded_state` cuts this rank's flat slices of the optimizer state into the per-parameter
boxes checkpoints hold (docs/dp.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from ...model.families import tag_of
from ..comm import collectives as comm
from ..clip import clip_grad_norm_
from .reducer import Bucket, CopyBack, Reducer
from .sync import BucketedSync, Pieces, flat_range_boxes, gradient_groups, tag_groups
from ..tied import apart_tied
from ..shard import Grad, grad_layout, token_ranks


@dataclass
class _ShardBucket(Bucket):
    """A Reducer bucket whose params, gradients and optimizer state are split into `world` equal slices."""
    offsets: list[int] = field(default_factory=list)  # params[i] occupies [offsets[i], offsets[i] + numel)
    padded: int = 0  # numel rounded up to a multiple of 16 * the group size
    tag: str = ""  # its params' family tag (model/families.py): one optimizer group per bucket
    pflat: torch.Tensor | None = None  # the params' storage: every param's .data is a view into it
    shard: nn.Parameter | None = None  # this rank's slice of pflat: what the optimizer steps
    shard_grad: torch.Tensor | None = None  # its reduced gradient (zero 1: a slice of flat; zero 2: its own)
    gather: comm.TimedWork | None = None


# Each rank's slice is a multiple of 16 elements (64 bytes for fp32: a cache line, one AVX-512 vector), so
# vectorised kernels such as fused AdamW never run a scalar tail over a slice they would not run over the
# whole tensors.
_SHARD_ALIGN = 16

# zero 2 "shard": reduce-scatters in flight while backward goes on. Launching one more waits for the oldest, so
# at most this many full bucket buffers wait on the wire, beside the one backward is filling. The planner's memory
# model (plan/memory.py) reads this very name.
IN_FLIGHT_BUCKETS = 1


class ShardedReducer(Reducer):
    """ZeRO-1/2 over `group`: the Reducer's buckets and per-step protocol, but each bucket is
    reduce-scattered (not all-reduced) and each rank updates only its 1/N slice of every bucket.

    Per step, as the Reducer: `prepare(sync)` before each microbatch's backward, `finish()` after the
    last; then clip `shard_params` (their .grad is this rank's slice of `scale * SUM over group`), step
    an optimizer built on `param_groups()`, `start_gather()` and `wait_gather()` (the full params again on every
    rank), `zero_grad()`. Between finish() and the next step only the shard grads mean anything.

    Layout: each bucket holds params of one dtype and one family tag (model/families.py), so that its shard is in
    one optimizer group whatever optim/ makes of the tag, in a flat param buffer padded to a multiple of 16 * N;
    the model's params are views into it, and the shard param is a view of this rank's slice [r*S, (r+1)*S). An
    elementwise optimizer (AdamW) gives exactly the same update on a slice as on the whole tensor; padding stays
    zero.

    zero=1: gradients accumulate over microbatches in the full flat buffer (gradient-as-bucket-view);
            the final backward reduce-scatters each bucket in place, so the shard grad is a slice of it.
    zero=2, accumulate="shard" (parallel.zero_accumulate): no full gradient outlives its bucket. Every
            backward, not only the final one, counts its params ready and reduce-scatters each bucket as soon as
            it is full (same launch rule), adding the result into a persistent 1/N shard grad; a bucket's full
            buffer is allocated when backward delivers its first gradient (a tensor hook, before autograd
            accumulates into .grad), reduce-scattered in place as at zero 1, and freed once that has landed,
            at most `IN_FLIGHT_BUCKETS` of them in flight. M reduce-scatters per bucket per step instead of one.
    zero=2, accumulate="full": gradients accumulate over the step's microbatches in full buffers as at zero 1;
            the final backward reduce-scatters them into the shard grad and finish() frees them (the next
            step's first prepare() allocates them again). One reduce-scatter per bucket per step.
    Either way, between steps (clip, optimizer, checkpoint, eval) a rank holds 1/N of the gradients.
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], group, bucket_mb: float, scale: float,
                 zero: int, reduce_dtype: torch.dtype | None = None, accumulate: str = "shard"):
        if zero not in (1, 2):
            raise ValueError(f"ShardedReducer implements parallel.zero 1 and 2, got {zero} (zero 3 is fsdp.py)")
        if accumulate not in ("shard", "full"):
            raise ValueError(f"parallel.zero_accumulate={accumulate!r} must be shard or full "
                             "(--parallel.zero_accumulate)")
        self.zero = zero
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        # zero 2 "shard": reduce-scatter on every backward into the shard accumulator (zero 1 keeps full grads)
        self.every_backward = zero == 2 and accumulate == "shard"
        self._armed = False  # every_backward: a backward is under way since the last prepare()
        self._in_flight: list[tuple] = []  # every_backward: (work, output, input kept alive, bucket), oldest first
        super().__init__(named_params, group, bucket_mb, scale, reduce_dtype)
        if self.every_backward:
            for b in self.buckets:
                for p in b.params:
                    p.register_hook(self._make_alloc_hook(b))

    @staticmethod
    def _bucket_kind(p: nn.Parameter) -> tuple:
        return p.dtype, p.device, tag_of(p)

    def skip_rows(self, rows: dict[str, list[int]]) -> set[str]:
        raise NotImplementedError("ZeRO-1/2 reduce-scatter whole flat buckets (GradSync.skip_rows is False here)")

    @torch.no_grad()
    def _make_bucket(self, entries: list[tuple[str, nn.Parameter]]) -> _ShardBucket:
        params = [p for _, p in entries]
        p0, N = params[0], self.world
        numel = sum(p.numel() for p in params)
        padded = -(-numel // (N * _SHARD_ALIGN)) * N * _SHARD_ALIGN
        S = padded // N
        b = _ShardBucket(flat=None, params=params, views=[], names=[n for n, _ in entries], padded=padded,
                         tag=tag_of(p0), pflat=torch.zeros(padded, dtype=p0.dtype, device=p0.device))
        offset = 0
        for p in params:
            b.offsets.append(offset)
            view = b.pflat[offset:offset + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view  # the model now reads and writes its weights in the bucket
            offset += p.numel()
        b.shard = nn.Parameter(b.pflat[self.rank * S:(self.rank + 1) * S])
        if not self.every_backward or any(p.grad is not None for p in params):
            self._alloc_grads(b)  # keeps a .grad accumulated before the reducer existed
        b.shard_grad = b.flat[self.rank * S:(self.rank + 1) * S] if self.zero == 1 else b.pflat.new_zeros(S)
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
            # zero 2 "full": the buffers finish() freed. "shard": only to take in a gradient that escaped the
            # bucket (set from outside); backward's first gradient allocates the buffer otherwise.
            if b.flat is None and (not self.every_backward or any(p.grad is not None for p in b.params)):
                self._alloc_grads(b)
            if b.shard.grad is None or b.shard.grad.data_ptr() != b.shard_grad.data_ptr():
                b.shard.grad = b.shard_grad  # e.g. optimizer.zero_grad(set_to_none=True)
        super()._bind_views()

    def _make_alloc_hook(self, b: _ShardBucket):
        def alloc(grad: torch.Tensor) -> None:
            if b.flat is None:  # the bucket's first gradient of this backward: accumulate it into a zeroed buffer
                self._alloc_grads(b)
        return alloc

    def _before_accumulate(self, b: _ShardBucket) -> None:
        if self.every_backward and b.flat is None:  # what the alloc hook does for an autograd gradient
            self._alloc_grads(b)

    def _make_hook(self, bi: int, pi: int):
        if not self.every_backward:
            return super()._make_hook(bi, pi)
        b = self.buckets[bi]
        name = b.names[pi]

        def hook(p: nn.Parameter) -> None:
            if not self._armed:
                return  # a backward outside the protocol: its gradient waits in the buffer for the next one
            if b.launched:
                raise RuntimeError(f"{name} received a gradient after its bucket's reduce-scatter started: each "
                                   f"microbatch must run a single backward (combine losses before .backward())")
            b.pending -= 1
            if b.pending == 0:
                self._launch_ready()

        return hook

    def prepare(self, sync: bool) -> None:
        if not self.every_backward:
            return super().prepare(sync)
        if self._armed:
            self._launch_rest()  # the previous backward's buckets, in order: the same collectives on every rank
        self._bind_views()
        self._sync, self._armed, self._next_launch = sync, True, 0
        for b in self.buckets:
            b.pending, b.launched = len(b.params), False

    def _launch_rest(self) -> None:
        """Launch every bucket this backward has not: those with a param that got no gradient here (an
        unused expert; under interleaved, another chunk's) are reduced with what they hold, zeros if nothing."""
        for b in self.buckets[self._next_launch:]:
            if b.flat is None:
                self._alloc_grads(b)
            b.pending = 0
        self._launch_ready()

    def _launch(self, b: _ShardBucket) -> None:
        if self.every_backward:
            return self._launch_into_shard(b)
        if self.scale != 1.0:
            b.flat.mul_(self.scale)  # pre-scale: the collective reads this memory next anyway
        if self.group is not None and self.reduce_dtype not in (None, b.flat.dtype):
            low = b.flat.to(self.reduce_dtype)  # parallel.reduce_dtype: reduce a narrowed copy, widen the slice
            out = low.new_empty(b.shard_grad.shape)
            b.work = CopyBack(comm.reduce_scatter(out, low, self.group), out, b.shard_grad)
        elif self.group is not None:
            # zero 1: in place (the output is this rank's slice of the input, as NCCL allows)
            b.work = comm.reduce_scatter(b.shard_grad, b.flat, self.group)
        elif self.zero == 2:
            b.shard_grad.copy_(b.flat)
        b.launched = True

    def _launch_into_shard(self, b: _ShardBucket) -> None:
        """zero 2 "shard": reduce-scatter this backward's bucket, to be added into the shard grad when it lands;
        the params let go of the full buffer at once (the collective keeps it alive until then)."""
        if self.scale != 1.0:
            b.flat.mul_(self.scale)
        if self.group is None:
            b.shard_grad.add_(b.flat)
        else:
            src = b.flat if self.reduce_dtype in (None, b.flat.dtype) else b.flat.to(self.reduce_dtype)
            S = b.shard_grad.numel()
            out = src[self.rank * S:(self.rank + 1) * S]  # in place, as zero 1: no buffer beside the bucket
            self._in_flight.append((comm.reduce_scatter(out, src, self.group), out, src, b))
        for p in b.params:
            p.grad = None
        b.flat, b.views, b.launched = None, [], True
        while len(self._in_flight) > IN_FLIGHT_BUCKETS:
            self._land(self._in_flight.pop(0))

    @staticmethod
    def _land(entry: tuple) -> None:
        work, out, _, b = entry
        work.wait()
        b.shard_grad.add_(out)  # microbatch by microbatch, in launch order (bf16: widened by the add)

    def finish(self) -> None:
        if self.every_backward:
            if not self._sync:
                raise RuntimeError("ShardedReducer.finish() without prepare(sync=True) before the final backward")
            self._launch_rest()
            while self._in_flight:
                self._land(self._in_flight.pop(0))
            self._sync = self._armed = False
            return
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

    def param_groups(self) -> list[dict]:
        """The shard params, one group per family tag (each bucket holds one tag)."""
        return tag_groups((b.tag, b.shard) for b in self.buckets)

    def start_gather(self, buckets: list[_ShardBucket] | None = None) -> None:
        """After the optimizer step: all-gather every bucket's updated slices (async, in place), in the order of
        `buckets` (default: bucket order)."""
        if self.group is None:
            return  # one rank: the shard is the whole buffer, already updated
        for b in (self.buckets if buckets is None else buckets):
            b.gather = comm.all_gather(b.pflat, b.shard.detach(), self.group)

    def wait_gather(self) -> None:
        for b in self.buckets:
            if b.gather is not None:
                b.gather.wait()
                b.gather = None


def _flat_pieces(r: ShardedReducer, b: _ShardBucket, v: torch.Tensor) -> dict[str, Pieces]:
    """{param name: Pieces} of `v`, this rank's flat slice [r.rank*S, (r.rank+1)*S) of bucket b (its optimizer
    state or its shard grad), cut per param into boxes of the param's shape (`flat_range_boxes`): views of v.
    A 0-dim v (AdamW's step: one scalar for the bucket, the same on every rank) is whole for every param."""
    S = b.padded // r.world
    lo = r.rank * S
    out = {}
    for name, p, o in zip(b.names, b.params, b.offsets):
        if v.dim() == 0:
            out[name] = Pieces.whole(v)
            continue
        a, z = max(o, lo), min(o + p.numel(), lo + S)  # the param's elements in the slice
        start = o - lo  # where the param's element 0 sits in the slice (may be < 0)
        out[name] = Pieces(p.shape, [(off, v[start + _flat_offset(p.shape, off):][:math.prod(sz)].view(sz))
                                     for off, sz in flat_range_boxes(tuple(p.shape), a - o, z - o)])
    return out


def _flat_offset(shape, offsets) -> int:
    """Row-major flat index of the element at `offsets`."""
    flat = 0
    for n, o in zip(shape, offsets):
        flat = flat * n + o
    return flat


class ZeroSync(BucketedSync):
    """zero 1/2: one ShardedReducer per gradient group. The optimizer steps the shard params; their gradients
    are disjoint slices over the non-expert-DP group (replicated params are sharded over it, expert shards
    over expert-DP and differ over EP anyway), which is what clipping sums."""

    def __init__(self, model, dims, expert_params, replicated_params, bucket_mb: float, scale: float, zero: int,
                 reduce_dtype: torch.dtype | None = None, accumulate: str = "shard"):
        super().__init__(model, dims, expert_params, replicated_params)
        # MTP under PP: the embedding both end stages hold gets a reducer (a bucket) of its own, so that its flat
        # shards are the same elements on both stages (tied.py sums them)
        self.reducers = [ShardedReducer(part, dims.group(kind), bucket_mb, scale, zero, reduce_dtype, accumulate)
                         for params, kind in gradient_groups(expert_params, replicated_params)
                         for part in apart_tied(params, model, dims)]
        self._install_gather_waits()

    def local_grad(self, p: nn.Parameter) -> torch.Tensor:
        """The flat shard grad of the bucket p fills alone (`apart_tied` gave it one): its elements [r*S, (r+1)*S)."""
        b, = [b for r in self.reducers for b in r.buckets if any(q is p for q in b.params)]
        assert len(b.params) == 1, f"{b.names}: a shard of a bucket of several params is no part of one of them"
        return b.shard_grad

    def param_groups(self) -> list[dict]:
        return tag_groups((b.tag, b.shard) for r in self.reducers for b in r.buckets)

    def clip(self, max_norm: float, sq_offset: torch.Tensor | None = None) -> torch.Tensor:
        # every reducer's shards are disjoint over the stage, except those of params whole on every token rank
        # (Grad.WHOLE: none without a token shard), which count once among them
        once = [all(grad_layout(p).kind is Grad.WHOLE for b in r.buckets for p in b.params) for r in self.reducers]
        return clip_grad_norm_([], [], max_norm, self.dims.group("pp"), None,
                               [q for r, o in zip(self.reducers, once) if not o for q in r.shard_params],
                               self.dims.group("stage"), token_ranks=token_ranks(self.dims),
                               shard_once=[q for r, o in zip(self.reducers, once) if o for q in r.shard_params],
                               sq_offset=sq_offset)

    def after_step(self) -> None:
        """Post every bucket's all-gather of the updated slices, in the order the next forward needs them, and
        return: a block waits for its own buckets when its forward starts (`_install_gather_waits`), so the
        gathers of later blocks travel while earlier blocks compute (Megatron's overlapped param gather)."""
        for r, order in zip(self.reducers, self._use_order):
            r.start_gather(order)

    def wait_params(self) -> None:
        """Every bucket's gather landed: the params are whole again (before the optimizer, a checkpoint, ...)."""
        for r in self.reducers:
            r.wait_gather()

    def _install_gather_waits(self) -> None:
        """A forward pre-hook on each block and on each chunk (for what sits outside its blocks: embeddings, final
        norm, head) waits for the buckets holding its params. Whole blocks, not leaf modules: a block may read a
        param outside that param's own module's forward (the router weight in MoE.route, the experts under
        parallel.ep_overlap, an embedding table through wgrad.tap)."""
        bucket_of = {id(p): b for r in self.reducers for b in r.buckets for p in b.params}
        order = {id(p): i for i, p in enumerate(self.model.parameters())}
        # each reducer's buckets in the next forward's order (they are built in backward's)
        self._use_order = [sorted(r.buckets, key=lambda b: min(order.get(id(p), 0) for p in b.params))
                           for r in self.reducers]
        self._gather_hooks = []

        def waiter(params):
            buckets = list({id(bucket_of[id(p)]): bucket_of[id(p)] for p in params if id(p) in bucket_of}.values())

            def hook(module, args):
                for b in buckets:
                    if b.gather is not None:
                        b.gather.wait()
                        b.gather = None
            return hook

        for chunk in getattr(self.model, "chunks", [self.model]):
            blocks = list(chunk.layers.values()) if hasattr(chunk, "layers") else []
            inner = {id(p) for blk in blocks for p in blk.parameters()}
            edges = [p for p in chunk.parameters() if id(p) not in inner]
            self._gather_hooks.append(chunk.register_forward_pre_hook(waiter(edges)))
            for blk in blocks:
                self._gather_hooks.append(blk.register_forward_pre_hook(waiter(list(blk.parameters()))))

    def finish(self) -> None:
        self.wait_params()  # a param no forward waited for (unused this step) is whole before the optimizer runs
        super().finish()

    def sharded_state(self, optimizer):
        """The live params (whole on every rank between steps) and this rank's slices of the optimizer state, cut
        per param into boxes of its shape (`flat_range_boxes`): views of the flat state, nothing gathered."""
        for r in self.reducers:  # a save, or a load that reads into these very tensors: params whole first
            r.wait_gather()
        model_state = {n: Pieces.whole(t) for n, t in self.model.named_parameters()}
        optim_state: dict[str, dict] = {}
        if optimizer is None:
            return model_state, optim_state
        for r in self.reducers:
            for b in r.buckets:
                for key, v in optimizer.state_of(b.shard).items():
                    for name, pieces in _flat_pieces(r, b, v).items():
                        optim_state.setdefault(name, {})[key] = pieces
        return model_state, optim_state

    def state_boxes(self, names: set[str], peer: int) -> dict[str, list[tuple]]:
        """`peer`'s flat slice of every bucket (its place in its reducer's group: the same buckets on every rank
        of the stage), cut per named param as `_flat_pieces` cuts this rank's."""
        out = {}
        for r in self.reducers:
            at = 0 if r.group is None else self.dims.place_like(dist.get_process_group_ranks(r.group), peer)
            for b in r.buckets:
                S = b.padded // r.world
                for name, p, o in zip(b.names, b.params, b.offsets):
                    if name in names:
                        a, z = max(o, at * S), min(o + p.numel(), (at + 1) * S)
                        out[name] = flat_range_boxes(tuple(p.shape), a - o, z - o)
        return out

    def grad_pieces(self, names: set[str]) -> dict[str, Pieces]:
        """This rank's slices of the named params' reduced gradients (the buckets' shard grads), per param."""
        return {n: pieces for r in self.reducers for b in r.buckets if names.intersection(b.names)
                for n, pieces in _flat_pieces(r, b, b.shard_grad).items() if n in names}

    grads_whole = False

    def close(self) -> None:
        self.wait_params()
        for h in self._gather_hooks:
            h.remove()
        self._gather_hooks = []
