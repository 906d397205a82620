"""Muon's orthogonalization on any layout: each matrix whole on one rank, its slices back where they live.

Newton-Schulz needs whole matrices; a rank may hold a matrix whole (zero 0, an expert under EP), or only pieces of
it (zero 1/2's flat shards, zero 3's FSDP2 rows, TP's row or column slices, and their products). The pieces are the
checkpoint's (state/keys.py `keyed_state`: boxes at global offsets, an expert stack split per expert), so the plan
below is one rule for every layout:

    a matrix whole on some ranks     each of them orthogonalizes it (no traffic; replicas compute the same bits)
    a matrix only in pieces          one owner, chosen greedily by Newton-Schulz FLOPs over the ranks holding a
                                     piece of it (largest matrices first, each to the least-loaded holder: the
                                     balanced round robin), gathers one copy of every piece, orthogonalizes, and
                                     sends every holder its pieces back
Per step: one all-to-all over the stage's ranks gathers every owner's pieces, one sends the results back; each rank
orthogonalizes its matrices batched by shape (the experts of a layer are one batch). Each element travels to its
owner once and back once, the least any owner design moves. The geometry (every rank's boxes) is computed on
every rank from the sharding rules (geometry.py), nothing exchanged; the plan is made once (the first step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..parallel.comm import collectives as comm
from .newton_schulz import ns_flops, orthogonalize, rms_scale


@dataclass(frozen=True)
class Box:
    """One of this rank's pieces of matrix `key`: rows/cols [offsets, offsets + sizes), lying in the local tensor
    `base` at `storage_offset` (relative to that tensor's) with `stride`. Any tensor laid out as the momentum it was
    cut from (the gradient, holding the update) has the same box at the same place (`view`)."""
    key: str
    offsets: tuple[int, int]
    sizes: tuple[int, int]
    base: int
    storage_offset: int
    stride: tuple[int, int]

    def view(self, t: torch.Tensor) -> torch.Tensor:
        return t.as_strided(self.sizes, self.stride, t.storage_offset() + self.storage_offset)

    @property
    def region(self) -> tuple[slice, ...]:
        return region(self.offsets, self.sizes)


def region(offsets, sizes) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


def _storage_id(t: torch.Tensor) -> int:
    """A storage's identity (its StorageImpl, which views share), not data_ptr(): 0 for every fake tensor, and
    `nanotitan plan --dry-run` builds Muon too (observe/memory.py's storage_key, a floor up, is the same rule)."""
    return t.untyped_storage()._cdata


def boxes_of(pieces: dict, bases: list[torch.Tensor]) -> tuple[dict[str, tuple], list[Box]]:
    """({key: whole shape}, this rank's Boxes) from {key: (shape, [(offsets, view of a base)])}."""
    where = {_storage_id(b): i for i, b in enumerate(bases)}
    shapes, boxes = {}, []
    for key, (shape, views) in pieces.items():
        assert len(shape) == 2, f"{key}: Muon orthogonalizes 2-D matrices, got {tuple(shape)}"
        shapes[key] = tuple(shape)
        for off, v in views:
            if not v.numel():
                continue
            i = where[_storage_id(v)]
            boxes.append(Box(key, tuple(off), tuple(v.shape), i, v.storage_offset() - bases[i].storage_offset(),
                             tuple(v.stride())))
    return shapes, boxes


@dataclass
class Plan:
    """This rank's part of the orthogonalization, the same rule run on every rank over every rank's geometry."""
    computes: list[str] = field(default_factory=list)  # the matrices this rank orthogonalizes, in global order
    mine: dict[str, list[Box]] = field(default_factory=dict)  # this rank's boxes of each matrix
    gather_send: list[list[Box]] = field(default_factory=list)  # per peer: my boxes its owner needs
    gather_recv: list[list[tuple]] = field(default_factory=list)  # per peer: (key, offsets, sizes) it sends me
    scatter_send: list[list[tuple]] = field(default_factory=list)  # per peer: result boxes I send it
    scatter_recv: list[list[Box]] = field(default_factory=list)  # per peer: my boxes it fills
    traffic: bool = False  # any rank sends anything (the same on every rank)
    flops: list[int] = field(default_factory=list)  # per rank: Newton-Schulz FLOPs per step


def make_plan(shapes: dict[str, tuple], geometry: list[dict[str, list[tuple]]], me: int, mine: list[Box],
              steps: int) -> Plan:
    """`geometry[r]`: rank r's {key: [(offsets, sizes)]}; `shapes`: every key's whole shape (any rank's)."""
    world = len(geometry)
    plan = Plan(gather_send=[[] for _ in range(world)], gather_recv=[[] for _ in range(world)],
                scatter_send=[[] for _ in range(world)], scatter_recv=[[] for _ in range(world)], flops=[0] * world)
    for b in mine:
        plan.mine.setdefault(b.key, []).append(b)
    for v in plan.mine.values():
        v.sort(key=lambda b: b.offsets)
    keys = sorted(shapes)
    holders = {k: {r: sorted(g[k]) for r, g in enumerate(geometry) if g.get(k)} for k in keys}
    numel = {k: shapes[k][0] * shapes[k][1] for k in keys}
    whole = {k: [r for r, bs in holders[k].items() if sum(s[0] * s[1] for _, s in bs) == numel[k]] for k in keys}
    owner: dict[str, int] = {}
    for k in keys:  # whole somewhere: those ranks compute it; the first sends any partial holder its part
        if whole[k]:
            owner[k] = whole[k][0]
            for r in whole[k]:
                plan.flops[r] += ns_flops(*shapes[k], steps)
    for k in sorted((k for k in keys if not whole[k]), key=lambda k: (-ns_flops(*shapes[k], steps), k)):
        owner[k] = min(holders[k], key=lambda r: (plan.flops[r], r))  # the least-loaded holder
        plan.flops[owner[k]] += ns_flops(*shapes[k], steps)
    for k in keys:
        o = owner[k]
        if me in whole[k] or me == o:
            plan.computes.append(k)
        if not whole[k]:  # one copy of each piece to the owner (its own, or the first holder's)
            for off, sz in sorted({b for bs in holders[k].values() for b in bs}):
                src = o if (off, sz) in holders[k].get(o, ()) else min(r for r, bs in holders[k].items()
                                                                     if (off, sz) in bs)
                if src == o:
                    continue
                plan.traffic = True
                if me == src:
                    plan.gather_send[o].append(next(b for b in plan.mine[k] if (b.offsets, b.sizes) == (off, sz)))
                if me == o:
                    plan.gather_recv[src].append((k, off, sz))
        for r, bs in holders[k].items():  # every holder that does not compute it gets its pieces back
            if r == o or r in whole[k]:
                continue
            plan.traffic = True
            if me == o:
                plan.scatter_send[r] += [(k, off, sz) for off, sz in bs]
            if me == r:
                plan.scatter_recv[o] += plan.mine[k]
    return plan


def own_geometry(mine: list[Box]) -> dict[str, list[tuple]]:
    """{key: sorted [(offsets, sizes)]} of a rank's Boxes: its row of the geometry."""
    local: dict[str, list[tuple]] = {}
    for b in mine:
        local.setdefault(b.key, []).append((b.offsets, b.sizes))
    return {k: sorted(v) for k, v in local.items()}


def gathered_geometry(shapes: dict[str, tuple], local: dict[str, list[tuple]], group) -> tuple[dict, list]:
    """Every rank's (shapes, geometry row) by all_gather_object: the exchange `geometry.stage_geometry` replaces
    (a caller without the sharding rules, and the tests that compare the two)."""
    if group is None:
        return shapes, [local]
    world = dist.get_world_size(group)
    geometry, every = [None] * world, [None] * world
    dist.all_gather_object(geometry, local, group=group)
    dist.all_gather_object(every, shapes, group=group)
    return {k: s for g in every for k, s in g.items()}, geometry


class Orthogonalizer:
    """Replaces, in every Muon update tensor, each matrix's pieces by its orthogonalized, RMS-matched update.
    `geometry`: ({key: whole shape}, every group rank's {key: [(offsets, sizes)]}), computed by the caller from
    the sharding rules (optim/geometry.py; it must agree with this rank's own pieces); None: all-gathered."""

    def __init__(self, pieces: dict, bases: list[torch.Tensor], group, steps: int,
                 dtype: torch.dtype = torch.float32, geometry: tuple | None = None):
        shapes, mine = boxes_of(pieces, bases)
        self.group, self.steps, self.dtype = group, steps, dtype  # dtype: Newton-Schulz's (tests: bf16 as torch's)
        me = dist.get_rank(group) if group is not None else 0
        local = own_geometry(mine)
        if geometry is None:
            shapes, geometry = gathered_geometry(shapes, local, group)
        else:  # the rule's row for this rank is what it holds (a sync's state_boxes against its sharded_state):
            # a drift fails here, not as mismatched all-to-all sizes
            assert len(geometry[1]) == (dist.get_world_size(group) if group is not None else 1), "a row per rank"
            ruled = {k: sorted(v) for k, v in geometry[1][me].items() if v}
            bad = next((k for k in sorted({*ruled, *local, *shapes}) if ruled.get(k) != local.get(k)
                        or geometry[0].get(k) != shapes.get(k)), None)
            assert bad is None, (f"Muon geometry (parallel/where.py) disagrees with this rank's pieces of {bad}: "
                                 f"rule {ruled.get(bad)} of {geometry[0].get(bad)}, held {local.get(bad)} of "
                                 f"{shapes.get(bad)}")
            shapes, geometry = geometry
        self.geometry = (shapes, geometry)
        self.plan = make_plan(shapes, geometry, me, mine, steps)
        self.shapes = shapes
        # one Newton-Schulz batch per wide shape (s, l), s <= l: a tall matrix joins its transpose's batch, so MID's
        # 96 expert matrices (W_gate, W_val 256 x 512, W_out 512 x 256) are one bmm chain
        self.batches: dict[tuple[int, int], list[str]] = {}
        for k in self.plan.computes:
            self.batches.setdefault(tuple(sorted(shapes[k])), []).append(k)
        self.ns_s, self.calls = 0.0, 0  # Newton-Schulz seconds and steps so far (scripts/experiments/muon.py)

    def _exchange(self, send: list[torch.Tensor], recv_numel: list[int], like: torch.Tensor) -> list[torch.Tensor]:
        inp = torch.cat([t.reshape(-1) for t in send]) if send else like.new_empty(0)
        out = like.new_empty(sum(recv_numel))
        comm.all_to_all_single(out, inp, recv_numel, [t.numel() for t in send], group=self.group, axis="dp")
        return list(out.split(recv_numel))

    @torch.no_grad()
    def run(self, updates: list[torch.Tensor]) -> None:
        """`updates[i]`: the Nesterov update laid out as base i; each Box of it gets the scaled orthogonal update."""
        plan, like = self.plan, updates[0]
        stacks = {sl: like.new_empty((len(ks), *sl)) for sl, ks in self.batches.items()}
        wholes = {}  # each matrix a view of its batch (transposed if tall): pieces land where Newton-Schulz reads
        for sl, ks in self.batches.items():
            for k, x in zip(ks, stacks[sl]):
                wholes[k] = x if self.shapes[k] == sl else x.mT
        for k in plan.computes:
            for b in plan.mine.get(k, ()):
                wholes[k][b.region] = b.view(updates[b.base])
        if plan.traffic:
            send = [torch.cat([b.view(updates[b.base]).reshape(-1) for b in bs]) if bs else like.new_empty(0)
                    for bs in plan.gather_send]
            recv = self._exchange(send, [sum(s[0] * s[1] for _, _, s in rs) for rs in plan.gather_recv], like)
            for rs, flat in zip(plan.gather_recv, recv):
                for (k, off, sz), chunk in zip(rs, flat.split([s[0] * s[1] for _, _, s in rs])):
                    wholes[k][region(off, sz)] = chunk.view(sz)
        t0 = time.perf_counter()
        for sl, ks in self.batches.items():  # wide already: orthogonalize transposes nothing
            out = orthogonalize(stacks[sl], self.steps, self.dtype).mul_(rms_scale(*sl))
            for k, o in zip(ks, out):
                wholes[k] = o if self.shapes[k] == sl else o.mT
        self.ns_s, self.calls = self.ns_s + time.perf_counter() - t0, self.calls + 1
        for k in plan.computes:
            for b in plan.mine.get(k, ()):
                b.view(updates[b.base]).copy_(wholes[k][b.region])
        if plan.traffic:
            send = [torch.cat([wholes[k][region(off, sz)].reshape(-1) for k, off, sz in rs]) if rs
                    else like.new_empty(0) for rs in plan.scatter_send]
            recv = self._exchange(send, [sum(b.sizes[0] * b.sizes[1] for b in bs) for bs in plan.scatter_recv], like)
            for bs, flat in zip(plan.scatter_recv, recv):
                for b, chunk in zip(bs, flat.split([b.sizes[0] * b.sizes[1] for b in bs])):
                    b.view(updates[b.base]).copy_(chunk.view(b.sizes))
