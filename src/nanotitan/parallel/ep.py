"""Expert parallelism: move each token's top-k assignments to the ranks that own their experts and back.

Shape legend (as in model/moe.py): T tokens on this rank, D d_model, E experts (global), L = E/EP local
experts, K top_k, P = EP ranks, N = T*K assignments packed expert-major on this rank, R assignments
received by this rank (from all P sources).

One layer call (seed, "Dispatch, expert computation and combine"):
  1. pack the local assignments expert-major (`pack_expert_major`); since rank p owns experts
     [p*L, (p+1)*L), expert-major is also destination-major: the all-to-all send order.
  2. exchange the per-destination counts send_PL -> recv_PL with one small all-to-all, and read both
     matrices to the host in ONE `.tolist()` (the only host sync: split sizes must be Python ints).
  3. payload all-to-all with uneven splits, in the compute dtype (bf16 under autocast: half the bytes);
     received rows are source-major (p, then l).
  4. permute source-major -> expert-major (vectorised, `source_to_expert_major`), run the L experts,
     undo the permutation, and send every row back with the splits swapped.
  5. `combine`: weight each output by its router weight and sum the K outputs of each token.
Backward is the same path reversed: `_AllToAll.backward` is the all-to-all with the splits swapped.
Every collective goes through `parallel.comm` on axis "ep", so its time and bytes are accounted.
Dropless by default: every assignment reaches its expert, so EP computes exactly what one process would.
With a capacity factor the router has already dropped assignments (expert id E, model/moe.py) on the
source rank, per source microbatch, before step 1: they are never packed into a send, and each rank's
drops are the ones one process would make on the same microbatch.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..model.moe import ExpertFFN, combine, pack_expert_major
from . import comm


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all of rows; the gradient travels back along the same links (splits swapped).

    torch.distributed.nn.functional.all_to_all_single handles uneven splits on gloo too (checked on
    torch 2.13), but it is deprecated and bypasses `parallel.comm`, so its time would go unaccounted.
    """

    @staticmethod
    def forward(ctx, x_ND, out_splits: list[int], in_splits: list[int], group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out_RD = x_ND.new_empty(sum(out_splits), x_ND.shape[1])
        comm.all_to_all_single(out_RD, x_ND, out_splits, in_splits, group=group, axis="ep")
        return out_RD

    @staticmethod
    def backward(ctx, grad_RD):
        grad_ND = grad_RD.new_empty(sum(ctx.in_splits), grad_RD.shape[1])
        # gloo needs contiguous buffers; comm.all_to_all_single makes the input contiguous.
        comm.all_to_all_single(grad_ND, grad_RD, ctx.in_splits, ctx.out_splits, group=ctx.group, axis="ep")
        return grad_ND, None, None, None


def all_to_all_rows(x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable uneven all-to-all over dim 0: send in_splits[p] rows to rank p, receive out_splits[p]."""
    return _AllToAll.apply(x_ND, out_splits, in_splits, group)


def source_to_expert_major(recv_counts_PL: torch.Tensor, total: int) -> torch.Tensor:
    """Permutation `perm_R` with `x_expert_major = x_source_major[perm_R]`.

    The received buffer holds, for each source p and then each local expert l, recv_counts_PL[p, l]
    rows. Label every row with its local expert and stable-sort the labels: rows of expert l become
    contiguous and keep source order inside the expert (the order one process would use).
    `total` = recv_counts_PL.sum(), passed from the host so repeat_interleave needs no device sync.
    """
    P, L = recv_counts_PL.shape
    expert_of_slot = torch.arange(L, device=recv_counts_PL.device).repeat(P)  # (P*L,) slot (p, l) -> l
    expert_of_row_R = expert_of_slot.repeat_interleave(recv_counts_PL.reshape(-1), output_size=total)
    return torch.argsort(expert_of_row_R, stable=True)


def inverse_permutation(perm_R: torch.Tensor) -> torch.Tensor:
    inv_R = torch.empty_like(perm_R)
    inv_R[perm_R] = torch.arange(perm_R.numel(), device=perm_R.device)
    return inv_R


class EPDispatcher:
    """Drop-in for `LocalDispatcher` under EP: same call, experts spread over the EP group.

    `experts` must hold the L = num_experts / ep_size experts [ep_rank*L, (ep_rank+1)*L).
    Every rank of the group must call it the same number of times (it is collective), even with
    zero tokens.
    """

    def __init__(self, group, ep_size: int, ep_rank: int):
        if ep_size > 1 and group is None:
            raise ValueError(f"EPDispatcher with ep_size={ep_size} needs the EP process group (dims.group('ep'))")
        if not 0 <= ep_rank < ep_size:
            raise ValueError(f"ep_rank={ep_rank} outside [0, ep_size={ep_size})")
        self.group, self.ep_size, self.ep_rank = group, ep_size, ep_rank

    def __call__(self, x_TD, expert_ids_TK, weights_TK, experts: ExpertFFN, num_experts: int):
        P = self.ep_size
        L = num_experts // P
        assert L * P == num_experts and experts.W_gate.shape[0] == L, (
            f"experts hold {experts.W_gate.shape[0]} experts; expected num_experts/ep = {num_experts}/{P}")
        T, D = x_TD.shape

        # 1. pack expert-major == destination-major (assignments dropped by capacity sort last: never sent)
        order_N, token_idx_N, counts_E = pack_expert_major(expert_ids_TK, num_experts)

        # 2. counts: send_PL[p, l] = my assignments for expert p*L+l; recv_PL[p, l] = rank p's for my expert l
        send_PL = counts_E.view(P, L)
        recv_PL = self._exchange_counts(send_PL)
        send_host, recv_host = torch.stack([send_PL, recv_PL]).tolist()  # the one host sync per call
        in_splits = [sum(row) for row in send_host]
        out_splits = [sum(row) for row in recv_host]
        counts_L = [sum(col) for col in zip(*recv_host)]
        R, N = sum(out_splits), sum(in_splits)
        order_N, token_idx_N = order_N[:N], token_idx_N[:N]  # the kept prefix
        x_ND = x_TD.index_select(0, token_idx_N)
        # Under autocast the experts' GEMMs read x in the compute dtype anyway, so casting before the
        # dispatch changes no value and halves the bytes on the wire (bf16); the combine trip (expert
        # outputs) and both backward trips are already in it. fp32 runs skip this.
        if torch.is_autocast_enabled(x_ND.device.type):
            x_ND = x_ND.to(torch.get_autocast_dtype(x_ND.device.type))

        # 3. dispatch; 4. experts in expert-major order, then back to source-major
        x_RD = self._a2a(x_ND, out_splits, in_splits)
        perm_R = source_to_expert_major(recv_PL, R)
        y_RD = experts(x_RD.index_select(0, perm_R), counts_L).index_select(0, inverse_permutation(perm_R))
        y_ND = self._a2a(y_RD, in_splits, out_splits)  # return trip: splits swapped

        # 5. combine in this rank's packed order
        w_N = weights_TK.reshape(-1).index_select(0, order_N)
        return combine(y_ND, w_N, token_idx_N, T)

    def _exchange_counts(self, send_PL: torch.Tensor) -> torch.Tensor:
        if self.ep_size == 1:
            return send_PL
        recv_PL = torch.empty_like(send_PL)
        comm.all_to_all_single(recv_PL, send_PL, group=self.group, axis="ep")  # row p goes to rank p
        return recv_PL

    def _a2a(self, x_ND, out_splits, in_splits):
        return x_ND if self.ep_size == 1 else all_to_all_rows(x_ND, out_splits, in_splits, self.group)


def apply_ep(model: nn.Module, dims) -> nn.Module:
    """Install an EPDispatcher on every MoE layer of a Transformer shard (in place); no-op when ep == 1.

    The shard must have been built for this rank's experts (`build_shard_spec(cfg, pp_rank, ep_rank)`).
    """
    if dims.ep == 1:
        return model
    group = dims.group("ep")
    for moe in model.moe_layers():
        L = moe.num_experts // dims.ep
        if moe.num_experts % dims.ep:
            raise ValueError(f"model.num_experts={moe.num_experts} must be divisible by parallel.ep={dims.ep} "
                             f"(--model.num_experts or --parallel.ep)")
        if (moe.expert_start, moe.expert_end) != (dims.ep_rank * L, (dims.ep_rank + 1) * L):
            raise ValueError(f"MoE shard holds experts [{moe.expert_start}, {moe.expert_end}) but ep_rank "
                             f"{dims.ep_rank} owns [{dims.ep_rank * L}, {(dims.ep_rank + 1) * L}): build the "
                             f"model with build_shard_spec(cfg, pp_rank, ep_rank={dims.ep_rank})")
        moe.dispatcher = EPDispatcher(group, dims.ep, dims.ep_rank)
    return model
