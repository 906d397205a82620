"""Sharded DP keeps the equivalence rule (DESIGN §4): every zero level trains what one process trains.

parallel.zero 1, 2 (ShardedReducer) and 3 (FSDP2) x DP2, DP4, DP2*EP2, DP2*PP2 and DP2*PP2*EP2 run the real
trainer on real gloo processes for 10 steps with clipping and are held to tests/helpers/equivalence.py's bar
against its single-process reference: losses per step to fp32 relative 1e-5, final parameters (each rank's full
params: after the all-gather at zero 1/2, gathered from the shards at zero 3), replicas bitwise identical.

Both memory behaviours of zero 2 and 3 (docs/dp.md "Peak memory") are rows: `auto` gives zero 2 "shard"
(a reduce-scatter per bucket per microbatch, added into the shard) and zero 3 without PP "always" + "shard"
(params re-gathered around each module's forward and backward, gradients reduce-scattered per microbatch); under
PP zero 3's auto is "never" + "full", so its "always" + "shard" rows are explicit, as are zero 2 "full" and zero 3
"never" without PP. Zero 2 "shard" runs 1F1B, gpipe and zb1 (W delivers each microbatch's weight gradients);
zero 3 refuses zb1 and interleaved (config.validate). Activation checkpointing and periodic eval (a forward
between steps) ride along in two cases. One launch per world size runs all of its cases.
"""

import pytest

from tests.helpers.mp import run_ranks, train_once
from tests.helpers.equivalence import base_args, check_case, layout_args

NO_CKPT = ("--train.ckpt_at_end", "false")
FULL = ("--parallel.zero_accumulate", "full")  # zero 2/3: full gradients over the step, one reduce-scatter
SHARD = ("--parallel.zero_accumulate", "shard")
NEVER = ("--parallel.zero3_reshard", "never")  # zero 3: params gathered from the first forward to the last backward
ALWAYS = ("--parallel.zero3_reshard", "always")


def _run(rank, world, cases, corpus_dir, run_root):
    return [train_once(base_args(corpus_dir, f"{run_root}/{world}_{i}") + layout_args(*case))
            for i, case in enumerate(cases)]


def _cases(cells, ac=None):
    """(dp, pp, ep, schedule, zero, *extra args) cells -> trainer cases; `ac`: one more cell with activation
    checkpointing and an eval every 4 steps."""
    out = [(dp, pp, ep, schedule, ("--parallel.zero", str(zero), *NO_CKPT, *extra))
           for dp, pp, ep, schedule, zero, *extra in cells]
    if ac is not None:
        dp, pp, ep, schedule, zero = ac
        out.append((dp, pp, ep, schedule, ("--parallel.zero", str(zero), "--train.activation_checkpointing", "true",
                                           "--train.eval_every", "4", *NO_CKPT)))
    return out


def _every_zero(dp, pp, ep, schedule):
    return [(dp, pp, ep, schedule, zero) for zero in (1, 2, 3)]


# With PP, zero 1/2 meet the schedule only through prepare(sync) before each backward (zb1: before each W);
# zero 3 through FSDP's gradient-sync and reshard flags. The default tier runs each zero level's new memory
# behaviour under 1F1B, zero 2 under zb1, and zero 3's PP default ("never" + "full") under gpipe and 1F1B.
PP_CELLS = [("gpipe", 1), ("1f1b", 2), ("zb1", 2), ("gpipe", 3), ("1f1b", 3), ("1f1b", 3, *ALWAYS, *SHARD)]
PP_CELLS_SLOW = [("1f1b", 1), ("gpipe", 2), ("1f1b", 2, *FULL), ("gpipe", 3, *ALWAYS, *SHARD)]


def _matrix(world, cases, corpus_dir, tmp_path, reference, timeout):
    results = run_ranks(_run, world, args=(cases, str(corpus_dir), str(tmp_path)), timeout=timeout, pg_timeout=120)
    for i, case in enumerate(cases):
        check_case(f"{case}", [results[r][i] for r in range(world)], reference)


@pytest.mark.timeout(450)
def test_zero_world2(corpus_dir, tmp_path, reference):
    cells = _every_zero(2, 1, 1, "1f1b") + [(2, 1, 1, "1f1b", 2, *FULL), (2, 1, 1, "1f1b", 3, *NEVER)]
    _matrix(2, _cases(cells, ac=(2, 1, 1, "1f1b", 3)), corpus_dir, tmp_path, reference, timeout=400)


@pytest.mark.timeout(950)
def test_zero_world4(corpus_dir, tmp_path, reference):
    cells = _every_zero(4, 1, 1, "1f1b") + _every_zero(2, 1, 2, "1f1b") + [(2, 2, 1, *c) for c in PP_CELLS]
    cells += [(2, 1, 2, "1f1b", z, "--parallel.ep_overlap", "true") for z in (1, 3)]  # FSDP2 under the chunked trips
    _matrix(4, _cases(cells, ac=(2, 2, 1, "1f1b", 2)), corpus_dir, tmp_path, reference, timeout=900)


@pytest.mark.timeout(950)
def test_zero_world8(corpus_dir, tmp_path, reference):
    cells = [(2, 2, 2, *c) for c in PP_CELLS if c[0] != "gpipe"]
    _matrix(8, _cases(cells), corpus_dir, tmp_path, reference, timeout=900)


@pytest.mark.slow
@pytest.mark.timeout(1850)
def test_zero_pp_slow_tier(corpus_dir, tmp_path, reference):
    """The rest of the product: zero 1 under interleaved, zero 2 "shard" under interleaved (explicit: auto is
    "full" there), the gpipe cells at DP2*PP2*EP2, and zero 3 with a half-layer cut (FSDP2 wraps each block:
    here block 2's attention half and its MoE half separately)."""
    cells = [(2, 2, 1, *c) for c in PP_CELLS_SLOW]
    cells += [(2, 2, 1, "interleaved", 1, "--parallel.virtual_stages", "2"),
              (2, 2, 1, "interleaved", 2, "--parallel.virtual_stages", "2", *SHARD),
              (2, 2, 1, "1f1b", 3, "--parallel.pp_layers", "2.5,1.5")]  # FSDP2 on half blocks
    _matrix(4, _cases(cells), corpus_dir, tmp_path / "w4", reference, timeout=900)
    cells8 = [(2, 2, 2, *c) for c in PP_CELLS + PP_CELLS_SLOW if c[0] == "gpipe"]
    _matrix(8, _cases(cells8), corpus_dir, tmp_path / "w8", reference, timeout=900)
