"""Context parallel: every sequence of a microbatch split over the CP group for the whole model (docs/cp.md).

    split         a sequence of S tokens is cut into 2N chunks of c = S/(2N) (N = cp); CP rank i holds chunks i and
                  2N-1-i, in that order (`chunk_runs`): causal attention then costs every rank the same. Its data
                  loader reads only those positions (run/setup.py); RoPE/YaRN read the rope table at them. Under
                  documents with parallel.cp_split=docs each microbatch has a layout of its own, balanced over its
                  documents' attention work (parallel/cp_split.py), which `place` sets before the model reads it.
    attention     `CPShard.attend`: the ring (parallel/cp_attn.py, parallel.cp_impl=ring) or Ulysses' all-to-all
                  (a2a); MLA's `attend_latent` sends the compressed latent around the ring instead of whole K/V
    MoE           each CP rank routes its own tokens (`runs`); the balance loss, z-loss and expert counts are summed
                  over the CP x TP token ranks (`sum`), capacity ranks the whole microbatch (`gather` reorders the
                  chunks); the experts fold over EP x CP x TP (dims.moe_ep), so the EP all-to-all carries them
    loss          each CP rank's CE is its tokens' part of the whole sequence's mean (`cross_entropy`): the CP ranks'
                  terms add up to it, and their gradients too
    MTP           depth k's targets are the whole sequence's, shifted, read at the rank's positions (`seq_gather`)
    gradients     parameters are replicated over CP; each rank's gradient is its own tokens' part, so the CP ranks
                  join the DP ranks in the non-expert-DP sum (dims.py), as torchtitan's FSDP over dp_shard x cp

With TP on top, CP is the outer split and TP (with SP) splits each CP rank's local stream further: the token ranks
are CP x TP, the split ranks (heads, vocab rows) stay TP's, and `CPShard` holds the TP part it composes with: the
`TPShard`, or at tp = 1 the local token shard (one rank, nothing split: its sums and gathers return their tensor).
The model never asks which axis it runs under: it calls the token shard's methods (model/tokens.py).
"""

from __future__ import annotations

import torch

import torch.nn as nn

from ..model.tokens import IGNORE, LocalTokenShard, gather_pairs
from .comm import collectives as comm
from .cp_attn import CPRing, ring_attention, ring_latent_attention, ulysses_attention
from .cp_split import CPLayout, layout_of, zigzag
from .dims import ParallelDims
from .tp import TPShard, cut_fp8, max_over, tp_shard

def chunk_runs(cp_rank: int, cp: int, S: int) -> list[tuple[int, int]]:
    """CP rank `cp_rank`'s positions of an S-token sequence as (global start, length) runs, in local order: chunks
    cp_rank and 2cp-1-cp_rank of 2cp (the whole sequence at cp = 1)."""
    if cp == 1:
        return [(0, S)]
    c = S // (2 * cp)
    return [(cp_rank * c, c), ((2 * cp - 1 - cp_rank) * c, c)]


def local_runs(runs: list[tuple[int, int]], start: int, n: int) -> list[tuple[int, int]]:
    """The global runs of local positions [start, start + n) of a stream laid out as `runs`."""
    out, at = [], 0
    for s, length in runs:
        lo, hi = max(start, at), min(start + n, at + length)
        if lo < hi:
            out.append((s + lo - at, hi - lo))
        at += length
    return out


class CPShard:
    """The CP group, composed with its TP part (`tp`: the `TPShard`, or the local token shard at tp = 1), as the
    model's token shard (model/tokens.py: `TokenShard`). Token ranks: CP x TP, cp-major (rank = cp_rank * tp +
    tp_rank); split ranks: TP's."""

    def __init__(self, ring, tp: TPShard | LocalTokenShard, impl: str, split: str = "zigzag"):
        self.ring, self.tp, self.impl, self.split = ring, tp, impl, split
        self.size, self.rank = ring.size * tp.size, ring.rank * tp.size + tp.rank
        self.split_rank, self.split_size = tp.split_rank, tp.split_size
        self._docs, self._layout = None, None  # the placed microbatch's document starts and its layout

    # --- the token ranks ------------------------------------------------------------------------------------
    def place(self, docs: torch.Tensor | None) -> None:
        """The microbatch about to run: its document starts (B, S) (None: causal windows) fix its layout (the
        same on every rank, a pure function of the starts; kept while the same starts come back, as activation
        checkpointing's recompute hands them)."""
        if docs is self._docs:
            return
        self._docs = docs
        self._layout = None if docs is None else layout_of(self.split, docs, docs.shape[1], self.ring.size)

    def layout(self, S_whole: int) -> CPLayout:
        """The layout of an S_whole-token sequence: the placed microbatch's, or zigzag's two chunks."""
        if self._layout is not None and self._layout.seq_len == S_whole:
            return self._layout
        return zigzag(S_whole, self.ring.size)

    def seq_runs(self, S: int) -> list[tuple[int, int]]:
        """The CP rank's S positions (what attention and the loss see: TP regions gather the rest of its stream)."""
        return self.layout(S * self.ring.size).runs(self.ring.rank)

    def runs(self, S: int) -> list[tuple[int, int]]:
        """This token rank's S positions: TP rank j holds local positions [j*S, (j+1)*S) of its CP rank's stream."""
        return local_runs(self.seq_runs(S * self.tp.size), self.tp.rank * S, S)

    def stream_len(self, S: int) -> int:
        """S is already the CP rank's (its loader reads only its chunks): SP splits it over TP."""
        return self.tp.stream_len(S)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return _SumOverCP.apply(self.tp.sum(t), self.ring.group)

    def mean(self, t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
        return self.sum(t.sum(dim)) / n

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Over TP (the CP rank's stream, in order), then over CP, with the chunks put back in global order."""
        return self.seq_gather(self.tp.gather(t, dim), dim)

    def gather_routing(self, weights_BSK, ids_BSK, length: int, none_id: int):
        return gather_pairs(self, weights_BSK, ids_BSK, length, none_id)

    def seq_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The CP ranks' t (each its positions along `dim`) as the whole sequence, in global order (no gradient)."""
        n = self.ring.size
        t = t.contiguous()
        out = t.new_empty((n, *t.shape))
        comm.all_gather(out.view(-1), t.view(-1), self.ring.group, axis="cp").wait()
        ranked = torch.cat(out.unbind(0), dim=dim)  # rank 0's positions, rank 1's, ...
        order = self.layout(t.shape[dim] * n).order(t.device)
        return ranked.index_select(dim, torch.argsort(order))

    # --- attention ------------------------------------------------------------------------------------------
    def attend(self, q, k, v, scale: float | None = None, docs: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of the CP rank's queries over the whole sequence (B, H, S_loc, D) -> (B, H, S_loc, Dv);
        with `docs` (the whole windows' document starts (B, S)) within each document."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        self.place(docs)
        layout = self.layout(q.shape[2] * self.ring.size)
        if self.impl == "a2a":
            return ulysses_attention(q, k, v, self.ring, scale, docs, layout)
        return ring_attention(q, k, v, self.ring, scale, docs, layout)

    def attend_latent(self, q, latent, expand, scale: float, docs: torch.Tensor | None = None) -> torch.Tensor:
        """MLA: the ring carries the latent (B, S_loc, R + Dr) and each rank expands it; a2a expands it here."""
        if self.impl == "a2a":
            return self.attend(q, *expand(latent), scale, docs)
        self.place(docs)
        layout = self.layout(q.shape[2] * self.ring.size)
        return ring_latent_attention(q, latent, expand, self.ring, scale, docs, layout)

    # --- the split ranks: TP's ------------------------------------------------------------------------------
    def splits(self, heads: int) -> bool:
        """TP's rule, heads % split ranks == 0, also at tp = 1 (a full q/k norm whose split sum is the identity)."""
        return heads % self.split_size == 0

    def split_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self.tp.split_sum(t)

    def embedding(self, num: int, dim: int) -> nn.Embedding:
        return self.tp.embedding(num, dim)

    def vocab_sum(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.vocab_sum(x)

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This CP rank's part of the whole sequence's mean CE: its rows' mean times its share of the sequence's
        targeted rows (one tiny all-reduce of the count: MTP's shifted tail leaves rank 0 fewer)."""
        mean = self.tp.cross_entropy(logits, targets)
        rows = (targets != IGNORE).sum().to(mean.dtype)
        total = rows.clone()
        comm.all_reduce(total, group=self.ring.group, axis="cp")
        return mean * (rows / total.clamp_min(1))


class _SumOverCP(torch.autograd.Function):
    """All-reduce over CP forward, identity backward: a statistic of the whole microbatch from each rank's tokens,
    whose gradient each rank takes for its own tokens (the CP ranks' gradients are then summed: dims.py)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        comm.all_reduce(x, group=group, axis="cp")
        return x

    @staticmethod
    def backward(ctx, dy):
        return dy, None


def token_shard(dims: ParallelDims, sp: bool, cp_impl: str, cp_split: str = "zigzag"
                ) -> tuple[CPShard | TPShard | LocalTokenShard, TPShard | LocalTokenShard]:
    """(the token shard a model of this rank is built with, its TP part for apply_tp): CP's composed with TP's at
    cp > 1, else TP's (parallel/tp.py: `tp_shard`), the local token shard on one device."""
    tp = tp_shard(dims, sp)
    if dims.cp == 1:
        return tp, tp
    ranks, me, n = dims.group_ranks("cp"), dims.cp_rank, dims.cp  # from the coordinates (a dry run has no groups)
    ring = CPRing(dims.group("cp"), me, n, ranks[(me - 1) % n], ranks[(me + 1) % n])
    return CPShard(ring, tp, cp_impl, cp_split), tp


def apply_cp(model: nn.Module, tokens) -> None:
    """Every linear of this rank's chunks runs on its CP rank's tokens: mark their token dim cut over the CP group, so
    an FP8 scale that spans the tokens (model/fp8.py `Split`) is the whole sequence's. No-op without CP."""
    if isinstance(tokens, CPShard):
        reduce = max_over(tokens.ring.group, "cp")
        for m in model.modules():
            if hasattr(m, "fp8_split"):
                cut_fp8(m, "tokens", reduce)


def seq_runs_of(dims: ParallelDims, S: int) -> list[tuple[int, int]]:
    """The positions of each S-token sequence this rank's data loader reads (its CP rank's chunks)."""
    return chunk_runs(dims.cp_rank, dims.cp, S)


def doc_columns(dims: ParallelDims, split: str, starts_BS: torch.Tensor, m: int) -> torch.Tensor:
    """(B, S/cp) int64: the positions this rank's loader keeps of each window with document starts starts_BS (B, S),
    each microbatch of m windows by its own layout (what `CPShard.place` gives the model for the same starts)."""
    S = starts_BS.shape[1]
    rows = [layout_of(split, part, S, dims.cp).positions(dims.cp_rank, starts_BS.device).expand(part.shape[0], -1)
            for part in starts_BS.split(m)]
    return torch.cat(rows)
