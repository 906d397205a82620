"""Packed documents: where each document of a window starts, each token's position in its document, and attention
that stays inside a document (model.attn_mask=doc, docs/packed.md).

A window packs documents, each ended by EOT (data/prepare.py). A document's layout is one integer per position: the
global position of its document's first token (`starts_BS`). Two positions share a document iff their starts are
equal; a token's position within its document is its position minus its start (model.doc_positions=doc: RoPE, YaRN
and MLA's rope part restart at each document). The EOT that ends a document belongs to it: the next document starts
after it.

`starts_BS` always covers the whole window (B, S), also under context parallel, where a rank holds only some
positions of it: its queries read their starts at its positions, its keys at theirs (parallel/cp_attn.py).
"""

from __future__ import annotations

import torch


def doc_starts(x_BS: torch.Tensor, eot: int) -> torch.Tensor:
    """(B, S) int64: each position's document start in windows x_BS (B, S) of token ids, whose documents end at
    `eot`. Tensor ops: a running max of the positions that follow an EOT (and of position 0)."""
    B, S = x_BS.shape
    pos_S = torch.arange(S, device=x_BS.device)
    opens_BS = torch.zeros(B, S, dtype=torch.bool, device=x_BS.device)
    opens_BS[:, 1:] = x_BS[:, :-1] == eot  # the token after an EOT opens a document
    return torch.where(opens_BS, pos_S, 0).cummax(dim=1).values


def doc_positions(starts_BS: torch.Tensor, at: torch.Tensor | None = None) -> torch.Tensor:
    """(B, n) int64: the position within its document of each global position `at` (n,) of the window (all S when
    None)."""
    at = torch.arange(starts_BS.shape[1], device=starts_BS.device) if at is None else at
    return at - starts_BS[:, at]


def positions_of(runs: list[tuple[int, int]], device=None) -> torch.Tensor:
    """The global positions of (start, length) runs, in order (n,) int64."""
    return torch.cat([torch.arange(s, s + n, device=device) for s, n in runs])


def segments(starts_S: torch.Tensor) -> list[tuple[int, int]]:
    """One window's documents (S,) as (start, length) runs in order (one host sync per window)."""
    S = starts_S.shape[0]
    opens = torch.nonzero(starts_S == torch.arange(S, device=starts_S.device)).flatten().tolist()
    return [(s, e - s) for s, e in zip(opens, opens[1:] + [S])]


def doc_rope(rope, runs: list[tuple[int, int]], starts_BS: torch.Tensor):
    """(cos, sin) of the rope tables `rope` (max_seq_len, dim) at each position's place in its document, for the
    global positions `runs` of windows with document starts starts_BS: (B, 1, n, dim) each (every head alike)."""
    pos_Bn = doc_positions(starts_BS, positions_of(runs, starts_BS.device))
    return rope[0][pos_Bn].unsqueeze(1), rope[1][pos_Bn].unsqueeze(1)
