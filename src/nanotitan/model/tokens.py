"""TokenShard: what the model needs from the ranks that share its tokens, handed in whole (None on one device).

Tensor parallel (parallel/tp.py: `TPShard`) is the one implementation today; context parallel (issue 50) will
compose with it behind the same methods (docs/architecture.md, "One object shards tokens"). The model never asks
which axis it runs under: it calls these methods, and builds the modules below when handed a shard.

Two kinds of ranks share a rank's tokens:
- the token ranks (`rank` of `size`): they hold the rest of each sequence. The MoE routes its own `runs` of
  positions and sums its statistics over them (`sum`), or gathers them in sequence order (`gather`).
- the split ranks (`split_rank` of `split_size`): they hold the same tokens and split the weights (heads, vocab
  rows). A full q/k norm sums its squares over them (`split_sum`), the vocab-parallel embedding its lookups
  (`vocab_sum`), the loss its logit shards (`cross_entropy`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import wgrad


class TokenShard(Protocol):
    """The interface (parallel/tp.py: `TPShard`). Positions are global indices into a whole sequence."""
    rank: int  # this rank's place among the token ranks
    size: int  # token ranks: each holds S_whole / size positions of every sequence
    split_rank: int  # this rank's place among the ranks that split the weights on the same tokens
    split_size: int

    def runs(self, S: int) -> list[tuple[int, int]]:
        """This rank's S positions of a sequence as (global start, length) runs, in local order."""
        ...

    def stream_len(self, S: int) -> int:
        """Positions of each sequence in this rank's residual stream between blocks (what a stage sends on)."""
        ...

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the token ranks; the gradient goes straight through (each rank's, for its own tokens)."""
        ...

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The token ranks' t concatenated along the sequence dim `dim`, in global position order (no gradient)."""
        ...

    def splits(self, heads: int) -> bool:
        """Do the split ranks divide these heads (else each rank reads the whole, replicated projection)?"""
        ...

    def split_sum(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the split ranks, its gradient summed too: every rank's part reaches every rank's output."""
        ...

    def vocab_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The split ranks' partial embedding lookups (B, S, D) summed into this rank's residual stream."""
        ...

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of vocab-sharded logits (B, S, V/split_size) against targets (B, S)."""
        ...


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
