"""Mixture-of-experts FFN: fp32 router, top-k, SwiGLU experts stored contiguously, dropless.

Shape legend: T tokens, D d_model, E experts (global), L local experts, K top_k, F expert hidden,
N assignments (T*K) packed expert-major.

The layer never asks for a rank: it is handed a dispatcher (`LocalDispatcher` here, the
all-to-all one from `parallel/ep.py` under EP) that moves packed assignments to the experts'
owners and back. Same maths as Mixtral (softmax router, top-k, renormalised weights, SwiGLU).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SwiGLU(nn.Module):
    """One always-on SwiGLU MLP: the dense FFN of non-MoE layers, and the shared experts of an MoE layer."""

    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.up_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ExpertFFN(nn.Module):
    """L SwiGLU experts as three stacked weights: W_gate, W_val [L, D, F], W_out [L, F, D]."""

    def __init__(self, num_local: int, d_model: int, ffn_dim: int):
        super().__init__()
        self.W_gate = nn.Parameter(torch.empty(num_local, d_model, ffn_dim))
        self.W_val = nn.Parameter(torch.empty(num_local, d_model, ffn_dim))
        self.W_out = nn.Parameter(torch.empty(num_local, ffn_dim, d_model))

    def forward(self, x_ND: torch.Tensor, counts_L: list[int]) -> torch.Tensor:
        """x_ND holds counts_L[l] rows for local expert l, contiguous and in order."""
        # Split the weights once per call (backward is one stack), never W[e] in the loop:
        # indexing allocates a full-size zero gradient per expert (BASELINES: ~45% of backward).
        gates, vals, outs = self.W_gate.unbind(0), self.W_val.unbind(0), self.W_out.unbind(0)
        ys = []
        for x, wg, wv, wo in zip(x_ND.split(counts_L), gates, vals, outs):
            ys.append((F.silu(x @ wg) * (x @ wv)) @ wo)  # (n_l, D); n_l may be 0
        return torch.cat(ys) if ys else x_ND.new_zeros(0, x_ND.shape[1])


def pack_expert_major(expert_ids_TK: torch.Tensor, num_experts: int):
    """Token-major assignments -> expert-major order, vectorised.

    Returns (order_N, token_idx_N, counts_E): assignment `order[n]` (flat index t*K+k) is the
    n-th in expert-major order, it belongs to token `token_idx[n]`, and expert e owns
    `counts_E[e]` consecutive rows.
    """
    flat_ids_N = expert_ids_TK.reshape(-1)
    order_N = torch.argsort(flat_ids_N, stable=True)  # stable: token order kept within an expert
    token_idx_N = order_N // expert_ids_TK.shape[1]
    counts_E = torch.bincount(flat_ids_N, minlength=num_experts)
    return order_N, token_idx_N, counts_E


class LocalDispatcher:
    """Single-device dispatch: all experts live here."""

    def __call__(self, x_TD, expert_ids_TK, weights_TK, experts: ExpertFFN, num_experts: int):
        order_N, token_idx_N, counts_E = pack_expert_major(expert_ids_TK, num_experts)
        x_ND = x_TD.index_select(0, token_idx_N)
        y_ND = experts(x_ND, counts_E.tolist())  # one host sync per layer call, not per expert
        w_N = weights_TK.reshape(-1).index_select(0, order_N)
        return combine(y_ND, w_N, token_idx_N, x_TD.shape[0])


def combine(y_ND: torch.Tensor, w_N: torch.Tensor, token_idx_N: torch.Tensor, T: int) -> torch.Tensor:
    """Weight each expert output by its router weight and sum the K outputs of each token."""
    y_ND = y_ND * w_N.unsqueeze(1).to(y_ND.dtype)
    return y_ND.new_zeros(T, y_ND.shape[1]).index_add_(0, token_idx_N, y_ND)


class MoE(nn.Module):
    """Routed experts [expert_start, expert_end) of this shard, plus optional shared experts.

    Shared experts (`shared_ffn_dim` > 0: Qwen2-MoE, DeepSeek) see every token. n shared experts of hidden F
    are one SwiGLU of hidden n*F (SwiGLU is a sum over hidden units, so that is the same function). They
    are replicated like attention weights, never sharded over EP: their names must not contain ".experts."
    (`is_expert_param`). `shared_gate` scales their output by sigmoid(x @ w) per token (Qwen2-MoE).
    """

    def __init__(self, d_model: int, ffn_dim: int, num_experts: int, top_k: int, norm_topk: bool,
                 expert_start: int, expert_end: int, *, shared_ffn_dim: int = 0, shared_gate: bool = False):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk = num_experts, top_k, norm_topk
        self.expert_start, self.expert_end = expert_start, expert_end
        self.router = nn.Linear(d_model, num_experts, bias=False)  # scores against all E experts
        self.experts = ExpertFFN(expert_end - expert_start, d_model, ffn_dim)
        self.dispatcher = LocalDispatcher()
        self.shared_expert = SwiGLU(d_model, shared_ffn_dim) if shared_ffn_dim else None
        self.shared_expert_gate = nn.Linear(d_model, 1, bias=False) if shared_ffn_dim and shared_gate else None
        self.last_counts_E: torch.Tensor | None = None  # tokens per expert of the last forward (stats)

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (y (B, S, D), load-balancing loss of this layer on these tokens)."""
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        # Router in fp32 (stable softmax under bf16 autocast).
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            logits_TE = F.linear(x_TD.float(), self.router.weight.float())
            probs_TE = logits_TE.softmax(dim=-1)
        weights_TK, expert_ids_TK = probs_TE.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        # Switch/GShard balance loss: E * sum_e f_e * P_e, f_e = share of the T*K assignments to e.
        counts_E = torch.bincount(expert_ids_TK.reshape(-1), minlength=self.num_experts)
        f_E = counts_E.to(probs_TE.dtype) / expert_ids_TK.numel()
        aux = self.num_experts * (f_E * probs_TE.mean(dim=0)).sum()
        self.last_counts_E = counts_E.detach()
        y_TD = self.dispatcher(x_TD, expert_ids_TK, weights_TK.to(x_TD.dtype), self.experts, self.num_experts)
        if self.shared_expert is not None:  # every token, on this rank: no dispatch
            shared_TD = self.shared_expert(x_TD)
            if self.shared_expert_gate is not None:
                shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
            y_TD = y_TD + shared_TD
        return y_TD.view(B, S, D), aux
