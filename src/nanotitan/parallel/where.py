"""Where each element of a global tensor lives, on any rank: the one reading that the checkpoint's keys
(state/keys.py: this rank's live pieces) and Muon's geometry (optim/geometry.py: every stage rank's boxes, computed
on each rank, nothing exchanged) both make.

A parameter, and each tensor of its optimizer state, is cut three ways before a rank holds its part:

    the DP shard    the gradient sync's flavour, in the param's own coordinates: `GradSync.sharded_state` (this
                    rank's live views) and `GradSync.state_boxes(names, rank)` (the same boxes for any stage rank)
    the TP slice    a SHARDED param is its TP rank's 1/n along dim (parallel/shard.py: `grad_layout(p).part`, and
                    `.at(rank)` for another rank's): its boxes sit shifted by that rank's slice in the whole tensor
    the experts     an expert stack [L, ...] is L global tensors, one key per expert: slot l on EP rank r holds
                    global expert `global_experts(model, name, r)[l]` (-1: an empty slot, no key)

`placed` applies the last two to a param's Pieces; `held_boxes` runs all three for any rank of the stage.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ..model.transformer import is_expert_param
from .dp.sync import Pieces
from .shard import GradLayout, grad_layout


def global_experts(model: torch.nn.Module, name: str, moe_ep_rank: int | None = None) -> Sequence[int]:
    """The global expert each slot of expert tensor `name` holds on EP rank `moe_ep_rank` (ParallelDims.moe_ep_rank;
    None: this model's own), -1 for an empty slot."""
    moe = model.get_submodule(name.rsplit(".", 2)[0])
    if moe.experts.slot_experts is not None:  # a placement moved them (parallel/rebalance.py): its table
        return moe.experts.slot_experts if moe_ep_rank is None else moe.dispatcher.placement.slots[moe_ep_rank]
    n = moe.experts.W_gate.shape[0]
    start = model.spec.expert_start if moe_ep_rank is None else moe_ep_rank * n
    return range(start, start + n)


def placed(model: torch.nn.Module, name: str, layout: GradLayout, pieces: Pieces,
           moe_ep_rank: int | None = None) -> dict[str, Pieces]:
    """{key suffix: Pieces in the global tensor} of `pieces` (param `name`'s, or one tensor of its state, in the
    param's own coordinates) on the rank whose slice `layout` is (parallel/shard.py: `grad_layout(p)`, this rank's;
    `.at(rank)` another's) and whose experts are EP rank `moe_ep_rank`'s (None: this model's own). The suffix is ""
    or, for an expert stack, f".{global expert}". A box is a live view, or a peer's box as its `Extent`."""
    if not pieces.size:  # a scalar (AdamW's step): whole, under the param's own key
        return {"": pieces}
    if (part := layout.part) is not None:  # a TP slice: shift its boxes by its rank's place
        dim, rank, n = part
        shift = rank * pieces.size[dim]
        size = list(pieces.size)
        size[dim] *= n
        pieces = Pieces(torch.Size(size), [(tuple(o + shift * (i == dim) for i, o in enumerate(off)), t)
                                           for off, t in pieces.boxes])
    if not is_expert_param(name):
        return {"": pieces}
    per_slot: dict[int, list] = {}
    for off, t in pieces.boxes:  # a box over slots [s0, s0 + n) is n boxes, one per slot
        for l in range(t.shape[0]):
            per_slot.setdefault(off[0] + l, []).append((tuple(off[1:]), t[l]))
    # the copies of a replicated expert hold identical boxes: one key, as every rank writes the same bits
    return {f".{e}": Pieces(pieces.size[1:], per_slot.get(slot, []))
            for slot, e in enumerate(global_experts(model, name, moe_ep_rank)) if e >= 0}


class Extent(tuple):
    """A box's sizes standing in for a tensor of that shape (a peer's box): `placed` reads a box's `.shape` and its
    rows, nothing allocated (the dry run computes thousands of them per rank)."""

    @property
    def shape(self) -> tuple:
        return tuple(self)

    def __getitem__(self, row: int) -> "Extent":  # one row of the box: its sizes less the first
        return Extent(tuple(self)[1:])


def held_boxes(shard, names: set[str], rank: int) -> dict[str, tuple[tuple, list[tuple]]]:
    """{global key: (whole shape, [(offsets, sizes)])} of the named params' optimizer state on global rank `rank`
    of this stage, from the sharding rules alone: every rank of a stage builds the same buckets and FSDP units,
    so any rank computes any other's (and the dry run's fake ranks, which cannot exchange Python objects)."""
    at = dataclasses.replace(shard.dims, rank=rank, groups={})
    named = dict(shard.model.named_parameters())
    out = {}
    for name, boxes in shard.sync.state_boxes(names, rank).items():
        q = named[name]
        pieces = Pieces(q.shape, [(off, Extent(sz)) for off, sz in boxes])
        for suffix, p in placed(shard.model, name, grad_layout(q).at(at.tp_rank), pieces, at.moe_ep_rank).items():
            out[name + suffix] = (tuple(p.size), [(tuple(o), tuple(t.shape)) for o, t in p.boxes])
    return out
