"""The placement rule (parallel/placement.py): pure functions of a window's counts; the expert shard's routes; and the
gradient sync of replicated experts at zero 0 (the Reducer's skipped rows, CopyFold's fold over copies x DP, the
clip's count of the copies) on 4 ranks."""

import pytest
import torch

from nanotitan.model.moe import pack_expert_major
from nanotitan.parallel.placement import (EPShard, Placement, balanced, choose, dp_shares, identity, slot_ids, sticky,
                                          water_fill)


def test_identity_is_static():
    p = identity(8, 4, spare=1)
    assert p.slots == ((0, 1, -1), (2, 3, -1), (4, 5, -1), (6, 7, -1))
    assert p.replicated() == []
    assert p.imbalance([1.0] * 8) == 1.0


def test_balanced_replicates_a_hot_expert_in_one_spare_column():
    load = [400.0, 10, 10, 10, 10, 10, 10, 10]  # expert 0 alone is more than a rank's mean
    static, placed = identity(8, 4, 1), balanced(load, 4, spare=1, R=2)
    (e, column, ranks), = placed.replicated()
    assert e == 0 and column == 2 and len(ranks) == 2  # spare column s = L = 2, on two ranks
    assert all(placed.slots[p][column] == 0 for p in ranks)
    assert sorted(x for row in placed.slots for x in row if x >= 0) == [0, 0, 1, 2, 3, 4, 5, 6, 7]
    assert placed.imbalance(load) < static.imbalance(load)
    # without replicas a permutation is all it can do, and that cannot split expert 0
    assert balanced(load, 4).imbalance(load) == static.imbalance(load)


def test_balanced_lpt_spreads_cold_and_hot():
    load = [80.0, 70, 60, 50, 5, 5, 5, 5]  # static: ranks 0 and 1 hold the four hot experts
    placed = balanced(load, 4)
    assert placed.imbalance(load) == 85 / 70 < identity(8, 4).imbalance(load)  # the optimum: 80 + 5 on one rank
    assert all(len([e for e in row if e >= 0]) == 2 for row in placed.slots)  # every slot filled, 2 per rank
    assert {e for row in placed.slots for e in row} == set(range(8))


def test_choose_keeps_a_placement_that_is_good_enough():
    current = identity(8, 4, 1)
    assert choose(current, [10.0] * 8, R=2) is current  # a balanced router: no move
    assert choose(current, [400.0] + [10.0] * 7, R=2) != current


def test_route_cuts_each_microbatch_where_the_ranks_even_out():
    """Expert 0 has copies on both ranks (column 2); this microbatch it carries 10 assignments (6 from source 0, 4
    from source 1) and each rank's single experts carry 2, so the copies take 5 and 5, each source giving each copy
    its share of its own assignments (3 + 2 each: the same mix of near and far sources on every copy), in token
    order. Send and receive counts agree across the two ranks; drops go last."""
    pl = Placement(((1, 2, 0), (3, -1, 0)), 4)
    counts_PE = torch.tensor([[6, 1, 1, 0], [4, 0, 0, 2]])
    assert pl.rank_loads(counts_PE.sum(0).tolist()) == [7, 7]
    (send0, recv0, start0), (send1, recv1, start1) = pl.route(counts_PE, 0), pl.route(counts_PE, 1)
    assert send0 == [[1, 1, 3], [0, 0, 3]] and send1 == [[0, 0, 2], [2, 0, 2]]
    assert recv0 == [[1, 1, 3], [0, 0, 2]] and recv1 == [[0, 0, 3], [2, 0, 2]]
    assert start0[0].tolist() == [0, 3] and start1[0].tolist() == [0, 2]
    ids_TK = torch.tensor([[0], [0], [1], [0], [2], [0], [0], [0], [4]])  # source 0's; id 4 = dropped
    order_N, _, counts_E = pack_expert_major(ids_TK, 4)
    slots = slot_ids(ids_TK.reshape(-1), order_N, counts_E, pl.tables("cpu"), start0)
    assert slots.tolist() == [2, 2, 2, 5, 5, 5, 0, 1, 6]  # global slots p*C + s; the dropped one past them all
    assert (order_N[:6]).tolist() == [0, 1, 3, 5, 6, 7]  # expert 0's tokens in order: 0, 1, 3 to rank 0
    # the cut follows the microbatch: the same placement, expert 0 cold and expert 1 hot, puts expert 0 where it fits
    assert pl.rank_loads([4, 6, 0, 0]) == [6, 4]


def test_expert_shard_routes_as_the_placement_says():
    """The static placement is the identity one: its routes are the static count exchange's (send_PL[p][l]: mine to
    rank p's expert l; recv_PL[q][l]: source q's to my expert l), and expert-major is already the send order. A
    placement without copies routes each expert's column whole (what `Placement.route` gives, without its cuts);
    the copies' and empty slots' rows, and a swap, are the gradient sync's to read."""
    counts_PE = torch.tensor([[3, 0, 2, 5, 1, 1, 0, 4], [0, 2, 2, 1, 6, 0, 3, 3]])
    for me in (0, 1):
        shard = EPShard(identity(8, 2, spare=1), me)
        route = shard.route(counts_PE)
        assert route.send == [counts_PE[me, 0:4].tolist() + [0], counts_PE[me, 4:8].tolist() + [0]]
        assert route.recv == [counts_PE[q, 4 * me:4 * me + 4].tolist() + [0] for q in (0, 1)]
        ids_TK = torch.tensor([[1, 6], [0, 7], [4, 8]])  # 8: dropped
        order_N, _, counts_E = pack_expert_major(ids_TK, 8)
        assert shard.slot_major(ids_TK, order_N, counts_E, route) is order_N
        assert shard.copy_rows() == [4] and shard.extra_rows() == []  # the empty spare
    moved = Placement(((5, 2, 7, 0), (1, 4, 3, 6)), 8)  # single experts, out of order
    for me in (0, 1):
        shard = EPShard(moved, me)
        send, recv, _ = moved.route(counts_PE, me)
        assert (shard.route(counts_PE).send, shard.route(counts_PE).recv) == (send, recv)
    shard = EPShard(identity(4, 2, spare=1), 1)
    shard.swap(Placement(FOLD_SLOTS, 4))
    assert shard.moves == 1 and shard.copy_rows() == [1, 2] and shard.extra_rows() == [2]
    assert shard.experts_at(0) == (0, 1, 3) and EPShard(Placement(FOLD_SLOTS, 4), 0).extra_rows() == []


def test_balanced_keeps_copies_on_one_node_and_sticky_keeps_nodes():
    """Two nodes of two EP ranks: each hot expert's two copies on one node (the copies' gradient sum on the fast
    link), the two hot experts on different nodes; a relabelling never splits a node's copies."""
    nodes = [0, 0, 1, 1]
    load = [26, 4073, 3, 4090]  # a collapsed top-2 router
    placed = balanced(load, 4, spare=1, R=2, nodes=nodes)
    reps = {e: ranks for e, _, ranks in placed.replicated()}
    assert set(reps) == {1, 3} and {tuple(nodes[p] for p in r) for r in reps.values()} == {(0, 0), (1, 1)}
    assert placed.imbalance(load) < 1.01
    from nanotitan.parallel.placement import sticky
    moved = sticky(identity(4, 4, 1), balanced([4000, 30, 4000, 10], 4, spare=1, R=2, nodes=nodes), nodes)
    for e, _, ranks in moved.replicated():
        assert len({nodes[p] for p in ranks}) == 1, (e, ranks, moved.slots)
    assert choose(placed, load, R=2, nodes=nodes) is placed


def test_sticky_keeps_the_loads_and_moves_fewer_experts():
    from nanotitan.parallel.placement import sticky

    load = [10.0, 10, 10, 10, 10, 10, 400, 10]
    current = balanced([400.0] + [10.0] * 7, 4, spare=1, R=2)  # expert 0 replicated
    fresh = balanced(load, 4, spare=1, R=2)
    kept = sticky(current, fresh)
    assert sorted(kept.rank_loads(load)) == sorted(fresh.rank_loads(load))  # ranks relabelled: the same loads
    assert sorted(x for row in kept.slots for x in row) == sorted(x for row in fresh.slots for x in row)
    for e, column, ranks in kept.replicated():  # the copies still share one column
        assert all(kept.slots[p][column] == e for p in ranks)
    same = lambda p: sum(a == b >= 0 for ra, rb in zip(p.slots, current.slots) for a, b in zip(ra, rb))  # noqa
    assert same(kept) == 6 > same(fresh) == 1  # experts that stay in their (rank, slot) are not moved
    assert sticky(current, current) == current


def test_water_fill_and_dp_shares_even_out_the_dp_load():
    assert water_fill(15, [30, 15]) == [0, 15] and water_fill(16, [30, 15]) == [0, 16]
    assert water_fill(7, [0, 0, 0]) == [3, 2, 2] and water_fill(0, [5, 1]) == [0, 0] and water_fill(9, [4]) == [9]
    # EP4, E 4: experts 1 and 2 replicated in column 1; ranks 0 and 1 hold a single expert, 2 and 3 none
    pl = Placement(((0, 1), (3, 1), (-1, 2), (-1, 2)), 4)
    (shares,) = dp_shares([pl], [[10]], balance=True)
    assert shares == {1: [[0, 5, 10]], 2: [[0, 5, 10]]}  # every rank 10 + 5 or 0 + 5: rows split evenly
    pl = Placement(((0, 1), (3, 2), (-1, 1), (-1, 2)), 4)  # each copy beside a rank that holds a single expert
    (shares,) = dp_shares([pl], [[10, 4]], balance=True)
    assert shares == {1: [[0, 0, 10], [0, 0, 4]], 2: [[0, 0, 10], [0, 0, 4]]}  # the empty-home ranks take all
    (shares,) = dp_shares([pl], [[10, 4]], balance=False)
    assert shares == {1: [[0, 5, 10], [0, 2, 4]], 2: [[0, 5, 10], [0, 2, 4]]}


# --- the gradient sync of replicated experts (zero 0: rebalance.CopyFold inside ReplicatedSync.finish) ---------------
# DP2 x EP2. EP2 with E 4, L 2, one spare column: expert 3 replicated in column 2 on both EP ranks, rank 1's slot 1
# empty. Rank g (global) contributes 2**g to every element: the sum over the 4 ranks is 15, over one DP pair 1+4 or
# 2+8, and a copy missing (or counted twice) gives another number. The shares are water-filled (one copy gets none).
FOLD_SLOTS = ((0, 1, 3), (2, -1, 3))


def _fold_world4(rank, world):
    import torch.distributed as dist
    import torch.nn as nn

    from nanotitan.model.moe import MoE
    from nanotitan.parallel.dims import ParallelDims
    from nanotitan.parallel.dp.sync import ReplicatedSync
    from nanotitan.parallel.placement import EPShard

    dims = ParallelDims(2, 1, 2, rank=rank).build_groups()
    me = dims.moe_ep_rank
    model = nn.Module()  # one MoE layer whose expert tensors have rows of 15 (5 x 3): EP rank 1 takes all the shares
    model.moe = MoE(5, 3, 4, 1, True, 2 * me, 2 * me + 2, expert_shard=EPShard(Placement(FOLD_SLOTS, 4), me))
    experts = [(n, p) for n, p in model.named_parameters() if ".experts." in n]
    sync = ReplicatedSync(model, dims, experts, [], 1.0, 0.5)  # its fold reads the layer's expert shard
    sync.zero_grad()
    sync.prepare(sync=True)  # the copies' rows and the empty slot leave the DP reduction here
    sum((p * 2.0 ** rank).sum() for _, p in experts).backward()  # d/dp = 2**rank everywhere, the empty slot too
    sync.finish()  # the DP reduction, the fold's first moves posted behind its buckets, its last after them
    pair = sum(2.0 ** r for r in dist.get_process_group_ranks(dims.group("expert_dp")))
    home = [s for s, e in enumerate(FOLD_SLOTS[me]) if e >= 0 and e != 3]
    for n, p in experts:
        g = p.grad
        assert torch.equal(g[home], torch.full_like(g[home], 0.5 * pair)), f"{n}: a kept row is not the DP sum"
        assert torch.equal(g[2], torch.full_like(g[2], 0.5 * 15)), f"{n} copy on EP rank {me}: {g[2].unique()}"
        if me == 1:  # the empty slot: left out of the reduction (a zero gradient in a run), only scaled
            assert torch.equal(g[1], torch.full_like(g[1], 0.5 * 2.0 ** rank)), f"{n}: the empty slot was reduced"
    # the copy counts once in the norm: EP rank 1's is its extra one (its gradient layout says so)
    assert [v.data_ptr() for v in sync.counted_elsewhere()] == \
        ([p.grad[2].data_ptr() for _, p in experts] if me == 1 else [])
    # the global norm: every row of the EP group once, the copy by rank 0 (its first holder): rank 0's two homes and
    # its copy, rank 1's home and its empty slot; 3 tensors of rows of 15 elements
    rows = [2 * (0.5 * 5) ** 2, (0.5 * 15) ** 2, (0.5 * 10) ** 2, (0.5 * 2.0 ** (2 * dims.dp_rank + 1)) ** 2]
    want = 3 * 15 * sum(rows)
    norm = sync.clip(0.0)
    assert abs(norm.item() ** 2 - want) <= 1e-6 * want, (norm.item() ** 2, want)
    return model.moe.experts.W_gate.grad.numpy()


def test_fold_sums_every_copy_once_world4():
    """zero 0 at DP2·EP2: the gradient sync sums a replicated expert's copies over copies x DP inside its finish()
    (every copy the same bits), leaves the empty slot out of the reduction, and its clip counts the copy once."""
    from tests.helpers.mp import run_ranks

    grads = run_ranks(_fold_world4, 4, timeout=120)
    assert all((grads[0][2] == g[2]).all() for g in grads), "the copies' gradients differ"


@pytest.mark.serial  # bounds its wall time
def test_sticky_relabels_many_ranks_node_for_node_quickly():
    """Above 7 ranks the relabelling is greedy, node for node: 64 EP ranks in nodes of 8 (a replicated expert's
    copies on one node), in well under a second; a placement relabelled against itself stays as it is (no move)."""
    import random
    import time

    P, nodes = 64, [p // 8 for p in range(64)]
    load = [random.Random(e).randint(0, 1000) for e in range(128)]
    load[5] = 40000  # hot: replicated
    old = balanced(load, P, spare=1, R=8, nodes=nodes)
    t0 = time.perf_counter()
    again = sticky(old, balanced(load, P, spare=1, R=8, nodes=nodes), nodes)
    assert time.perf_counter() - t0 < 1.0
    assert again == old
    swap = [p + 8 if p < 8 else p - 8 if p < 16 else p for p in range(P)]  # nodes 0 and 1 trade places
    assert sticky(old, Placement(tuple(old.slots[swap[p]] for p in range(P)), 128), nodes) == old
    for e, _, ranks in old.replicated():
        assert len({nodes[p] for p in ranks}) == 1, (e, ranks)
