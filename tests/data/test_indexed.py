"""IndexedBatches: the batch of global step t is a fixed function of (seed, t, B, S); ranks take row slices of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanotitan.config.config import ConfigError
from nanotitan.data.indexed import IndexedBatches

N_TOKENS, S = 50_000, 16


@pytest.fixture
def token_file(tmp_path):
    # token i has id i % 60000: every window is a run of consecutive ids, so y == x + 1 checks the reads
    path = tmp_path / "train.bin"
    (np.arange(N_TOKENS) % 60_000).astype(np.uint16).tofile(path)
    return path


def test_windows_are_file_slices_and_y_is_x_shifted(token_file):
    x, y = IndexedBatches(token_file, "uint16", S, seed=3).global_batch(step=0, B=8)
    assert x.shape == y.shape == (8, S) and x.dtype == y.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y, x + 1)  # consecutive file tokens
    assert x.min() >= 0 and y.max() < N_TOKENS


def test_batch_depends_only_on_seed_step_and_shape(token_file):
    a = IndexedBatches(token_file, "uint16", S, seed=3)
    b = IndexedBatches(token_file, "uint16", S, seed=3)
    assert torch.equal(a.global_batch(5, 8)[0], b.global_batch(5, 8)[0])
    assert not torch.equal(a.global_batch(5, 8)[0], a.global_batch(6, 8)[0])
    other_seed = IndexedBatches(token_file, "uint16", S, seed=4)
    assert not torch.equal(a.global_batch(5, 8)[0], other_seed.global_batch(5, 8)[0])


def test_resuming_at_step_t_gives_the_batches_of_an_uninterrupted_run(token_file):
    run = IndexedBatches(token_file, "uint16", S, seed=11)
    sequential = [run.global_batch(t, 4) for t in range(12)]
    resumed = IndexedBatches(token_file, "uint16", S, seed=11)  # a fresh process, first call at step 7
    for t in (7, 8, 11, 0):
        assert all(torch.equal(u, v) for u, v in zip(resumed.global_batch(t, 4), sequential[t]))


def test_rank_slices_concatenate_to_the_global_batch(token_file):
    data = IndexedBatches(token_file, "uint16", S, seed=0)
    B, world = 12, 4
    b = B // world
    for step in (0, 9):
        x, y = data.global_batch(step, B)
        parts = [data.rank_batch(step, B, r, b) for r in range(world)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
        # microbatch i of rank r is rows [i*m, (i+1)*m) of the rank's rows
        m = 1
        assert torch.equal(data.rank_batch(step, B, 2, b)[0][1 * m:2 * m], x[2 * b + 1:2 * b + 2])


def test_cp_ranks_read_their_chunks_of_the_data_ranks_rows(token_file):
    """Context parallel: CP rank i reads chunks i and 2cp-1-i of each of its data rank's rows (inputs and targets);
    the CP ranks' reads put back in global order are the rows themselves, at every step (resume reads the same)."""
    from nanotitan.parallel.cp import chunk_runs

    data = IndexedBatches(token_file, "uint16", S, seed=0)
    B, b, cp = 8, 4, 2
    for step in (0, 3):
        x, y = data.rank_batch(step, B, 1, b)
        for i in range(cp):
            runs = chunk_runs(i, cp, S)
            cols = torch.cat([torch.arange(s, s + n) for s, n in runs])
            xi, yi = data.rank_batch(step, B, 1, b, runs)
            assert torch.equal(xi, x[:, cols]) and torch.equal(yi, y[:, cols]), (step, i)
            assert [data.eval_batches(1, B, 1, b, runs)[0][0].shape] == [(b, S // cp)]


def test_eval_batches_are_fixed_and_spread_over_the_file(token_file):
    val = IndexedBatches(token_file, "uint16", S, seed=0)
    first = val.eval_batches(3, 4)
    again = IndexedBatches(token_file, "uint16", S, seed=99).eval_batches(3, 4)  # seed-independent
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(first, again))
    starts = torch.cat([x[:, 0] for x, _ in first])
    assert starts[0] == 0 and starts[-1] == N_TOKENS - S - 1 and (starts.diff() > 0).all()
    half = val.eval_batches(3, 4, data_rank=1, b=2)
    assert all(torch.equal(h[0], f[0][2:4]) for h, f in zip(half, first))


def test_uint32_files_and_too_long_sequences(tmp_path):
    path = tmp_path / "big.bin"
    np.arange(100_000, 100_000 + 40, dtype=np.uint32).tofile(path)
    x, y = IndexedBatches(path, np.uint32, 8, seed=1).global_batch(0, 3)
    assert x.min() >= 100_000 and torch.equal(y, x + 1)
    with pytest.raises(ConfigError, match="train.seq_len=40"):
        IndexedBatches(path, np.uint32, 40, seed=1)
