"""The placement rule (parallel/placement.py): pure functions of a window's counts; and the gradient sync of
replicated experts at zero 0 (the Reducer's skipped rows, the Rebalancer's fold over copies x DP) on 4 ranks."""

import pytest
import torch

from nanotitan.model.moe import pack_expert_major
from nanotitan.parallel.dp.sync import Pieces
from nanotitan.parallel.placement import Placement, balanced, choose, dp_shares, identity, slot_ids, sticky, water_fill


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


# --- the gradient sync of replicated experts (zero 0: rebalance.Rebalancer._fold and Reducer.skip_rows) ---------------
# DP2 x EP2. EP2 with E 4, L 2, one spare column: expert 3 replicated in column 2 on both EP ranks, rank 1's slot 1
# empty. Rank g (global) contributes 2**g to every element: the sum over the 4 ranks is 15, over one DP pair 1+4 or
# 2+8, and a copy missing (or counted twice) gives another number. The shares are water-filled (one copy gets none).
FOLD_SLOTS = ((0, 1, 3), (2, -1, 3))


def _fold_world4(rank, world, early=False):
    import torch.distributed as dist
    import torch.nn as nn

    from nanotitan.parallel.dims import ParallelDims
    from nanotitan.parallel.dp.reducer import Reducer

    dims = ParallelDims(2, 1, 2, rank=rank).build_groups()
    me = dims.moe_ep_rank
    w = nn.Parameter(torch.zeros(3, 5, 3))  # rows of 15: EP rank 1 (one single expert, rank 0 two) takes all
    reducer = Reducer([("experts.w", w)], dims.group("expert_dp"), 1.0, 0.5)
    skipped = [s for s, e in enumerate(FOLD_SLOTS[me]) if e < 0 or e == 3]
    assert reducer.skip_rows({"experts.w": skipped}) == {"experts.w"}
    reducer.zero_grad()
    reducer.prepare(sync=True)
    (w * 2.0 ** rank).sum().backward()  # d/dw = 2**rank everywhere (the empty slot too: a test of the skip alone)
    rb = _replica_sum(dims, w, reducer)
    if early:  # as train.py runs it: the fold's first moves while the DP buckets are still on the wire
        rb.start_replica_sum()
    reducer.finish()
    g = w.grad
    pair = sum(2.0 ** r for r in dist.get_process_group_ranks(dims.group("expert_dp")))
    home = [s for s in range(3) if s not in skipped]
    assert torch.equal(g[home], torch.full_like(g[home], 0.5 * pair)), "a kept row is not the scaled DP sum"
    assert torch.equal(g[skipped], torch.full_like(g[skipped], 0.5 * 2.0 ** rank)), "a skipped row was reduced"

    dup = rb.sum_replica_grads()
    assert torch.equal(g[2], torch.full_like(g[2], 0.5 * 15)), f"copy on EP rank {me}: {g[2].unique()}, want 7.5"
    assert torch.equal(g[home], torch.full_like(g[home], 0.5 * pair)), "the fold touched a row of no copy"
    assert dup.item() == ((0.5 * 15) ** 2 * 15 if me == 1 else 0.0), dup  # EP rank 1's copy, once (its own part)
    return g.numpy()


def _replica_sum(dims, w, reducer):
    """A Rebalancer for the replica sum alone: a stage of one MoE layer, no trainer."""
    from types import SimpleNamespace

    import torch.nn as nn

    from nanotitan.parallel.rebalance import Rebalancer

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.Module()
            self.experts.w = w
            self.layers = {"0": SimpleNamespace(moe=SimpleNamespace(dispatcher=SimpleNamespace(
                placement=Placement(FOLD_SLOTS, 4))))}

    sync = SimpleNamespace(grads_whole=True, grad_pieces=lambda names: {n: Pieces.whole(w.grad) for n in names},
                           launch_rest=reducer.launch_rest)
    rb = Rebalancer.__new__(Rebalancer)
    rb.shard, rb.R, rb.keys, rb.names, rb.folded, rb._pending = SimpleNamespace(dims=dims, model=Model(), sync=sync), \
        2, ["0"], {"0": ["experts.w"]}, True, None
    rb.cuts = rb._dp_shares()  # what Rebalancer._skip makes at each placement change
    return rb


@pytest.mark.parametrize("early", [False, True], ids=["after-sync", "started-behind-buckets"])
def test_fold_sums_every_copy_once_world4(early):
    from tests.helpers.mp import run_ranks

    grads = run_ranks(_fold_world4, 4, (early,), timeout=120)
    assert all((grads[0][2] == g[2]).all() for g in grads), "the copies' gradients differ"


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
