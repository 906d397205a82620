"""The equivalence matrix (DESIGN §4): every DP x PP x EP layout trains the same model as one process.

Each layout runs the real trainer on real gloo processes for 10 steps at the same global batch
(B = 16 sequences, m = 2) and must match the single-process reference, which accumulates over the
same 8 microbatches (the `reference` fixture, tests/conftest.py: one run for every module that compares to it):
losses per step to fp32 relative 1e-5, final parameters (each rank against its slice), and replicas bitwise
identical to each other. Cases share process launches: one launch per
world size runs several layouts one after another.
"""

import pytest

from tests.helpers.mp import run_ranks
from tests.helpers.equivalence import _run_cases, check_case


def _matrix(world, cases, corpus_dir, tmp_path, reference, timeout):
    results = run_ranks(_run_cases, world, args=(cases, str(corpus_dir), str(tmp_path)), timeout=timeout,
                        pg_timeout=120)
    for i, case in enumerate(cases):
        check_case(f"{case}", [results[r][i] for r in range(world)], reference)


def test_world2_dp_pp_ep(corpus_dir, tmp_path, reference):
    cases = [(2, 1, 1), (2, 1, 1, "1f1b", ("--parallel.dp_impl", "torch_ddp")),
             (2, 1, 1, "1f1b", ("--parallel.bucket_mb", "1e-6")),  # one parameter per bucket
             (2, 1, 1, "1f1b", ("--parallel.bucket_mb", "1000")),  # everything in one bucket
             (1, 2, 1, "gpipe"), (1, 2, 1, "1f1b"),
             (1, 2, 1, "1f1b", ("--train.activation_checkpointing", "true")),
             (1, 2, 1, "1f1b", ("--model.n_layers", "4", "--parallel.pp_layers", "3,1")),
             (1, 1, 2), (1, 1, 2, "1f1b", ("--train.activation_checkpointing", "true"))]
    _matrix(2, cases, corpus_dir, tmp_path, reference, timeout=300)


def test_world4_compositions(corpus_dir, tmp_path, reference):
    cases = [(2, 2, 1, "gpipe"), (2, 2, 1, "1f1b"), (1, 2, 2, "gpipe"), (1, 2, 2, "1f1b"), (2, 1, 2),
             (4, 1, 1), (1, 4, 1, "1f1b"), (1, 1, 4)]
    _matrix(4, cases, corpus_dir, tmp_path, reference, timeout=400)


def test_world8_dp_pp_ep(corpus_dir, tmp_path, reference):
    cases = [(2, 2, 2, "gpipe"), (2, 2, 2, "1f1b")]
    _matrix(8, cases, corpus_dir, tmp_path, reference, timeout=400)


@pytest.mark.slow
def test_world8_slow_tier(corpus_dir, tmp_path, reference):
    cases = [(1, 4, 2, "1f1b"), (4, 1, 2), (2, 4, 1, "gpipe")]
    _matrix(8, cases, corpus_dir, tmp_path, reference, timeout=500)
