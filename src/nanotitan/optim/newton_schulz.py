"""Newton-Schulz orthogonalization, batched over a leading dim (Keller Jordan's reference, muon.py at f90a42b;
torch.optim.Muon's `_zeropower_via_newtonschulz` is the same iteration on one 2-D matrix).

    X <- G / ||G||_F                        (per matrix: its spectral norm is then <= 1)
    repeat `steps`:  A = X X^T;  B = b A + c A A;  X = a X + B X
with the quintic (a, b, c) = (3.4445, -4.7750, 2.0315), on the wide orientation (m <= n) so A is the small Gram.
It does not converge to U V^T but to U S' V^T, S'_ii ~ U(0.5, 1.5), which trains as well (Keller Jordan).
Run in fp32 by default, so every layout holds the fp32 equivalence bar (1e-5) against one process; bf16 (the
reference's and torch.optim.Muon's choice, `--train.muon_ns_dtype bf16`) is ~2-2.5x faster on this avx512_bf16 Zen 4
but its rounding of the input amplifies the layouts' fp32 reduction-order noise to ~1.3e-5 (docs/optim.md).
"""

from __future__ import annotations

import math

import torch

COEFFS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7


NS_DTYPES = (torch.bfloat16, torch.float32)


def orthogonalize(G: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NS^steps of each matrix of G (m, n) or (k, m, n), in `dtype`, returned in G's dtype. The a/b/c polynomial is
    two fused multiply-adds per iteration (baddbmm: B = b A + c A A, X = a X + B X), no temporaries beyond A, B."""
    assert dtype in NS_DTYPES, f"Newton-Schulz dtype {dtype}: use one of {NS_DTYPES}"
    a, b, c = COEFFS
    X = G.to(dtype)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=EPS)
    mm = torch.addmm if X.dim() == 2 else torch.baddbmm
    for _ in range(steps):
        A = X @ X.mT
        B = mm(A, A, A, beta=b, alpha=c)
        X = mm(X, B, X, beta=a)
    if tall:
        X = X.mT
    return X.to(G.dtype)


def rms_scale(m: int, n: int) -> float:
    """Moonlight's factor (arXiv:2502.16982, eq. 4): 0.2 * sqrt(max(m, n)) brings an orthogonalized update's RMS
    (~1/sqrt(max(m, n))) to AdamW's typical 0.2-0.4, so AdamW's lr and weight decay carry over."""
    return 0.2 * math.sqrt(max(m, n))


def ns_flops(m: int, n: int, steps: int = 5) -> int:
    """Multiply-adds x 2 of `steps` iterations on one m x n matrix (s = min, l = max): X X^T (2 s^2 l),
    A A (2 s^3), B X (2 s^2 l)."""
    s, l = min(m, n), max(m, n)
    return steps * (4 * s * s * l + 2 * s ** 3)
