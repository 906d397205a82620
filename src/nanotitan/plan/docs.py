"""Packed documents in the planner (docs/planner.md, docs/packed.md): what document-masked attention costs, and how
evenly a CP split shares it.

Under model.attn_mask=doc a query works only on the earlier keys of its own document: a window's attention work is
the sum over its documents of their causal areas, sum d(d+1)/2, not S(S+1)/2. The planner's attention FLOPs per
token count 2 x S x H x width (ModelShape.attn_part, causal not halved); under documents S becomes the window's
*span*, sum d^2 / S (S for one document filling the window, about twice the mean length for short ones), so the
priced work keeps the ratio of the two areas.

Under context parallel the step waits for the slowest CP rank's attention: `cp_skew`, its work over the mean, for
the runtime's own layouts (parallel/cp_split.py) on windows of the given documents: zigzag (which balances tokens,
so documents of a chunk's size and more load its ranks unevenly) or the document-balanced split
(parallel.cp_split=docs, about 1), each microbatch of m windows laid out as a whole as the runtime does (a larger m
evens zigzag out).

The documents come from `--doc-len-mean L` (lengths drawn geometric with mean L, fixed seed) or from a prepared
data directory (`--doc-data DIR`: windows of its train.bin at evenly spaced offsets, cut at its EOTs).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch

from ..model.docs import doc_starts
from ..parallel import cp_split

WINDOWS = 8  # windows a distribution is priced on (at least: 4 microbatches of m windows)
EOT = 1  # the synthetic windows' separator


def synthetic_starts(S: int, mean: float, windows: int = WINDOWS, seed: int = 0) -> torch.Tensor:
    """(windows, S) document starts of windows packed with documents of geometric lengths, mean `mean`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(windows, S, dtype=torch.long)
    for w in range(windows):  # a loop over windows; within one, tensor ops
        lengths = torch.empty(int(2 * S / mean) + 16).geometric_(1.0 / mean, generator=g).long()
        ends = lengths.cumsum(0) - 1
        x[w, ends[ends < S]] = EOT
    return doc_starts(x, EOT)


def data_starts(data_dir: str, S: int, windows: int = WINDOWS) -> torch.Tensor:
    """(windows, S) document starts of windows of a prepared directory's train.bin, at evenly spaced offsets."""
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    tokens = np.memmap(Path(data_dir) / "train.bin", dtype=np.dtype(meta["dtype"]), mode="r")
    if len(tokens) < S:
        raise ValueError(f"--doc-data {data_dir}: its train.bin holds {len(tokens)} tokens, fewer than one window "
                         f"of train.seq_len={S}")
    at = np.linspace(0, len(tokens) - S, windows).astype(np.int64)
    x = torch.from_numpy(np.stack([np.asarray(tokens[a:a + S], dtype=np.int64) for a in at]))
    return doc_starts(x, int(meta["eot_id"]))


def span(starts: torch.Tensor) -> float:
    """Keys per query x 2 the document mask leaves, over the windows: mean of sum d^2 / S (sum d(d+1)/2 is the
    window's work: twice it, less S)."""
    S = starts.shape[1]
    work = cp_split.doc_work(starts).sum(1).double()
    return float(((2 * work - S) / S).mean())


def cp_skew(starts: torch.Tensor, cp: int, split: str, m: int = 1) -> float:
    """The slowest CP rank's attention work over the mean under `split`, averaged over microbatches of m windows
    (each laid out as a whole, as the runtime does)."""
    if cp == 1:
        return 1.0
    S, out = starts.shape[1], []
    for mb in starts.split(m):
        if mb.shape[0] < m:
            break
        work = cp_split.rank_work(cp_split.layout_of(split, mb, S, cp), mb)
        out.append(max(work) * cp / sum(work))
    return sum(out) / len(out)


@functools.lru_cache(maxsize=256)
def attention_span(S: int, cp: int, split: str, mean: float = 0.0, data_dir: str = "", m: int = 1) -> float:
    """The span (`span`) the slowest CP rank's attention works on: the documents' span x `cp_skew` over
    microbatches of m windows; S (causal windows) with neither a mean nor a data directory."""
    if not mean and not data_dir:
        return float(S)
    windows = max(WINDOWS, 4 * m)
    starts = data_starts(data_dir, S, windows) if data_dir else synthetic_starts(S, mean, windows)
    return span(starts) * cp_skew(starts, cp, split, m)


def mean_length(data_dir: str) -> float:
    """A prepared directory's mean document length: its train tokens over its EOTs."""
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    tokens = np.memmap(Path(data_dir) / "train.bin", dtype=np.dtype(meta["dtype"]), mode="r")
    return len(tokens) / max(1, int(np.count_nonzero(tokens == int(meta["eot_id"]))))
