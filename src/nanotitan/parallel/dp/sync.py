"""The gradient-sync protocol: everything that depends on how data parallelism is done, behind one object.

A rank's `GradSync` owns, for its flavour of DP:

    forward_backward(..)     the step's forwards and backwards: the pipeline schedule it is handed (torch DDP: its own
                             microbatch loop)
    prepare(sync)            before each microbatch's backward; sync=True before the step's final one
    finish()                 after the last backward: gradients averaged (docs/design.md §4), in .grad or in shards; a
                             replicated expert's copies summed (`copies`, rebalance.py's CopyFold: expert placement)
    param_groups()           what this rank updates (params, or its 1/N shards), one group per family tag
                             (model/families.py: {"params", "tag"}); optim/ decides what each tag means
    clip(max_norm)           global-norm clipping over exactly what this rank holds (each element once)
    after_step()             after the optimizer step: the full params again on every rank (ZeRO-1/2)
    zero_grad()              ready for the next step (gradients stay bound to their buffers)
    local_grad(p)            after finish(): this rank's part of p's averaged gradient, a view of live storage (the
                             pair of embedding copies sums it, tied.py)
    grad_pieces(names)       after finish(): this rank's pieces of the named params' averaged gradients
    sharded_state(opt)       checkpoint form: ({name: Pieces}, {name: {state key: Pieces}}), this rank's pieces of
                             each whole tensor, views of the live state (save writes them, load reads into them);
                             nothing is ever gathered whole. The optimizer state is read through the optimizer's
                             own `state_of(p, group)` (optim/: it creates p's state if it has not stepped yet)
    close()                  before the process groups go

Flavours (`parallel/parallelize.py` is the one place that picks one):

    ReplicatedSync  zero 0: our bucketed, overlapped Reducer (dp.py), one per gradient group
    TorchDDPSync    torch DDP over the non-expert-DP group (a baseline for pure DP; its own forward)
    ZeroSync        zero 1/2: ShardedReducers (zero.py)
    FSDPSync        zero 3: FSDP2 (fsdp.py)

Every flavour leaves the same averages: replicated params averaged over the non-expert-DP group, expert
shards summed over expert-DP and divided by DP*EP.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ...model.families import tag_of
from ..clip import clip_grad_norm_
from ..dims import ParallelDims
from ..pp.schedules import StepStats
from ..rebalance import CopyFold
from .reducer import Reducer, wrap_ddp
from ..shard import Grad, grad_layout, token_ranks

NamedParams = list[tuple[str, nn.Parameter]]


@dataclass
class Pieces:
    """This rank's part of one whole tensor of `size` (a parameter as one replicated run holds it, or its
    optimizer state): boxes `(offsets, view)` of live storage that no other rank's pieces overlap, except
    replicas of the same box. Checkpoints are written and read in this form (checkpoint.py), so no rank ever
    builds a whole tensor that it holds only part of."""
    size: torch.Size
    boxes: list[tuple[tuple[int, ...], torch.Tensor]]

    @classmethod
    def whole(cls, t: torch.Tensor) -> "Pieces":
        return cls(t.shape, [((0,) * t.dim(), t.detach())])


def flat_range_boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The elements [a, b) of a row-major tensor of `shape` (flat indices) as (offsets, sizes) boxes, each
    contiguous in memory: a partial first row, whole rows, a partial last row, recursively over the
    dimensions (at most 2 * ndim - 1 boxes). ZeRO-1/2 slices a parameter's flat range this way."""
    if a >= b:
        return []
    if len(shape) <= 1:
        return [((a,), (b - a,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    rest = (0,) * (len(shape) - 1)
    out = []
    if a % inner:  # a partial first row
        row, end = a // inner, min(b, (a // inner + 1) * inner)
        out += [((row, *o), (1, *z)) for o, z in flat_range_boxes(shape[1:], a - row * inner, end - row * inner)]
        a = end
    if (rows := (b - a) // inner) and a < b:  # whole rows
        out.append(((a // inner, *rest), (rows, *shape[1:])))
        a += rows * inner
    if a < b:  # a partial last row
        out += [((a // inner, *o), (1, *z)) for o, z in flat_range_boxes(shape[1:], 0, b - a)]
    return out


def replicated_pieces(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    """`GradSync.sharded_state` of params that are whole on this rank: each tensor one piece, the live tensor
    itself (replicas of it are written once: the checkpoint's writer keeps one copy of identical boxes; loading
    copies into them, so there is nothing to scatter afterwards)."""
    named = dict(model.named_parameters())
    model_state = {n: Pieces.whole(t) for n, t in named.items()}
    if optimizer is None:
        return model_state, {}
    name_of = {id(q): n for n, q in named.items()}
    optim_state = {}
    for g in optimizer.param_groups:
        for q in g["params"]:
            assert id(q) in name_of, "optimizer holds a tensor that is not a parameter of the model"
            optim_state[name_of[id(q)]] = {k: Pieces.whole(v) for k, v in optimizer.state_of(q, g).items()
                                           if torch.is_tensor(v)}
    return model_state, optim_state


def tag_groups(tagged) -> list[dict]:
    """(tag, param) pairs as one group per family tag (model/families.py), in the order the tags first appear:
    [{"params", "tag"}]."""
    groups: dict[str, list] = {}
    for tag, q in tagged:
        groups.setdefault(tag, []).append(q)
    return [{"params": ps, "tag": tag} for tag, ps in groups.items()]


class GradSync:
    """The protocol (see the module docstring), with the defaults of a flavour whose params are whole."""

    def __init__(self, model: nn.Module, dims: ParallelDims, expert_params: NamedParams,
                 replicated_params: NamedParams):
        self.model, self.dims = model, dims
        self.expert_params, self.replicated_params = expert_params, replicated_params
        # the copies of replicated experts, read from the model's expert shards: summed in finish() (rebalance.py)
        self.copies = CopyFold(model, dims)

    def forward_backward(self, pipeline: Callable[[], StepStats], xs: list[torch.Tensor], ys: list[torch.Tensor],
                         aux_weight: float, forward_ctx: Callable, docs: list | None = None,
                         weights: list[float] | None = None) -> StepStats:
        """This rank's forwards and backwards of the step's microbatches xs, ys (parallel/step.py): `pipeline()`
        runs them through the stage's schedule, which calls `prepare` before each backward."""
        return pipeline()

    def prepare(self, sync: bool) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def param_groups(self) -> list[dict]:
        return tag_groups((tag_of(q), q) for q in self.model.parameters())

    def clip(self, max_norm: float) -> torch.Tensor:
        """Whole gradients: expert shards summed over EP and PP, replicated ones over PP (clip.py)."""
        return clip_grad_norm_([p for _, p in self.expert_params], [p for _, p in self.replicated_params],
                               max_norm, self.dims.group("pp"), self.dims.group("ep"),
                               token_ranks=token_ranks(self.dims), counted_elsewhere=self.counted_elsewhere())

    def counted_elsewhere(self) -> list[torch.Tensor]:
        """After finish(): views of this rank's gradient rows that another rank holds too and counts in the global
        norm: the extra copies of replicated experts, as each expert tensor's `grad_layout` names them (shard.py), in
        this rank's pieces (`grad_pieces`), param by param, row by row."""
        rows = {n: grad_layout(q).copies.extra_rows() for n, q in self.expert_params
                if grad_layout(q).copies is not None}
        rows = {n: r for n, r in rows.items() if r}
        pieces = self.grad_pieces(set(rows)) if rows else {}
        return [t[s - off[0]] for n, r in rows.items() if n in pieces for off, t in pieces[n].boxes
                for s in r if off[0] <= s < off[0] + t.shape[0]]

    def after_step(self) -> None:
        pass

    def local_grad(self, p: nn.Parameter) -> torch.Tensor:
        """Whole gradients: p's .grad itself."""
        return p.grad

    def sharded_state(self, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
        return replicated_pieces(self.model, optimizer)

    def state_boxes(self, names: set[str], peer: int) -> dict[str, list[tuple]]:
        """{name: [(offsets, sizes)]}: where `peer` (a global rank of this stage) holds each named param's
        optimizer state, in the param's own coordinates (its TP slice, its local experts), by this rank's sharding
        rule alone: every rank of a stage builds the same buckets and FSDP units. `sharded_state`'s boxes on that
        rank, nothing exchanged (optim/geometry.py). Whole here."""
        return {n: [((0,) * q.dim(), tuple(q.shape))] for n, q in self.model.named_parameters() if n in names}

    def grad_pieces(self, names: set[str]) -> dict[str, Pieces]:
        """After finish(): {name: this rank's Pieces of the averaged gradient} of the named params, views of live
        storage (expert placement sums a replicated expert's copies in them, parallel/rebalance.py). Whole here."""
        return {n: Pieces.whole(p.grad) for n, p in self.model.named_parameters() if n in names and p.grad is not None}

    grads_whole = True  # grad_pieces are whole on every DP replica (else disjoint over the stage's ranks)

    def close(self) -> None:
        pass


class BucketedSync(GradSync):
    """A flavour whose work is one bucketed reducer per gradient group (`self.reducers`, built by the subclass:
    Reducers at zero 0, ShardedReducers at zero 1/2), each following the Reducer's per-step protocol."""
    reducers: list

    def prepare(self, sync: bool) -> None:
        for r in self.reducers:
            r.prepare(sync)

    def finish(self) -> None:
        for r in self.reducers:
            r.finish()

    def zero_grad(self) -> None:
        for r in self.reducers:
            r.zero_grad()


class ReplicatedSync(BucketedSync):
    """zero 0: one bucketed Reducer per gradient group (replicated params over non-expert-DP, expert shards
    over expert-DP), each launching its all-reduces during the final backward."""

    def __init__(self, model, dims, expert_params, replicated_params, bucket_mb: float, scale: float,
                 reduce_dtype: torch.dtype | None = None):
        super().__init__(model, dims, expert_params, replicated_params)
        groups = gradient_groups(expert_params, replicated_params)
        self.reducers = [Reducer(params, dims.group(kind), bucket_mb, scale, reduce_dtype) for params, kind in groups]
        self.expert_reducers = [r for r, (_, kind) in zip(self.reducers, groups) if kind == "expert_dp"]

    def prepare(self, sync: bool) -> None:
        if sync:  # after a placement change, before any bucket of the final backward launches
            rows = self.copies.skip()
            if rows is not None:
                self.skip_rows(rows)
        super().prepare(sync)

    def finish(self) -> None:
        """The DP reduction; a replicated expert's copies are folded over copies x DP around it: the fold's first
        moves posted behind the buckets still on the wire, its last after them (rebalance.py `CopyFold`)."""
        folding = self.copies.start(self)
        super().finish()
        self.copies.finish(folding)

    def launch_rest(self) -> None:
        """The final backward's buckets all on the wire, none waited for (`Reducer.launch_rest`): the replicated
        experts' fold starts behind them (parallel/rebalance.py)."""
        for r in self.reducers:
            r.launch_rest()

    def skip_rows(self, rows: dict[str, list[int]]) -> None:
        """Leave rows[name] (dim 0) of these expert params out of the DP reduction from now on (scaled as the rest):
        the copies' fold reduces them (`CopyFold.skip`)."""
        found = set().union(*(r.skip_rows(rows) for r in self.expert_reducers))
        missing = {n for n, s in rows.items() if s} - found
        assert not missing, f"skip_rows: {sorted(missing)} are not expert params of this rank's reducers"


class TorchDDPSync(GradSync):
    """torch DDP over the non-expert-DP group: a baseline for pure DP (config refuses it with PP or EP, where
    DDP's average over its group is not docs/design.md §4's). DDP decides in each *forward* whether the backward
    syncs (`no_sync()`), so it runs its own microbatch loop (`forward_backward`); prepare/finish have nothing to do."""

    def __init__(self, model, dims, expert_params, replicated_params, bucket_mb: float):
        super().__init__(model, dims, expert_params, replicated_params)
        self.ddp = wrap_ddp(model, dims.group("non_expert_dp"), bucket_mb)

    def forward_backward(self, pipeline, xs, ys, aux_weight: float, forward_ctx, docs: list | None = None,
                         weights: list[float] | None = None) -> StepStats:
        """No pipeline (pure DP): each microbatch through the DDP wrapper, no_sync on all but the last."""
        t0, M = time.perf_counter(), len(xs)
        ce_sum = aux_sum = mtp_sum = None
        for i, (x, y, d) in enumerate(zip(xs, ys, docs or [None] * M)):
            with contextlib.nullcontext() if i == M - 1 else self.ddp.no_sync():
                with forward_ctx():
                    ce, aux, *mtp = self.ddp(x, y, d)  # mtp: [its weighted loss] with the MTP modules (model/mtp.py)
                ce = ce if weights is None else ce * weights[i]  # masked targets: the global count's share
                objective = ce + mtp[0] if mtp else ce
                ((objective + aux_weight * aux) / M).backward()
            ce_sum = ce.detach() if ce_sum is None else ce_sum + ce.detach()
            aux_sum = aux.detach() if aux_sum is None else aux_sum + aux.detach()
            if mtp:
                mtp_sum = mtp[0].detach() if mtp_sum is None else mtp_sum + mtp[0].detach()
        wall = time.perf_counter() - t0
        return StepStats(ce_sum=ce_sum, aux_sum=aux_sum, wall_s=wall, p2p_wait_s=0.0, compute_s=wall,
                         max_in_flight=1, mtp_sum=mtp_sum)

    def prepare(self, sync: bool) -> None:
        pass

    def finish(self) -> None:
        pass  # DDP waited for its all-reduces at the end of the final backward

    def zero_grad(self) -> None:
        for q in self.model.parameters():
            if q.grad is not None:
                q.grad.zero_()  # never None: DDP's gradient-as-bucket-view keeps them bound

    def close(self) -> None:
        self.ddp = None  # DDP must go before the process group (the baselines: SIGABRT at exit otherwise)


def zero_memory_choices(zero: int, pp: int, schedule: str, accumulate: str = "auto",
                        reshard: str = "auto") -> tuple[str, str]:
    """(parallel.zero_accumulate, parallel.zero3_reshard) with "auto" made concrete: the one rule, for the job's
    config (resolve.py; parallelize.py reads it) and the planner (plan/memory.py). Measured in docs/dp.md
    ("Peak memory").

    zero3_reshard auto: "always" without PP; with PP "never", as torchtitan: its schedules run several microbatches'
    forwards before their backwards, so re-gathering per microbatch costs 2M all-gathers of the stage per step.
    zero_accumulate auto: "shard", except zero 2 under the interleaved schedule (each chunk's backward would
    reduce-scatter every bucket of the rank, V times the traffic) and zero 3 that keeps its params gathered
    ("never": a rank has room for the stage's full params all step, so it keeps its full gradients too and
    reduce-scatters once per step, as torch.distributed.pipelining does)."""
    if reshard == "auto":
        reshard = "always" if pp == 1 else "never"
    if accumulate == "auto":
        if zero == 2:
            accumulate = "full" if pp > 1 and schedule == "interleaved" else "shard"
        else:
            accumulate = "full" if zero < 2 or reshard == "never" else "shard"
    return accumulate, reshard


def gradient_groups(expert_params: NamedParams, replicated_params: NamedParams) -> list[tuple[NamedParams, str]]:
    """(params, the ParallelDims group their gradients are reduced over), skipping an empty side. Under tensor
    parallel, a replicated param whose TP ranks hold partial gradients (shard.py: `Grad.PARTIAL`) is summed over the
    whole stage (DP x EP x TP) instead: the same average over DP x EP, of the TP sum."""
    lies = {id(q): grad_layout(q).kind for _, q in replicated_params}
    split = [(n, q) for n, q in replicated_params if lies[id(q)] is Grad.SHARDED]  # TP slices (none at tp = 1)
    whole = [(n, q) for n, q in replicated_params if lies[id(q)] in (Grad.ALONE, Grad.WHOLE)]
    partial = [(n, q) for n, q in replicated_params if lies[id(q)] is Grad.PARTIAL]
    # one group per kind of TP replication, so that each reducer's shards are all of one kind (ZeroSync.clip)
    return [(params, kind) for params, kind in ((whole, "non_expert_dp"), (split, "non_expert_dp"),
                                                (partial, "stage"), (expert_params, "expert_dp")) if params]
