"""RankData under model.attn_mask=doc (run/setup.py): each microbatch's document starts come from its whole windows,
also when the rank keeps only its CP chunks' positions, from the indexed loader and from the streaming one alike."""

import torch

from nanotitan.data.indexed import columns
from nanotitan.model.docs import doc_starts
from nanotitan.parallel.cp import chunk_runs
from nanotitan.parallel.dims import ParallelDims
from nanotitan.run.setup import RankData


class Windows:
    """The loaders' interface RankData reads: windows (x, y) of `b` rows, of each only the positions `runs`."""

    def __init__(self, x, y):
        self.x, self.y, self.asked = x, y, []

    def rank_batch(self, step, B, data_rank, b, runs=None):
        self.asked.append(runs)
        cols = torch.from_numpy(columns(runs)) if runs else torch.arange(self.x.shape[1])
        return self.x[:, cols], self.y[:, cols]


def test_document_starts_come_from_whole_windows_under_cp():
    g = torch.Generator().manual_seed(0)
    window = torch.randint(0, 6, (4, 17), generator=g)  # EOT = 1: documents of a few tokens
    x, y = window[:, :-1], window[:, 1:]
    dims = ParallelDims(1, 1, 1, rank=1, cp=2)  # CP rank 1 of 2: chunks 1 and 2 of 4
    runs = chunk_runs(1, 2, 16)
    cols = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11])
    for stream in (None, iter([(x, y)])):
        loader = Windows(x, y)
        data = RankData(loader, None, stream, dims, runs, 4, 2, torch.device("cpu"), {}, eot=1)
        xs, ys, ds = data.batch(0)
        assert loader.asked == ([None] if stream is None else [])  # documents: the whole windows are read
        assert torch.equal(torch.cat(xs), x[:, cols]) and torch.equal(torch.cat(ys), y[:, cols])
        assert torch.equal(torch.cat(ds), doc_starts(x, 1))  # the whole windows' starts (B, S)
    causal = RankData(Windows(x, y), None, None, dims, runs, 4, 2, torch.device("cpu"), {})
    xs, _, ds = causal.batch(0)
    assert torch.equal(torch.cat(xs), x[:, cols]) and ds == [None, None]
