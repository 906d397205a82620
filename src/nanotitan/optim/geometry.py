"""Every stage rank's pieces of every Muon matrix, computed on each rank from the sharding rules: nothing exchanged.

The owner map (owners.py) needs each rank's boxes of each matrix. A rank's boxes follow from its coordinates and
the rules that cut the state, which every rank of a stage applies to the same model:

    the DP shard       `GradSync.state_boxes(names, peer)`: whole (zero 0), the peer's flat slice of each ZeRO
                       1/2 bucket (its place in the reducer's group), its torch.chunk of FSDP2's Shard(dim)
    the TP slice       the peer's tp coordinate places it in the whole (`keyed_state`'s `tp_pieces` rule)
    the experts        the peer's slots hold the experts its layer's expert shard says (`held_experts` at its
                       moe_ep_rank: [moe_ep_rank * L, (moe_ep_rank + 1) * L) when static; the same table on every rank)

So each rank computes the same geometry, the one `keyed_state` gives on each rank (Orthogonalizer checks its own
against its live pieces every run), without an all_gather_object (which unpickles what a peer sends) and on the
dry run's fake ranks, which cannot exchange Python objects. tests/equivalence/test_equivalence_muon.py compares
it with the all-gathered one on every layout of the Muon matrix.
"""

from __future__ import annotations

import dataclasses

from ..model.families import is_muon
from ..model.transformer import held_experts, is_expert_param
from ..parallel.shard import grad_layout

Geometry = tuple[dict[str, tuple], list[dict[str, list[tuple]]]]  # ({key: whole shape}, per stage rank: boxes)


def _in_whole(q, boxes: list[tuple], tp_rank: int) -> tuple[tuple, list[tuple]]:
    """(the whole shape, the boxes in it) of boxes of q's TP slice held at tp coordinate `tp_rank`."""
    shape = list(q.shape)
    if (part := grad_layout(q).part) is None:
        return tuple(shape), boxes
    dim, _, n = part
    shift = tp_rank * shape[dim]
    shape[dim] *= n
    return tuple(shape), [(tuple(o + shift * (i == dim) for i, o in enumerate(off)), sz) for off, sz in boxes]


def stage_geometry(shard) -> Geometry:
    """({Muon key: whole shape}, [rank i of the stage group: {key: [(offsets, sizes)]}]), keys as `shard_pieces`'s
    (an expert stack one key per global expert)."""
    model, dims = shard.model, shard.dims
    named = {n: q for n, q in model.named_parameters() if is_muon(q)}
    shapes, geometry = {}, []
    for peer in dims.group_ranks("stage"):  # the stage group's ranks, in its order
        at = dataclasses.replace(dims, rank=peer, groups={})
        held = held_experts(model, at.moe_ep_rank)  # the peer's slots: each expert tensor's global experts
        boxes_of_peer = {}
        for name, local in shard.sync.state_boxes(set(named), peer).items():
            shape, boxes = _in_whole(named[name], local, at.tp_rank)
            if not is_expert_param(name):
                shapes[name], boxes_of_peer[name] = shape, boxes
                continue
            for slot, e in enumerate(held[name]):  # -1: an empty slot, no key
                if e >= 0:
                    shapes[f"{name}.{e}"] = shape[1:]
                    boxes_of_peer[f"{name}.{e}"] = [(off[1:], sz[1:]) for off, sz in boxes
                                                    if off[0] <= slot < off[0] + sz[0]]
        geometry.append(boxes_of_peer)
    return shapes, geometry


def shard_geometry(shard):
    """`Muon.geometry` of a ModelShard (`stage_geometry`; the optimizer argument is `Muon.pieces`' protocol)."""
    return lambda _opt: stage_geometry(shard)
