"""`nanotitan bench cp --part overlap`'s per-hop table (bench/cp.py hop_table), on hand-made per-rank records."""

import pytest

from nanotitan.bench.cp import format_hops, hop_table


def _rec(exposed, transfer, hops):
    return {"exposed_s": exposed, "transfer_s": transfer,
            "hops": [{"hop": h, "link_s": link, "queued_s": q, "exposed_s": e} for h, link, q, e in hops]}


@pytest.mark.timeout(30)
def test_hop_table_takes_the_worst_rank_of_each_repeat():
    """Per repeat the rank with the largest exposed / transfer gives the hops (so their shares sum to the headline
    ratio); min / median over repeats; the text table shows the medians."""
    ranks = [{"emulated": [_rec(1.0, 4.0, [("forward 1: K/V", 2.0, 0.0, 1.0), ("backward 1: dK|dV", 2.0, 0.0, 0.0)]),
                           _rec(0.0, 4.0, [("forward 1: K/V", 2.0, 0.0, 0.0), ("backward 1: dK|dV", 2.0, 0.0, 0.0)])]},
             {"emulated": [_rec(0.5, 4.0, [("forward 1: K/V", 2.0, 0.0, 0.5), ("backward 1: dK|dV", 2.0, 0.0, 0.0)]),
                           _rec(3.0, 4.0, [("forward 1: K/V", 2.0, 1.0, 2.0), ("backward 1: dK|dV", 2.0, 0.0, 1.0)])]}]
    t = hop_table(ranks, 2)
    assert list(t) == ["forward 1: K/V", "backward 1: dK|dV"]  # post order
    fwd, bwd = t["forward 1: K/V"], t["backward 1: dK|dV"]
    assert fwd["exposed_s"] == {"min": 1.0, "median": 1.5}  # rank 0 in repeat 0, rank 1 in repeat 1
    assert fwd["queued_s"] == {"min": 0.0, "median": 0.5}
    assert fwd["exposed_over_transfer"]["median"] == 0.375 and bwd["exposed_over_transfer"]["median"] == 0.125
    assert "forward 1: K/V                  2.000     0.500      1.500             0.375" in format_hops(t)
