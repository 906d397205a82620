"""The seed's EP layer as its write-up describes it, re-implemented for comparison (NOT used in training).

Faithful to the seed's text (three-axes-of-parallelism.txt, "Producing assignments" and "Dispatch,
expert computation and combine") and to what the baselines, docs/design.md saw in the seed repo's profiles:
- packing: a Python loop over experts, `argwhere` + two `.item()` offsets per expert, slice assignment;
- the source-major -> expert-major permutation of the received buffer (and back) is built by a
  Python loop with one tensor assignment per assignment (~8 us each; 43-45% of the seed's EP forward);
- experts index the stacked weights one at a time (`W_gate[e]`), whose backward allocates a
  full-size zero gradient per expert.
The all-to-alls and the final combine are the same as ours (`all_to_all_rows`, `combine`), so the
comparison isolates the Python-loop packing/permutation and the per-expert weight indexing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.moe import ExpertFFN, combine
from ..parallel.comm import collectives as comm
from ..parallel.ep import all_to_all_rows


def seed_pack(x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, num_experts: int):
    """Expert-major packing with a loop per expert (the seed's listing). Returns (x_ND, token_idx_N, order_N,
    counts_E)."""
    T, K = expert_ids_TK.shape
    counts_E = torch.bincount(expert_ids_TK.reshape(-1), minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(counts_E, dim=0)
    packed_ND = x_TD.new_empty(T * K, x_TD.shape[1])
    token_idx_N = torch.empty(T * K, dtype=torch.long)
    order_N = torch.empty(T * K, dtype=torch.long)
    for e in range(num_experts):
        idx = torch.argwhere(expert_ids_TK == e)  # (c_e, 2): token, k
        if idx.numel() == 0:
            continue
        start, end = offsets[e].item(), offsets[e + 1].item()
        packed_ND[start:end] = x_TD[idx[:, 0]]
        token_idx_N[start:end] = idx[:, 0]
        order_N[start:end] = idx[:, 0] * K + idx[:, 1]
    return packed_ND, token_idx_N, order_N, counts_E


def seed_permute(x_RD: torch.Tensor, recv_PL: list[list[int]], inverse: bool = False) -> torch.Tensor:
    """Source-major <-> expert-major with the permutation built one tensor assignment per assignment
    (the seed repo's loop, ~8 us each), then applied with one gather (so backward is a scatter)."""
    P, L = len(recv_PL), len(recv_PL[0])
    src_start, off = {}, 0
    for p in range(P):
        for l in range(L):
            src_start[p, l] = off
            off += recv_PL[p][l]
    perm_R = torch.empty(x_RD.shape[0], dtype=torch.long)
    dst = 0
    for l in range(L):
        for p in range(P):
            for i in range(recv_PL[p][l]):
                if inverse:
                    perm_R[src_start[p, l] + i] = dst
                else:
                    perm_R[dst] = src_start[p, l] + i
                dst += 1
    return x_RD.index_select(0, perm_R)


def seed_experts(experts: ExpertFFN, x_ND: torch.Tensor, counts_L: list[int]) -> torch.Tensor:
    """Per-expert loop indexing the stacked weights (W[e]) inside the loop."""
    ys, start = [], 0
    for e, n in enumerate(counts_L):
        x = x_ND[start:start + n]
        ys.append((F.silu(x @ experts.W_gate[e]) * (x @ experts.W_val[e])) @ experts.W_out[e])
        start += n
    return torch.cat(ys)


class SeedEPDispatcher:
    """Same call as EPDispatcher, built from the seed's loops."""

    def __init__(self, group, ep_size: int, ep_rank: int):
        self.group, self.ep_size, self.ep_rank = group, ep_size, ep_rank

    def forward_done(self) -> None:
        """After a training forward (Transformer): the seed records nothing."""

    def __call__(self, x_TD, expert_ids_TK, weights_TK, experts: ExpertFFN, num_experts: int,
                 positions: int | None = None):
        P, L, T = self.ep_size, num_experts // self.ep_size, x_TD.shape[0]
        x_ND, token_idx_N, order_N, counts_E = seed_pack(x_TD, expert_ids_TK, num_experts)
        send_PL = counts_E.view(P, L)
        recv_PL = torch.empty_like(send_PL)
        if P > 1:
            comm.all_to_all_single(recv_PL, send_PL, group=self.group, axis="ep")
        else:
            recv_PL = send_PL
        send_host, recv_host = send_PL.tolist(), recv_PL.tolist()
        in_splits, out_splits = [sum(r) for r in send_host], [sum(r) for r in recv_host]
        counts_L = [sum(c) for c in zip(*recv_host)]
        x_RD = all_to_all_rows(x_ND, out_splits, in_splits, self.group) if P > 1 else x_ND
        y_RD = seed_permute(seed_experts(experts, seed_permute(x_RD, recv_host), counts_L), recv_host, inverse=True)
        y_ND = all_to_all_rows(y_RD, in_splits, out_splits, self.group) if P > 1 else y_RD
        w_N = weights_TK.reshape(-1).index_select(0, order_N)
        return combine(y_ND, w_N, token_idx_N, T)
