"""The default loader: data by global index (docs/design.md §4).

The B sequences of global step t are a fixed function of (seed, t, B, S): B start offsets drawn
from a generator seeded by hash(seed, t). So every layout sees the same global batch, data rank r
takes rows [r*b, (r+1)*b) of it, and resuming at step t needs no replay of steps 0..t-1. Under context
parallel a rank reads only its positions of each row (`runs`: (start, length) runs, parallel/cp.py's chunks).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from nanotitan.config.config import ConfigError


Runs = "list[tuple[int, int]] | None"  # positions of a sequence as (start, length) runs; None: the whole sequence


def columns(runs: list[tuple[int, int]]) -> np.ndarray:
    """The positions of `runs`, in order."""
    return np.concatenate([np.arange(s, s + n) for s, n in runs])


def step_generator(seed: int, step: int) -> torch.Generator:
    """A generator whose stream depends only on (seed, step), well mixed so nearby steps look unrelated."""
    digest = hashlib.blake2b(f"nanotitan-data:{seed}:{step}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


class IndexedBatches:
    """Random S+1-token windows of a flat token file; x = window[:-1], y = window[1:] (LongTensors [B, S])."""

    def __init__(self, path: str | Path, dtype: str | np.dtype, seq_len: int, seed: int):
        self.path, self.dtype, self.seq_len, self.seed = Path(path), np.dtype(dtype), seq_len, seed
        self.n_tokens = self.path.stat().st_size // self.dtype.itemsize
        if self.n_tokens < seq_len + 1:
            raise ConfigError(f"train.seq_len={seq_len} needs at least {seq_len + 1} tokens but {self.path} has "
                              f"{self.n_tokens} (lower --train.seq_len or use a bigger --data.source)")

    def offsets(self, step: int, B: int) -> torch.Tensor:
        """Start offsets of the B windows of global step `step`, int64 [B]."""
        n_starts = self.n_tokens - self.seq_len  # last valid start leaves room for S+1 tokens
        return torch.randint(0, n_starts, (B,), generator=step_generator(self.seed, step))

    def read(self, offsets_B: torch.Tensor, runs: Runs = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows starting at offsets_B: (x, y), each [len(offsets_B), S] (of each only the positions `runs`)."""
        # Re-open the memmap per call, as nanoGPT does: a long-lived np.memmap keeps growing resident memory
        # (https://stackoverflow.com/questions/45132940).
        tokens = np.memmap(str(self.path), dtype=self.dtype, mode="r")  # a str: a Path costs ~100 calls (resolve)
        if runs is None or runs == [(0, self.seq_len)]:
            idx_BW = offsets_B.numpy()[:, None] + np.arange(self.seq_len + 1)  # W = S + 1
            window_BW = torch.from_numpy(tokens[idx_BW].astype(np.int64))
            return window_BW[:, :-1], window_BW[:, 1:]
        idx_BS = offsets_B.numpy()[:, None] + columns(runs)  # only these positions' inputs and targets
        return (torch.from_numpy(tokens[idx_BS].astype(np.int64)),
                torch.from_numpy(tokens[idx_BS + 1].astype(np.int64)))

    def global_batch(self, step: int, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All B sequences of global step `step`: (x, y), each [B, S]."""
        return self.read(self.offsets(step, B))

    def rank_batch(self, step: int, B: int, data_rank: int, b: int, runs: Runs = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [data_rank*b, (data_rank+1)*b) of `global_batch(step, B)`, reading only those rows (and of each only
        the positions `runs`, None: all)."""
        assert 0 <= data_rank and (data_rank + 1) * b <= B, f"data_rank={data_rank} b={b} outside B={B}"
        return self.read(self.offsets(step, B)[data_rank * b:(data_rank + 1) * b], runs)

    def eval_batches(self, n: int, B: int, data_rank: int = 0, b: int | None = None, runs: Runs = None
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """n fixed batches of B windows spread evenly over the file (the same at every eval, for every seed);
        with `b`, only rows [data_rank*b, (data_rank+1)*b) of each (and `runs` of their positions)."""
        b = B if b is None else b
        assert 0 <= data_rank and (data_rank + 1) * b <= B, f"data_rank={data_rank} b={b} outside B={B}"
        return [self.read(offsets_B[data_rank * b:(data_rank + 1) * b], runs) for offsets_B in self.eval_offsets(n, B)]

    def eval_offsets(self, n: int, B: int) -> torch.Tensor:
        """Start offsets of `eval_batches`' n batches, int64 [n, B]: n*B windows spread evenly over the file."""
        n_starts = self.n_tokens - self.seq_len
        return torch.linspace(0, n_starts - 1, n * B, dtype=torch.float64).round().long().view(n, B)
