"""data.mix: batches that blend prepared sources by weight, exactly, and still a pure function of (seed, step).

The run's samples form one stream: the B rows of global step t are samples t*B .. t*B + B-1. Which source each
sample comes from is fixed by its index alone (`MixSchedule`). With the weights in their smallest integer proportions
a_1 : ... : a_k (0.7, 0.3 -> 7 : 3; data.mix's decimals are read as exact fractions) and P = sum(a_i):

    every P consecutive samples starting at a multiple of P hold exactly a_i samples of source i,
    and among the first N samples source i has N * a_i / P of them to within k (the number of sources).

The schedule is a cascade of exact integer Bresenham lines: sample n is source 1's when floor((n+1) a_1 / P) steps
up at n; the others form a stream of their own (sample n is its n - floor(n a_1 / P)-th) on which source 2 takes its
a_2 of every P - a_1, and so on. No state is carried from step to step, so resuming at any step, and any layout
reading its rows [r*b, (r+1)*b), sees the same rows from the same sources. Each row's window is drawn from its
source's train.bin as the one-source loader draws it (data/indexed.py: a generator seeded by (seed, step)), so a
mix of one source is that source's loader, batch for batch.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from ..config.config import DataConfig
from ..config.parse import mix_counts
from .indexed import IndexedBatches, Runs
from .prepare import load_meta, mix_sources
from .sft import SFTBatches


class MixSchedule:
    """The source of each sample of the stream, by its global index (module docstring)."""

    def __init__(self, weights: list[Fraction]):
        self.counts = mix_counts(weights)  # a_i
        self.period = sum(self.counts)  # P

    def sources(self, first: int, n: int) -> np.ndarray:
        """The sources (indices into the weights) of samples first .. first + n - 1, int64 [n]."""
        idx_N = np.arange(first, first + n, dtype=np.int64)  # each sample's index in the stream still undecided
        src_N = np.full(n, len(self.counts) - 1, dtype=np.int64)  # what no earlier source takes is the last's
        open_N = np.ones(n, dtype=bool)
        rest = self.period  # the samples of each period left for sources i, i+1, ...
        for i, a in enumerate(self.counts[:-1]):
            before, through = _floor_ratio(idx_N, a, rest), _floor_ratio(idx_N + 1, a, rest)
            mine = open_N & (through > before)
            src_N[mine] = i
            open_N &= ~mine
            idx_N = idx_N - before  # the index among the samples source i left over
            rest -= a
            if rest == 0:
                break
        return src_N


def _floor_ratio(n_N: np.ndarray, a: int, p: int) -> np.ndarray:
    """floor(n * a / p) exactly in int64 for a <= p <= 2**31 (the product itself could overflow for a long run)."""
    return (n_N // p) * a + (n_N % p) * a // p


class MixedBatches:
    """IndexedBatches' interface (rank_batch, global_batch, eval_batches) over several sources' token files, each row
    from the source the schedule gives its sample."""

    def __init__(self, parts: list[IndexedBatches], weights: list[Fraction]):
        assert len(parts) == len(weights) and parts
        self.parts, self.schedule = parts, MixSchedule(weights)

    def rank_batch(self, step: int, B: int, data_rank: int, b: int, runs: Runs = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [data_rank*b, (data_rank+1)*b) of global step `step`'s B rows (of each only the positions `runs`)."""
        assert 0 <= data_rank and (data_rank + 1) * b <= B, f"data_rank={data_rank} b={b} outside B={B}"
        lo = data_rank * b
        src_b = self.schedule.sources(step * B + lo, b)
        return self._read(src_b, [part.offsets(step, B)[lo:lo + b] for part in self.parts], runs)

    def global_batch(self, step: int, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rank_batch(step, B, 0, B)

    def eval_batches(self, n: int, B: int, data_rank: int = 0, b: int | None = None, runs: Runs = None
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """n fixed batches of B val windows, the mix's schedule over samples 0 .. n*B-1 and each source's windows
        spread evenly over its file (IndexedBatches.eval_offsets); with `b`, rows [data_rank*b, (data_rank+1)*b)."""
        b = B if b is None else b
        assert 0 <= data_rank and (data_rank + 1) * b <= B, f"data_rank={data_rank} b={b} outside B={B}"
        lo = data_rank * b
        offsets = [part.eval_offsets(n, B) for part in self.parts]  # [n, B] each
        return [self._read(self.schedule.sources(j * B + lo, b), [o[j, lo:lo + b] for o in offsets], runs)
                for j in range(n)]

    def _read(self, src_b: np.ndarray, offsets: list[torch.Tensor], runs: Runs) -> tuple[torch.Tensor, torch.Tensor]:
        """Row i of (x, y) is source src_b[i]'s window at offsets[src_b[i]][i]: each source's rows in one read."""
        x = y = None
        for i, part in enumerate(self.parts):
            rows = torch.from_numpy(np.flatnonzero(src_b == i))
            if not len(rows):
                continue
            xi, yi = part.read(offsets[i][rows], runs)
            if x is None:
                x, y = xi.new_empty((len(src_b), xi.shape[1])), yi.new_empty((len(src_b), yi.shape[1]))
            x[rows], y[rows] = xi, yi
        return x, y


def open_file(d: Path, split: str, seq_len: int, seed: int) -> IndexedBatches:
    """One prepared dir's split: a text corpus' windows, or an SFT split's windows of whole examples (data/sft.py)."""
    meta = load_meta(d)
    if meta.get("data_format") == "sft":
        return SFTBatches(d / f"{split}.bin", meta["dtype"], seq_len, seed, meta["eot_id"])
    return IndexedBatches(d / f"{split}.bin", meta["dtype"], seq_len, seed)


def open_split(cfg: DataConfig, dirs: list[Path], split: str, seq_len: int, seed: int
               ) -> IndexedBatches | MixedBatches:
    """The batches of `split` ("train" or "val") of the prepared `dirs`: data.source's IndexedBatches, or, with
    data.mix, its sources' (dirs in the mix's order, `mix_dirs`) blended by MixedBatches."""
    parts = [open_file(d, split, seq_len, seed) for d in dirs]
    if not cfg.mix:
        return parts[0]
    return MixedBatches(parts, [w for _, w in mix_sources(cfg)])
