"""train.compile keeps the equivalence rule (DESIGN §4): compiled blocks train what one UNcompiled process trains.

One process with compiled blocks, then one 8-rank launch of DP2·PP2·EP2 with compiled blocks under 1F1B with zero 3
(FSDP2 over compiled blocks) and activation checkpointing, and under zb1 (deferred weight gradients) with two EP
lanes, each held to
tests/helpers/equivalence.py's bar (losses per step to fp32 relative 1e-5, final parameters, replicas bitwise) against
one uncompiled process. Two blocks (one per stage), so each rank compiles one block's graphs; inductor's on-disk
cache serves the ranks and cases after the first. Rank 0's first record carries the compile time (`compile_s`).
"""

import pytest

from tests.helpers.mp import run_ranks, train_once
from tests.helpers.equivalence import base_args, check_case, layout_args, one_process

TWO = ("--model.n_layers", "2")
COMPILE = (*TWO, "--train.compile", "true", "--train.ckpt_at_end", "false")


@pytest.fixture(scope="module")
def reference_2(corpus_dir, tmp_path_factory):
    """One uncompiled process, two blocks, accumulating over all 8 microbatches."""
    return one_process(corpus_dir, tmp_path_factory, "ref2", extra=TWO)


def _run(rank, world, cases, corpus_dir, run_root):
    return [train_once(base_args(corpus_dir, f"{run_root}/{world}_{i}") + layout_args(*case))
            for i, case in enumerate(cases)]


@pytest.mark.slow  # the longest launches: CI's second tier (make test-slow)
def test_compiled_blocks_dp2_pp2_ep2(corpus_dir, tmp_path, tmp_path_factory, reference_2):
    # One process first: its row is the tightest check, and it fills inductor's on-disk cache with the block's
    # graphs, which the 8 ranks (one block each, the same shapes) then load instead of compiling them 8 times.
    check_case("compiled (1, 1, 1)", [one_process(corpus_dir, tmp_path_factory, "c1", extra=COMPILE)], reference_2)
    cases = [(2, 2, 2, "1f1b", (*COMPILE, "--parallel.zero", "3", "--train.activation_checkpointing", "true")),
             (2, 2, 2, "zb1", (*COMPILE, "--parallel.ep_overlap_microbatches", "true"))]
    results = run_ranks(_run, 8, args=(cases, str(corpus_dir), str(tmp_path)), timeout=600, pg_timeout=300)
    for i, case in enumerate(cases):
        ranks = [results[r][i] for r in range(8)]
        check_case(f"compiled {case}", ranks, reference_2)
        records = ranks[0]["records"]
        assert records[0]["compile_s"] > 0, f"{case}: nothing was compiled"
        assert all("compile_s" not in r for r in records[1:]), "compile_s belongs to the first record"
