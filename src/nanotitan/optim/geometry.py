"""Every stage rank's pieces of every Muon matrix, computed on each rank from the sharding rules: nothing exchanged.

The owner map (owners.py) needs each rank's boxes of each matrix. Where a rank holds each element of a global
tensor is parallel/where.py's answer (`held_boxes`: the DP shard of the sync's flavour, the TP slice, the expert
slots), the one the checkpoint's keys read too (state/keys.py), so each rank computes the same geometry without an
all_gather_object (which unpickles what a peer sends) and on the dry run's fake ranks, which cannot exchange Python
objects. The Orthogonalizer checks the row for itself against its live pieces (a sync flavour whose `state_boxes`
drifted from its `sharded_state` fails there); tests/equivalence/test_equivalence_muon.py compares the whole
geometry with the all-gathered one on every layout of the Muon matrix.
"""

from __future__ import annotations

from ..model.families import tag_of
from ..parallel.where import held_boxes
from .muon import TAKES

Geometry = tuple[dict[str, tuple], list[dict[str, list[tuple]]]]  # ({key: whole shape}, per stage rank: boxes)


def stage_geometry(shard) -> Geometry:
    """({Muon key: whole shape}, [rank i of the stage group: {key: [(offsets, sizes)]}]), keys as `shard_pieces`'s
    (an expert stack one key per global expert)."""
    names = {n for n, q in shard.model.named_parameters() if tag_of(q) in TAKES}
    shapes, geometry = {}, []
    for peer in shard.dims.group_ranks("stage"):  # the stage group's ranks, in its order
        held = held_boxes(shard, names, peer)
        shapes.update({k: shape for k, (shape, _) in held.items()})
        geometry.append({k: boxes for k, (_, boxes) in held.items()})
    return shapes, geometry


def shard_geometry(shard):
    """`Muon.geometry` of a ModelShard (`stage_geometry`; the optimizer argument is `Muon.pieces`' protocol)."""
    return lambda _opt: stage_geometry(shard)
