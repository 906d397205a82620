"""TokenShard: what the model needs from the ranks that share its tokens, handed in whole, on one device too.

`LocalTokenShard` (`LOCAL`, the default of every module) stands for one device: plain causal SDPA, identity sums and
gathers, the plain mean cross-entropy. Tensor parallel (parallel/tp.py: `TPShard`) and context parallel
(parallel/cp.py: `CPShard`, which composes with TP's part) implement it for their ranks (docs/architecture.md, "One
object shards tokens"). The model never asks which axis it runs under, nor whether it runs under one: it calls these
methods, one path for every layout.

Three kinds of ranks share a rank's tokens:
- the sequence ranks (CP): each holds its own positions of every sequence (`seq_runs`), which its attention and
  loss see; attention meets the others' keys and values through `attend` / `attend_latent`, MTP reads the whole
  sequence's targets through `seq_gather`. Under TP alone the sequence is whole on every rank.
- the token ranks (`rank` of `size`): they hold the rest of each sequence. The MoE routes its own `runs` of
  positions and sums its statistics over them (`sum`, `mean`), or gathers their routing in sequence order
  (`gather_routing`).
- the split ranks (`split_rank` of `split_size`): they hold the same tokens and split the weights (heads, vocab
  rows). A full q/k norm sums its squares over them (`split_sum`), the vocab-parallel embedding (`embedding`) its
  lookups (`vocab_sum`), the loss its logit shards (`cross_entropy`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import wgrad
from .docs import segments

IGNORE = -100  # a target no loss reads (MTP's shifted tail, model/mtp.py): F.cross_entropy's ignore_index
# A masked target (data.format=sft's prompts and padding): token + MASKED. No loss reads it, but MTP's depths read its
# token as an input (model/mtp.py), so the mask keeps the token; `loss_targets` and `target_tokens` read it apart.
MASKED = 1 << 30


def loss_targets(targets: torch.Tensor) -> torch.Tensor:
    """The targets a loss reads: masked ones IGNORE (the rest as they are: without a mask, the same values)."""
    return targets.masked_fill(targets >= MASKED, IGNORE)


def target_tokens(targets: torch.Tensor) -> torch.Tensor:
    """The tokens of the targets, masked or not (MTP's future inputs)."""
    return torch.where(targets >= MASKED, targets - MASKED, targets)


class TokenShard(Protocol):
    """The interface (`LocalTokenShard` below; parallel/tp.py: `TPShard`). Positions are global indices into a whole
    sequence."""
    rank: int  # this rank's place among the token ranks
    size: int  # token ranks: each holds S_whole / size positions of every sequence
    split_rank: int  # this rank's place among the ranks that split the weights on the same tokens
    split_size: int

    def place(self, docs: torch.Tensor | None) -> None:
        """The microbatch about to run, by its document starts (B, S_whole) or None: under context parallel they
        may choose which positions each rank holds (parallel/cp_split.py); `seq_runs` and `runs` answer for it."""
        ...

    def seq_runs(self, S: int) -> list[tuple[int, int]]:
        """The S positions of a sequence this rank's attention and loss see, as (global start, length) runs."""
        ...

    def seq_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The sequence ranks' t (their `seq_runs` along `dim`) as the whole sequence, in global order (no gradient)."""
        ...

    def attend(self, q, k, v, scale: float | None = None, docs: torch.Tensor | None = None) -> torch.Tensor:
        """`causal_attention` of this rank's queries (B, H, S, Dk) over the whole sequence's keys and values; with
        `docs` (the whole windows' document starts (B, S_whole), model/docs.py) within each document only."""
        ...

    def attend_latent(self, q, latent, expand, scale: float, docs: torch.Tensor | None = None) -> torch.Tensor:
        """`latent_attention` (MLA) of this rank's queries over the whole sequence's latents (`docs` as `attend`)."""
        ...

    def runs(self, S: int) -> list[tuple[int, int]]:
        """This rank's S positions of a sequence as (global start, length) runs, in local order."""
        ...

    def stream_len(self, S: int) -> int:
        """Positions of each sequence in this rank's residual stream between blocks (what a stage sends on)."""
        ...

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the token ranks; the gradient goes straight through (each rank's, for its own tokens)."""
        ...

    def mean(self, t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
        """t's mean along `dim` over the token ranks' n entries (this rank's t.sum(dim), summed as `sum` does, / n)."""
        ...

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The token ranks' t concatenated along the sequence dim `dim`, in global position order (no gradient)."""
        ...

    def gather_routing(self, weights_BSK: torch.Tensor, ids_BSK: torch.Tensor, length: int,
                       none_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The token ranks' routing (weights, expert ids) as the whole microbatch's, in global position order (no
        gradient). Each rank routes the first S of its `length` positions; past the routed ones (MTP's tail) come
        pads (weight 0, `none_id`), which the caller cuts: (B, >= routed positions of a whole sequence, K) each."""
        ...

    def splits(self, heads: int) -> bool:
        """Do the split ranks divide these heads (else each rank reads the whole, replicated projection)?"""
        ...

    def split_sum(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the split ranks, its gradient summed too: every rank's part reaches every rank's output."""
        ...

    def embedding(self, num: int, dim: int) -> nn.Embedding:
        """The token table: whole, or vocab-parallel over the split ranks (`VocabParallelEmbedding`)."""
        ...

    def vocab_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The split ranks' partial embedding lookups (B, S, D) summed into this rank's residual stream."""
        ...

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of vocab-sharded logits (B, S, V/split_size) against targets (B, S)."""
        ...


def causal_attention(q, k, v, scale: float | None = None) -> torch.Tensor:
    """Causal SDPA of q (B, H, S, Dk) over k (B, Hkv, S, Dk), v (B, Hkv, S, Dv) -> (B, H, S, Dv). GQA: query head h
    reads key/value head h // (H / Hkv), as HF's repeat_kv. A v narrower than q is zero-padded: SDPA's flash kernels
    want it as wide (HF pads it for flash-attention too); without this the CPU falls back to the math path, which
    keeps every head's S x S scores for backward (8 GiB a layer at DeepSeek-V3's size)."""
    pad = q.shape[-1] - v.shape[-1]
    y = F.scaled_dot_product_attention(q, k, F.pad(v, (0, pad)) if pad > 0 else v, is_causal=True, scale=scale,
                                       enable_gqa=k.shape[1] != q.shape[1])
    return y[..., :v.shape[-1]] if pad > 0 else y


def doc_attention(q, k, v, starts_BS: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention of q (B, H, S, Dk) over k (B, Hkv, S, Dk), v (B, Hkv, S, Dv) within each document of the
    whole windows (starts_BS (B, S)) -> (B, H, S, Dv): causal SDPA per document, so the work that the mask empties
    (the other documents' blocks) is never done. GQA and a narrower v as `causal_attention`."""
    rows = []
    for b in range(q.shape[0]):  # a loop over windows and their documents, never over tokens
        parts = [causal_attention(q[b:b + 1, :, s:s + n], k[b:b + 1, :, s:s + n], v[b:b + 1, :, s:s + n], scale)
                 for s, n in segments(starts_BS[b])]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)


def latent_attention(q, latent, expand, scale: float, docs: torch.Tensor | None = None) -> torch.Tensor:
    """MLA's attention from its per-token latent (B, S, R + Dr): expand(latent) -> (k, v), then `causal_attention`
    (`doc_attention` with the windows' document starts `docs`)."""
    if docs is not None:
        return doc_attention(q, *expand(latent), docs, scale)
    return causal_attention(q, *expand(latent), scale)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean CE of (.., V) logits (in fp32) against (..) targets, IGNORE left out (0 when every target is: a
    microbatch of masked prompts adds nothing, rather than 0/0)."""
    flat = targets.reshape(-1)
    total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), flat, ignore_index=IGNORE, reduction="sum")
    return total / (flat != IGNORE).sum().clamp_min(1)


class WholeSequence:
    """The sequence ranks' part of a token shard whose rank holds every sequence whole (one device; tensor parallel
    alone, whose regions gather SP's shards): attention and the loss see positions [0, S), attention is local."""

    def place(self, docs: torch.Tensor | None) -> None:
        pass  # the sequence is whole here: nothing to choose

    def seq_runs(self, S: int) -> list[tuple[int, int]]:
        return [(0, S)]

    def seq_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t

    def attend(self, q, k, v, scale: float | None = None, docs: torch.Tensor | None = None) -> torch.Tensor:
        return causal_attention(q, k, v, scale) if docs is None else doc_attention(q, k, v, docs, scale)

    def attend_latent(self, q, latent, expand, scale: float, docs: torch.Tensor | None = None) -> torch.Tensor:
        return latent_attention(q, latent, expand, scale, docs)


class LocalTokenShard(WholeSequence):
    """One device as the model's token shard: every position of every sequence is here, in order, and nothing is
    split. Each method is what a module runs alone (the identities return their tensor itself: no op is added)."""
    rank, size, split_rank, split_size = 0, 1, 0, 1

    def runs(self, S: int) -> list[tuple[int, int]]:
        return [(0, S)]

    def stream_len(self, S: int) -> int:
        return S

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def mean(self, t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
        return t.mean(dim)

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t

    def gather_routing(self, weights_BSK, ids_BSK, length: int, none_id: int):
        return weights_BSK, ids_BSK

    def splits(self, heads: int) -> bool:
        return False  # no split ranks: a q/k norm over the whole projection is a plain RMSNorm

    def split_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def embedding(self, num: int, dim: int) -> nn.Embedding:
        return nn.Embedding(num, dim)

    def vocab_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, targets)


LOCAL = LocalTokenShard()  # stateless: every module of a one-device model shares it


def gather_pairs(tokens: TokenShard, weights_BSK: torch.Tensor, ids_BSK: torch.Tensor, length: int,
                 none_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_routing` for token ranks that hold parts (TP, CP): the (weight, id) pairs in one tensor (ids < 2^24
    are exact in fp32), padded to `length` positions, so that one all-gather (`tokens.gather`) carries both."""
    B, S, K = ids_BSK.shape
    pairs = weights_BSK.new_zeros(B, length, K, 2)
    pairs[..., 1] = none_id
    pairs[:, :S] = torch.stack([weights_BSK.float(), ids_BSK.float()], -1)
    every = tokens.gather(pairs, 1)
    return every[..., 0], every[..., 1].long()


def at_runs(t: torch.Tensor, runs: list[tuple[int, int]], dim: int = 0) -> torch.Tensor:
    """t's entries at the global positions `runs` along `dim` (a table indexed by position: the rope cache)."""
    if len(runs) == 1:
        return t.narrow(dim, *runs[0])
    return torch.cat([t.narrow(dim, s, n) for s, n in runs], dim=dim)


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding over this split rank's rows [split_rank * V/N, (split_rank + 1) * V/N) of the table, once the
    weight is sliced (parallel/tp.py); a token outside them reads zeros, and the ranks' sum is the lookup."""
    wgrad_store: wgrad.WeightGradStore | None = None  # deferrable like the plain table (Transformer._embed)

    def __init__(self, num: int, dim: int, tokens: TokenShard):
        super().__init__(num, dim)
        self.tokens = tokens

    @property
    def vocab_start(self) -> int:
        return self.tokens.split_rank * self.weight.shape[0]

    def forward(self, idx):
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), wgrad.tap(self.weight, self.wgrad_store))
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tokens.vocab_sum(out)
