"""RMSNorm, the one norm of every block (attention, FFN, MLA's latents), with a deferrable weight gradient."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import wgrad


class RMSNorm(nn.Module):
    wgrad_store: wgrad.WeightGradStore | None = None  # set: the weight's gradient lands in W (model/wgrad.py)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        w = self.weight if self.wgrad_store is None else wgrad.tap(self.weight, self.wgrad_store)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)
