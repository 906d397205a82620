"""DP test helpers: a tiny net whose parameters include ones that get no gradient (TinyNet), and the model and
loss the Reducer and ZeRO tests build on each rank."""

import torch
import torch.nn as nn

from nanotitan.model.transformer import Transformer
from tests.helpers.tiny import tiny_model

TINY = tiny_model(vocab_size=64, d_model=16, n_layers=2, n_heads=2, ffn_dim=32, max_seq_len=16)


class TinyNet(nn.Module):
    """A few Linears plus params that get no gradient: `rank0_only` (used only on rank 0), `first_mb`
    (used only in microbatch 0) and `dead` (never used; registered last, so it sits in the FIRST bucket
    in reverse order and holds back every launch until finish())."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.rank0_only, self.first_mb = nn.Linear(16, 16), nn.Linear(16, 16)
        self.dead = nn.Parameter(torch.randn(5))

    def forward(self, x, rank: int, mb: int):
        h = torch.tanh(self.inp(x))
        h = h + torch.tanh(self.mid(h))
        if rank == 0:
            h = h + self.rank0_only(h)
        if mb == 0:
            h = h + self.first_mb(h)
        return self.out(h).pow(2).mean()


def _build(kind: str) -> nn.Module:
    return Transformer(TINY, seed=0) if kind == "transformer" else TinyNet()


def _loss(model, kind: str, rank: int, step: int, mb: int, M: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + mb)
    if kind == "transformer":
        tok = torch.randint(0, TINY.vocab_size, (2, 9), generator=g)
        ce, aux = model(tok[:, :-1], tok[:, 1:])
        return (ce + 0.01 * aux) / M
    return model(torch.randn(3, 8, generator=g), rank, mb) / M
