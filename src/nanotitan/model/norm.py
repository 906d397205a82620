"""RMSNorm, the one norm of every block (attention, FFN, MLA's latents), with a deferrable weight gradient; FullNorm,
its form over a projection split by heads (model.qk_norm=full under tensor parallel: model/tokens.py)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import wgrad
from .tokens import TokenShard


class RMSNorm(nn.Module):
    wgrad_store: wgrad.WeightGradStore | None = None  # set: the weight's gradient lands in W (model/wgrad.py)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        w = self.weight if self.wgrad_store is None else wgrad.tap(self.weight, self.wgrad_store)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)


class FullNorm(RMSNorm):
    """RMSNorm over a whole projection split by heads over the split ranks (model.qk_norm=full under tensor parallel):
    this rank's columns, normalised by the RMS of the whole row, from one (tokens, 1) sum of the ranks' squares."""

    def __init__(self, width: int, eps: float, tokens: TokenShard):
        super().__init__(width, eps)
        self.width, self.tokens = width, tokens  # the whole projection's width; the weight is sliced with the heads

    def forward(self, x):
        w = self.weight if self.wgrad_store is None else wgrad.tap(self.weight, self.wgrad_store)
        ss = self.tokens.split_sum(x.float().pow(2).sum(-1, keepdim=True))
        return (x.float() * torch.rsqrt(ss / self.width + self.eps)).to(x.dtype) * w


def full_norm(width: int, eps: float, tokens: TokenShard, heads: int) -> RMSNorm:
    """The norm over a whole projection of `heads` heads: a FullNorm when the split ranks divide those heads, else
    a plain RMSNorm (one device; or GQA's KV heads fewer than the ranks: each reads the whole, replicated k)."""
    return FullNorm(width, eps, tokens) if tokens.splits(heads) else RMSNorm(width, eps)
