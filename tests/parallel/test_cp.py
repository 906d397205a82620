"""Context parallel's layout, without processes: the rank identity with CP and its groups (parallel/dims.py), and the
positions each token rank holds (parallel/cp.py: chunks i and 2cp-1-i, split further by TP)."""

import itertools
from types import SimpleNamespace

import pytest

from nanotitan.data.indexed import columns
from nanotitan.model.tokens import LOCAL
from nanotitan.parallel.cp import CPShard, chunk_runs
from nanotitan.parallel.dims import ParallelDims

LAYOUTS = [(d, p, e, c, t) for d, p, e, c, t in itertools.product([1, 2], [1, 2], [1, 2], [1, 2, 4], [1, 2])]


@pytest.mark.parametrize("dp,pp,ep,cp,tp", LAYOUTS)
def test_identity_and_groups_with_cp(dp, pp, ep, cp, tp):
    """rank = (((dp*PP + pp)*EP + ep)*CP + cp)*TP + tp; each group varies exactly its axes (docs/cp.md's table)."""
    world = dp * pp * ep * cp * tp
    varies = {"tp": "t", "cp": "c", "ep": "ect", "pp": "p", "expert_dp": "d", "non_expert_dp": "dec", "stage": "dect"}
    coords = {}
    for r in range(world):
        d = ParallelDims(dp, pp, ep, rank=r, tp=tp, cp=cp)
        coords[r] = dict(zip("dpect", (d.dp_rank, d.pp_rank, d.ep_rank, d.cp_rank, d.tp_rank)))
        assert r == (((d.dp_rank * pp + d.pp_rank) * ep + d.ep_rank) * cp + d.cp_rank) * tp + d.tp_rank
        assert d.rank_of(*d.coords()) == r
        assert d.moe_ep == ep * cp * tp and d.moe_ep_rank == (d.ep_rank * cp + d.cp_rank) * tp + d.tp_rank
        assert d.data_rank == d.dp_rank * ep + d.ep_rank and d.data_world == dp * ep  # CP ranks read the same rows
    for kind, axes in varies.items():
        groups = ParallelDims(dp, pp, ep, tp=tp, cp=cp).all_group_ranks(kind)
        assert sorted(r for g in groups for r in g) == list(range(world)), kind
        for g in groups:
            fixed = [a for a in "dpect" if a not in axes]
            assert len({tuple(coords[r][a] for a in fixed) for r in g}) == 1, (kind, g)
            assert len(g) == len({tuple(coords[r][a] for a in axes) for r in g}), (kind, g)
            assert sorted(set(coords[r]["c"] for r in g)) == (list(range(cp)) if "c" in axes else [coords[g[0]]["c"]])
    # the CP x TP ranks of one (dp, pp, ep) are contiguous: they fill a node first
    assert ParallelDims(dp, pp, ep, tp=tp, cp=cp).all_group_ranks("ep")[0][:cp * tp] == list(range(cp * tp))


@pytest.mark.parametrize("cp,tp", [(1, 2), (2, 1), (2, 2), (4, 1), (4, 2), (2, 4)])
def test_token_ranks_partition_each_sequence(cp, tp):
    """Over CP x TP, the token ranks' `runs` cover every position of a sequence exactly once; a CP rank's `seq_runs`
    are chunks i and 2cp-1-i, and its TP ranks split them in local order."""
    S_whole = 32
    seen = []
    for c, t in itertools.product(range(cp), range(tp)):
        tp_part = SimpleNamespace(size=tp, rank=t, split_rank=t, split_size=tp, sp=True) if tp > 1 else LOCAL
        shard = CPShard(SimpleNamespace(rank=c, size=cp, group=None), tp_part, "ring")
        assert shard.size == cp * tp and shard.rank == c * tp + t
        S_cp = S_whole // cp
        assert columns(shard.seq_runs(S_cp)).tolist() == columns(chunk_runs(c, cp, S_whole)).tolist()
        positions = [p for s, n in shard.runs(S_cp // tp) for p in range(s, s + n)]
        local = [p for s, n in shard.seq_runs(S_cp) for p in range(s, s + n)]
        assert positions == local[t * (S_cp // tp):(t + 1) * (S_cp // tp)], (c, t)
        seen += positions
    assert sorted(seen) == list(range(S_whole))
    c = S_whole // (2 * cp)
    assert chunk_runs(0, cp, S_whole) == ([(0, S_whole)] if cp == 1 else [(0, c), ((2 * cp - 1) * c, c)])
