"""parallel/where.py: where each element of a global tensor lives, the one answer the checkpoint's keys
(state/keys.py) and Muon's geometry (optim/geometry.py) read. Here on one process: a TP slice's offset, the expert
slots' global ids (static, another EP rank's, and a placement's with an empty slot and a copy), and the peer form
(`held_boxes`) against this rank's live keys. The multi-rank agreement of the two is held by every Muon equivalence
row (tests/equivalence/test_equivalence_muon.py: the Orthogonalizer's own row, and the whole geometry against the
all-gathered one)."""

import torch

from nanotitan.model.spec import ModelShardSpec, build_chunk_specs
from nanotitan.model.transformer import Transformer
from nanotitan.optim.build import build_optimizer
from nanotitan.parallel.dims import ParallelDims
from nanotitan.parallel.dp.sync import Pieces
from nanotitan.parallel.parallelize import parallelize
from nanotitan.parallel.placement import EPShard, Placement, identity
from nanotitan.parallel.shard import Grad, GradLayout, grad_layout
from nanotitan.parallel.where import global_experts, held_boxes, placed
from nanotitan.state.keys import keyed_state
from tests.helpers.checkpoint import tiny_cfg

W = "layers.0.moe.experts.W_gate"


def _keys(out: dict) -> dict:
    return {k: (tuple(p.size), [(tuple(o), tuple(t.shape)) for o, t in p.boxes]) for k, p in out.items()}


def test_a_tp_slice_sits_at_its_rank_s_offset():
    """A SHARDED param's pieces shift by its TP rank's slice along its dim, in a whole n times as long: its own
    rank by default, another's when asked (a peer's geometry)."""
    model = Transformer(tiny_cfg().model, ModelShardSpec.full(tiny_cfg().model), 0)
    q, name = torch.zeros(6, 4), "layers.0.attn.q_proj.weight"
    layout = GradLayout(Grad.SHARDED, (1, 2, 3))  # rank 2 of 3 along dim 1
    pieces = Pieces(q.shape, [((1, 0), q[1:3]), ((3, 2), q[3:, 2:])])
    assert _keys(placed(model, name, layout, pieces)) == {"": ((6, 12), [((1, 8), (2, 4)), ((3, 10), (3, 2))])}
    assert _keys(placed(model, name, layout.at(0), pieces)) == {"": ((6, 12), [((1, 0), (2, 4)), ((3, 2), (3, 2))])}
    assert _keys(placed(model, name, grad_layout(q), pieces)) == _keys({"": pieces})  # untagged: ALONE, as held
    step = torch.zeros(())  # AdamW's step: whole, under the param's own key
    assert _keys(placed(model, name, layout, Pieces.whole(step))) == {"": ((), [((), ())])}


def test_expert_slots_are_global_experts_static_or_placed():
    """An expert stack is one key per global expert: EP rank r's slot l is expert r * L + l (this model's own from
    its spec), or under a placement the slot table's entry on any rank (-1: no key; a copy: the same key)."""
    cfg = tiny_cfg(num_experts=8).model
    spec = build_chunk_specs(tiny_cfg(layout=(1, 1, 2), num_experts=8), 0, 1)[0]  # EP rank 1 of 2: experts 4..7
    model = Transformer(cfg, spec, 0, experts=lambda layer: EPShard(identity(8, 2), 1))
    w = model.get_parameter(W)
    assert list(global_experts(model, W)) == [4, 5, 6, 7] and list(global_experts(model, W, 0)) == [0, 1, 2, 3]
    alone = grad_layout(w)
    out = _keys(placed(model, W, alone, Pieces(w.shape, [((1, 0, 0), w[1:3])])))  # a ZeRO-like box over slots 1, 2
    assert set(out) == {".4", ".5", ".6", ".7"} and out[".4"] == (tuple(w.shape[1:]), [])
    assert out[".5"] == out[".6"] == (tuple(w.shape[1:]), [((0, 0), tuple(w.shape[1:]))])
    table = Placement(((0, 3, -1, 3), (5, 1, 2, 4)), 8)  # toy slots: rank 0 holds 0 and 3 twice, one empty
    spec = build_chunk_specs(tiny_cfg(layout=(1, 1, 2), num_experts=8), 0, 0)[0]  # EP rank 0 of 2
    model = Transformer(cfg, spec, 0, experts=lambda layer: EPShard(identity(8, 2), 0))
    model.layers["0"].moe.expert_shard.swap(table)  # what a move does (parallel/rebalance.py)
    w = model.get_parameter(W)
    assert list(global_experts(model, W)) == [0, 3, -1, 3] and list(global_experts(model, W, 1)) == [5, 1, 2, 4]
    out = placed(model, W, alone, Pieces.whole(w))
    assert set(out) == {".0", ".3"} and torch.equal(out[".0"].boxes[0][1], w[0].detach())
    assert set(placed(model, W, alone, Pieces.whole(w), moe_ep_rank=1)) == {".5", ".1", ".2", ".4"}


def test_held_boxes_of_this_rank_are_its_live_keys():
    """`held_boxes` for this rank (the rules alone) names the keys, whole shapes and boxes of `keyed_state`'s live
    optimizer state: experts split per expert, every param of the stage."""
    cfg = tiny_cfg()
    shard = parallelize(cfg, ParallelDims(1, 1, 1), torch.device("cpu"))
    optimizer = build_optimizer(shard, cfg)
    names = {n for n, _ in shard.model.named_parameters()}
    live = {k[len("optim."):-len(".exp_avg")]: (tuple(c.shape), sorted((tuple(o), tuple(t.shape))
                                                                       for o, t in c.boxes.items()))
            for k, c in keyed_state(shard.model, optimizer, shard).items() if k.endswith(".exp_avg")}
    ruled = {k: (shape, sorted(boxes)) for k, (shape, boxes) in held_boxes(shard, names, 0).items()}
    assert ruled == live and f"{W}.3" in ruled
