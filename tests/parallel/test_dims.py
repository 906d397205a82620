"""ParallelDims coordinate maths, checked exhaustively without processes."""

import itertools

import pytest

from nanotitan.parallel.dims import ParallelDims

SHAPES = [(d, p, e) for d, p, e in itertools.product([1, 2, 3, 4], [1, 2, 4], [1, 2, 4]) if d * p * e <= 32]


@pytest.mark.parametrize("dp,pp,ep", SHAPES)
def test_groups_partition_world(dp, pp, ep):
    world = dp * pp * ep
    for kind, size in (("ep", ep), ("pp", pp), ("expert_dp", dp), ("non_expert_dp", dp * ep)):
        groups = ParallelDims(dp, pp, ep).all_group_ranks(kind)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), kind  # every rank in exactly one group of each kind
        assert all(len(g) == size for g in groups), kind
    for r in range(world):
        d = ParallelDims(dp, pp, ep, rank=r)
        assert d.rank_of(*d.coords()) == r
        assert r == (d.dp_rank * pp + d.pp_rank) * ep + d.ep_rank
        assert d.data_rank == d.dp_rank * ep + d.ep_rank and d.data_world == dp * ep
        # group members share exactly the coordinates the group fixes
        assert all(ParallelDims(dp, pp, ep, rank=o).coords()[:2] == d.coords()[:2] for o in d.group_ranks("ep"))
        assert all(ParallelDims(dp, pp, ep, rank=o).coords()[::2] == d.coords()[::2] for o in d.group_ranks("pp"))
        assert all(ParallelDims(dp, pp, ep, rank=o).coords()[1:] == d.coords()[1:]
                   for o in d.group_ranks("expert_dp"))
        assert all(ParallelDims(dp, pp, ep, rank=o).pp_rank == d.pp_rank for o in d.group_ranks("non_expert_dp"))
        if d.next_pp_rank is not None:
            assert ParallelDims(dp, pp, ep, rank=d.next_pp_rank).coords() == (d.dp_rank, d.pp_rank + 1, d.ep_rank)
        assert (d.prev_pp_rank is None) == d.is_pp_first_stage
        assert (d.next_pp_rank is None) == d.is_pp_last_stage


def test_seed_2d_mappings():
    # DP+PP: r = dp_rank * PP + pp_rank
    for r in range(8):
        d = ParallelDims(4, 2, 1, rank=r)
        assert (d.dp_rank, d.pp_rank) == (r // 2, r % 2)
    # PP+EP: r = pp_rank * EP + ep_rank; stage 0 = ranks (0, 1), PP links 0<->2 and 1<->3
    d = ParallelDims(1, 2, 2)
    assert d.all_group_ranks("ep") == [[0, 1], [2, 3]]
    assert d.all_group_ranks("pp") == [[0, 2], [1, 3]]
    # DP+EP: non-expert DP group is the whole world, expert-DP groups fix ep_rank
    d = ParallelDims(2, 1, 2)
    assert d.all_group_ranks("non_expert_dp") == [[0, 1, 2, 3]]
    assert d.all_group_ranks("expert_dp") == [[0, 2], [1, 3]]


def test_bad_layout_is_clear():
    with pytest.raises(ValueError, match="parallel.pp=0"):
        ParallelDims(1, 0, 1)
    with pytest.raises(ValueError, match="outside world"):
        ParallelDims(2, 1, 1, rank=2)
