"""Which positions of a sequence each CP rank holds (docs/cp.md, "The split"): the layout that the data loader, RoPE,
the MoE's token order and the ring all read.

A layout cuts a window of S tokens into K equal chunks of c = S/K and gives each of the N CP ranks K/N of them, held
in increasing global order (so a rank's local causal mask is the global one, and MTP's untargeted tail, in the last
chunk, is a suffix of its owner's stream). Every rank holds S/N tokens, so the ring's and the all-to-all's messages
keep one size.

    zigzag     chunks i and 2N-1-i of 2N (`parallel.cp_split=zigzag`, the default): causal attention over one
               sequence then costs every rank the same. Under documents it is cut finer (the same positions in
               2g chunks a rank), so that the ring skips the finer block pairs that no query can see.
    docs       per microbatch from its document starts (`parallel.cp_split=docs`, with model.attn_mask=doc): the
               2N*g chunks go to the ranks so that each rank's attention work (the sum over its query tokens of the
               earlier keys of their own document: each document's causal area) is nearly the mean. Longest
               chunk first, each to the rank with the least work that still has room (LPT with equal counts).

g (chunks a rank holds per zigzag half) is the largest of 4, 2, 1 that divides S/(2N) and leaves chunks of >= 64
tokens (a finer cut balances better; a smaller block costs more launches than it saves), so K = 2N at short S.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.cp_rules import chunks_per_half


@dataclass(frozen=True)
class CPLayout:
    """K = len(owner) chunks of `chunk` tokens; owner[j] the CP rank that holds chunk j."""
    chunk: int
    owner: tuple[int, ...]
    size: int  # CP ranks

    @property
    def seq_len(self) -> int:
        return self.chunk * len(self.owner)

    def chunks(self, rank: int) -> list[int]:
        """Rank `rank`'s chunks, in global (= its local) order."""
        return [j for j, r in enumerate(self.owner) if r == rank]

    def runs(self, rank: int) -> list[tuple[int, int]]:
        """Rank `rank`'s positions as (global start, length) runs, adjacent chunks merged."""
        out: list[tuple[int, int]] = []
        for j in self.chunks(rank):
            if out and out[-1][0] + out[-1][1] == j * self.chunk:
                out[-1] = (out[-1][0], out[-1][1] + self.chunk)
            else:
                out.append((j * self.chunk, self.chunk))
        return out

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """(S/N,) int64: the global position of each of rank `rank`'s local tokens."""
        return torch.cat([torch.arange(s, s + n, device=device) for s, n in self.runs(rank)])

    def order(self, device=None) -> torch.Tensor:
        """(S,) int64: global positions in rank order (rank 0's local tokens, then rank 1's, ...)."""
        return torch.cat([self.positions(r, device) for r in range(self.size)])


def zigzag(S: int, n: int, g: int = 1) -> CPLayout:
    """Chunks i and 2N-1-i of 2N to rank i, each cut into g chunks of the layout."""
    owner = [min(j // g, 2 * n - 1 - j // g) for j in range(2 * n * g)]
    return CPLayout(S // (2 * n * g), tuple(owner), n)


def doc_work(starts_BS: torch.Tensor) -> torch.Tensor:
    """(B, S) int64: each query's attention work under the document mask, the keys it sees (position - document
    start + 1): summed over a document, its causal area."""
    S = starts_BS.shape[1]
    return torch.arange(1, S + 1, device=starts_BS.device) - starts_BS


def chunk_work(starts_BS: torch.Tensor, K: int) -> torch.Tensor:
    """(K,) int64: each of K equal chunks' attention work, summed over the windows."""
    B, S = starts_BS.shape
    return doc_work(starts_BS).view(B, K, S // K).sum(dim=(0, 2))


def balanced(starts_BS: torch.Tensor, n: int) -> CPLayout:
    """The document-balanced layout of windows with document starts starts_BS (B, S): 2N*g chunks, dearest first,
    each to the rank with the least work among those with fewer than 2g (ties: the lower rank). A loop over
    chunks (at most 8N), never tokens; integer work, so every rank computes the same layout."""
    S = starts_BS.shape[1]
    g = chunks_per_half(S, n)
    K, room = 2 * n * g, 2 * g
    work = chunk_work(starts_BS, K).tolist()  # the one host sync of a microbatch's layout
    load, held, owner = [0] * n, [0] * n, [0] * K
    for j in sorted(range(K), key=lambda j: (-work[j], j)):
        r = min((r for r in range(n) if held[r] < room), key=lambda r: (load[r], r))
        owner[j], load[r], held[r] = r, load[r] + work[j], held[r] + 1
    return CPLayout(S // K, tuple(owner), n)


def layout_of(split: str, starts_BS: torch.Tensor | None, S: int, n: int) -> CPLayout:
    """The layout of an S-token window over n CP ranks: zigzag without documents (2N chunks) or with them (cut
    finer), `balanced` for split=docs with documents."""
    if starts_BS is None:
        return zigzag(S, n)
    if split == "docs":
        return balanced(starts_BS, n)
    return zigzag(S, n, chunks_per_half(S, n))


def rank_work(layout: CPLayout, starts_BS: torch.Tensor) -> list[int]:
    """Each CP rank's attention work (document-masked causal area of its queries) under `layout`."""
    per_chunk = chunk_work(starts_BS, len(layout.owner)).tolist()
    out = [0] * layout.size
    for j, r in enumerate(layout.owner):
        out[r] += per_chunk[j]
    return out
