"""parallel.ep_overlap_microbatches (two lanes: a forward beside another microbatch's backward; pp = 1, and PP2
under every schedule) trains the same model as one process, and bit for bit the same model as the run without the
lanes.

Harness and bar of tests/helpers/equivalence.py (the real trainer on real gloo processes, 10 steps, B = 16, m = 2):
each row against the single process (loss 1e-5 per step, final parameters), and against its twin without the lanes
in the same launch: every step's loss and every final parameter torch.equal (docs/ep.md says why no reduction
order changes). A unit test shows the lanes really ran at once: a forward and a backward overlapped in time.
"""

import pytest
import torch

from tests.helpers.mp import run_ranks
from tests.helpers.equivalence import _run_cases, check_case, one_process

LANES = ("--parallel.ep_overlap_microbatches", "true")
AC = ("--train.activation_checkpointing", "true")
ZERO = ("--train.ckpt_at_end", "false")  # sharded DP does not checkpoint (yet): config.validate refuses it
# capacity (drops) and aux-loss-free balancing (a router bias moved from the step's global counts)
BALANCE = ("--model.capacity_factor", "1.0", "--model.bias_update_rate", "0.01")


@pytest.fixture(scope="module")
def reference_balance(corpus_dir, tmp_path_factory):
    return one_process(corpus_dir, tmp_path_factory, "refb", BALANCE)


def _check_twins(cases, results, world, expected):
    """Each row with the lanes against the same row without them (in `cases`): losses, router biases and every
    final parameter bitwise."""
    twins = 0
    for i, case in enumerate(cases):
        extra = case[4]
        if LANES[0] not in extra:
            continue
        k = extra.index(LANES[0])
        twin = (*case[:4], extra[:k] + extra[k + 2:])
        if twin not in cases:
            continue
        twins += 1
        for r in range(world):
            a, b = results[r][i], results[r][cases.index(twin)]
            assert a["losses"] == b["losses"], f"{case} rank {r}: losses differ from {twin}"
            for name, bias in a["biases"].items():
                assert torch.equal(bias, b["biases"][name]), f"{case} rank {r}: router bias {name} differs"
            for name, (t, _) in a["params"].items():
                assert torch.equal(t, b["params"][name][0]), f"{case} rank {r}: {name} differs from {twin}"
    assert twins == expected, twins


def _matrix(world, cases, corpus_dir, tmp_path, ref, ref_balance, timeout, twins):
    results = run_ranks(_run_cases, world, args=(cases, str(corpus_dir), str(tmp_path)), timeout=timeout,
                        pg_timeout=120)
    for i, case in enumerate(cases):
        check_case(f"{case}", [results[r][i] for r in range(world)],
                   ref_balance if BALANCE[0] in case[4] else ref)
    _check_twins(cases, results, world, twins)


def test_world2_ep2_lanes(corpus_dir, tmp_path, reference, reference_balance):
    """EP2 (pp = 1, M = 4): the lanes with activation checkpointing off and on (the recompute's all-to-alls run in
    the backward lane, on its group), and with the chunked trips of parallel.ep_overlap inside each lane; capacity
    and the router bias with the lanes. Each bitwise its twin without the lanes. The grouped experts with capacity,
    the bias, recompute and the lanes, against the loop's one process."""
    cases = [(1, 1, 2, "1f1b", ()), (1, 1, 2, "1f1b", LANES),
             (1, 1, 2, "1f1b", AC), (1, 1, 2, "1f1b", AC + LANES),
             (1, 1, 2, "1f1b", AC + BALANCE), (1, 1, 2, "1f1b", AC + BALANCE + LANES),
             (1, 1, 2, "1f1b", ("--parallel.ep_overlap", "true") + LANES),
             (1, 1, 2, "1f1b", AC + BALANCE + LANES + ("--model.experts_impl", "grouped"))]
    _matrix(2, cases, corpus_dir, tmp_path, reference, reference_balance, timeout=300, twins=3)


def test_world4_dp2_ep2_lanes_zero(corpus_dir, tmp_path, reference, reference_balance):
    """DP2·EP2 (M = 2) with ZeRO-1 and ZeRO-2 (its reduce-scatters in the backward lane), capacity and the router
    bias on, activation checkpointing on ZeRO-2's: bitwise their twins without the lanes."""
    z1, z2 = ZERO + ("--parallel.zero", "1"), ZERO + ("--parallel.zero", "2")
    cases = [(2, 1, 2, "1f1b", z1 + BALANCE), (2, 1, 2, "1f1b", z1 + BALANCE + LANES),
             (2, 1, 2, "1f1b", z2 + AC + BALANCE), (2, 1, 2, "1f1b", z2 + AC + BALANCE + LANES)]
    _matrix(4, cases, corpus_dir, tmp_path, reference, reference_balance, timeout=300, twins=2)


@pytest.mark.slow  # the longest launches: CI's second tier (make test-slow)
@pytest.mark.timeout(720)
def test_world4_pp2_ep2_lanes(corpus_dir, tmp_path, reference):
    """PP2·EP2 (M = 4), one launch: 1f1b and zb1, activation checkpointing off and on (each lane's P2P on its own PP
    group, zb1's W's filling B's all-to-alls); gpipe (every forward first: the lanes add only the backwards' fill);
    interleaved (V = 2: each lane's P2P on the ring, PP2's one peer both ways), activation checkpointing off and on.
    Each row bitwise its twin without the lanes."""
    V2 = ("--parallel.virtual_stages", "2")
    cases = [(1, 2, 2, s, extra + lanes) for s in ("1f1b", "zb1") for extra in ((), AC) for lanes in ((), LANES)]
    cases += [(1, 2, 2, "gpipe", ()), (1, 2, 2, "gpipe", LANES)]
    cases += [(1, 2, 2, "interleaved", V2 + extra + lanes) for extra in ((), AC) for lanes in ((), LANES)]
    _matrix(4, cases, corpus_dir, tmp_path, reference, reference, timeout=700, twins=7)


@pytest.mark.slow  # the longest launches: CI's second tier (make test-slow)
def test_world8_dp2_pp2_ep2_lanes(corpus_dir, tmp_path, reference):
    """DP2·PP2·EP2 (M = 2; the default job's layout), activation checkpointing off and on: the DP Reducer's
    buckets in the backward lane beside the forward lane's traffic; each row bitwise its twin without the lanes."""
    cases = [(2, 2, 2, "1f1b", extra + lanes) for extra in ((), AC) for lanes in ((), LANES)]
    _matrix(8, cases, corpus_dir, tmp_path, reference, reference, timeout=500, twins=2)
