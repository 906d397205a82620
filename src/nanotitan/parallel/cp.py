"""Context parallel: every sequence of a microbatch split over the CP group for the whole model (docs/cp.md).

    split         a sequence of S tokens is cut into 2N chunks of c = S/(2N) (N = cp); CP rank i holds chunks i and
                  2N-1-i, in that order (`chunk_runs`): causal attention then costs every rank the same. Its data
                  loader reads only those positions (run/setup.py); RoPE/YaRN read the rope table at them.
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

    def __init__(self, ring, tp: TPShard | LocalTokenShard, impl: str):
        self.ring, self.tp, self.impl = ring, tp, impl
        self.size, self.rank = ring.size * tp.size, ring.rank * tp.size + tp.rank
        self.split_rank, self.split_size = tp.split_rank, tp.split_size

    # --- the token ranks ------------------------------------------------------------------------------------
    def seq_runs(self, S: int) -> list[tuple[int, int]]:
        """The CP rank's S positions (what attention and the loss see: TP regions gather the rest of its stream)."""
        return chunk_runs(self.ring.rank, self.ring.size, S * self.ring.size)

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
        """The CP ranks' t (each its two chunks along `dim`) as the whole sequence, in global order (no gradient)."""
        n = self.ring.size
        t = t.contiguous()
        out = t.new_empty((n, *t.shape))
        comm.all_gather(out.view(-1), t.view(-1), self.ring.group, axis="cp").wait()
        halves = [part.chunk(2, dim=dim) for part in out.unbind(0)]  # rank r: (chunk r, chunk 2n-1-r)
        return torch.cat([halves[g][0] if g < n else halves[2 * n - 1 - g][1] for g in range(2 * n)], dim=dim)

    # --- attention ------------------------------------------------------------------------------------------
    def attend(self, q, k, v, scale: float | None = None, docs: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of the CP rank's queries over the whole sequence (B, H, S_loc, D) -> (B, H, S_loc, Dv);
        with `docs` (the whole windows' document starts (B, S)) within each document."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if self.impl == "a2a":
            return ulysses_attention(q, k, v, self.ring, scale, docs)
        return ring_attention(q, k, v, self.ring, scale, docs)

    def attend_latent(self, q, latent, expand, scale: float, docs: torch.Tensor | None = None) -> torch.Tensor:
        """MLA: the ring carries the latent (B, S_loc, R + Dr) and each rank expands it; a2a expands it here."""
        if self.impl == "a2a":
            return self.attend(q, *expand(latent), scale, docs)
        return ring_latent_attention(q, latent, expand, self.ring, scale, docs)

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


def token_shard(dims: ParallelDims, sp: bool, cp_impl: str
                ) -> tuple[CPShard | TPShard | LocalTokenShard, TPShard | LocalTokenShard]:
    """(the token shard a model of this rank is built with, its TP part for apply_tp): CP's composed with TP's at
    cp > 1, else TP's (parallel/tp.py: `tp_shard`), the local token shard on one device."""
    tp = tp_shard(dims, sp)
    if dims.cp == 1:
        return tp, tp
    ranks, me, n = dims.group_ranks("cp"), dims.cp_rank, dims.cp  # from the coordinates (a dry run has no groups)
    ring = CPRing(dims.group("cp"), me, n, ranks[(me - 1) % n], ranks[(me + 1) % n])
    return CPShard(ring, tp, cp_impl), tp


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
