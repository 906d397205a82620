"""Which chunks each CP rank holds (parallel/cp_split.py, docs/cp.md "The split"): zigzag, and the split balanced over
a microbatch's documents, which every rank must compute alike and whose work per rank must be near the mean."""

import torch

from nanotitan.data.indexed import columns
from nanotitan.model.docs import doc_starts
from nanotitan.parallel.cp import chunk_runs, doc_columns
from nanotitan.parallel.cp_split import balanced, chunks_per_half, layout_of, rank_work, zigzag
from nanotitan.parallel.dims import ParallelDims


def mixed_window(S: int, seed: int, long: int = 8192, n_long: int = 1) -> torch.Tensor:
    """(1, S) token ids, EOT = 1: n_long documents of `long` tokens, the rest of documents under 1k (mean ~400)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [long] * n_long
    while sum(lengths) < S:
        lengths.append(int(torch.randint(16, 1000, (1,), generator=g)))
    order = torch.randperm(len(lengths), generator=g).tolist()
    x = torch.zeros(1, S, dtype=torch.long)
    at = 0
    for i in order:
        at += lengths[i]
        if at - 1 < S:
            x[0, at - 1] = 1
    return x


def test_zigzag_without_documents_is_chunks_i_and_2n_minus_1_minus_i():
    for n in (2, 4):
        for r in range(n):
            want = columns(chunk_runs(r, n, 64 * n)).tolist()
            assert zigzag(64 * n, n).positions(r).tolist() == want
            assert layout_of("docs", None, 64 * n, n).positions(r).tolist() == want
            # documents cut zigzag finer, the same positions
            assert zigzag(64 * n, n, 4).positions(r).tolist() == want


def test_balanced_layout_partitions_the_window_in_equal_shares_in_global_order():
    S, n = 16384, 4
    layout = balanced(doc_starts(mixed_window(S, 0), 1), n)
    assert len(layout.owner) == 2 * n * chunks_per_half(S, n) == 32 and layout.chunk == 512
    every = torch.cat([layout.positions(r) for r in range(n)])
    assert sorted(every.tolist()) == list(range(S))
    for r in range(n):
        pos = layout.positions(r)
        assert pos.numel() == S // n and bool((pos[1:] > pos[:-1]).all())  # local order is global order
    assert layout.owner != zigzag(S, n, 4).owner


def test_balanced_work_is_near_the_mean_where_zigzag_is_not():
    """90% of documents under 1k and one of 8k in a 16k window at CP4: the balanced split's slowest rank holds
    <= 1.05x the mean work; zigzag's (which balances tokens, not documents) much more."""
    S, n = 16384, 4
    for seed in range(3):
        starts = doc_starts(mixed_window(S, seed), 1)
        work_bal = rank_work(balanced(starts, n), starts)
        work_zz = rank_work(layout_of("zigzag", starts, S, n), starts)
        assert sum(work_bal) == sum(work_zz)
        mean = sum(work_bal) / n
        assert max(work_bal) / mean <= 1.05, (seed, work_bal)
        assert max(work_zz) / mean >= 1.2, (seed, work_zz)


def test_every_rank_reads_the_layout_the_model_places():
    """The loader's columns (each microbatch of m windows by its own layout) are the positions CPShard.place gives
    the model for the same starts; another microbatch may get another layout."""
    S, n, m = 4096, 2, 2
    starts = doc_starts(torch.cat([mixed_window(S, s, long=2048) for s in range(4)]), 1)
    for r in range(n):
        dims = ParallelDims(1, 1, 1, rank=r, cp=n)
        cols = doc_columns(dims, "docs", starts, m)
        for i, part in enumerate(starts.split(m)):
            want = balanced(part, n).positions(r)
            assert (cols[i * m:(i + 1) * m] == want).all()
        assert (doc_columns(dims, "zigzag", starts, m) == zigzag(S, n).positions(r)).all()
