"""Mixture-of-experts FFN: fp32 router, top-k, SwiGLU experts stored contiguously, dropless by default.

Shape legend: T tokens, D d_model, E experts (global), L local experts, K top_k, F expert hidden,
N assignments (T*K) packed expert-major, B sequences of S tokens.

The layer never asks for a rank: it is handed a dispatcher (`LocalDispatcher` here, the
all-to-all one from `parallel/ep.py` under EP) that moves packed assignments to the experts'
owners and back. Default maths: Mixtral's (softmax router, top-k, renormalised weights, SwiGLU).

Load management (docs/moe.md), each a pure function of this microbatch's tokens, so every layout agrees:
- scores: softmax (Mixtral) or sigmoid (DeepSeek-V3); weights are the selected scores, renormalised when
  norm_topk, times routed_scale.
- router_bias (aux-loss-free balancing, DeepSeek-V3): added to the scores for *selection only*; a buffer,
  never a parameter, nudged once per optimizer step from the step's global counts (`update_bias`).
- balance loss (Switch/GShard; per sequence with aux_scope="sequence", DeepSeek-V3) and router z-loss
  (ST-MoE), returned already weighted by their coefficients.
- capacity_factor > 0: each expert keeps at most ceil(cf * T*K / E) of this microbatch's assignments,
  highest routing weight first, ties to the lower token index. A dropped assignment gets expert id E
  ("no expert"): it sorts after every real one and is never dispatched (the residual carries the token).
  Under tensor parallel each rank routes a shard of the microbatch: the ranking is over the whole microbatch
  (`_capacity_keep`), so the dropped set is one process's.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import fp8 as float8, wgrad
from .experts import ExpertShard, LocalExperts
from .tokens import LOCAL, TokenShard
from .wgrad import Linear


class SwiGLU(nn.Module):
    """One always-on SwiGLU MLP: the dense FFN of non-MoE layers, and the shared experts of an MoE layer."""

    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = Linear(d_model, ffn_dim, bias=False)
        self.up_proj = Linear(d_model, ffn_dim, bias=False)
        self.down_proj = Linear(ffn_dim, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ExpertFFN(nn.Module):
    """L SwiGLU experts as three stacked weights: W_gate, W_val [L, D, F], W_out [L, F, D].

    `impl` (model.experts_impl): "loop" runs one GEMM per expert and projection (host counts: split sizes);
    "grouped" one `torch._grouped_mm` per projection over all L experts, its group offsets a device tensor, so
    the experts need no host count; "auto" picks per device and dtype (`grouped_wins`, docs/moe.md)."""
    wgrad_store: wgrad.WeightGradStore | None = None  # set: weight gradients deferrable (model/wgrad.py)
    fp8: "float8.Fp8 | None" = None  # set: each GEMM in FP8, the loop under plain autograd (model/fp8.py)

    def __init__(self, num_local: int, d_model: int, ffn_dim: int, impl: str = "loop"):
        super().__init__()
        assert impl in ("loop", "grouped", "auto"), impl
        self.impl = impl
        self.W_gate = nn.Parameter(torch.empty(num_local, d_model, ffn_dim))
        self.W_val = nn.Parameter(torch.empty(num_local, d_model, ffn_dim))
        self.W_out = nn.Parameter(torch.empty(num_local, ffn_dim, d_model))

    def grouped(self, x: torch.Tensor) -> bool:
        """Does a call on x run the grouped GEMMs? (Dispatchers ask first: the grouped path needs no host counts.)"""
        return self.fp8 is None and (self.impl == "grouped" or (self.impl == "auto" and grouped_wins(x)))

    def forward(self, x_ND: torch.Tensor, counts_L: "list[int] | torch.Tensor", trip=None,
                x_fp8: "tuple[torch.Tensor, torch.Tensor] | None" = None) -> torch.Tensor:
        """x_ND holds counts_L[l] rows for local expert l, contiguous and in order (a device tensor of counts: no
        host sync on the grouped path; the loop reads it to the host). `trip` (parallel.ep_overlap):
        trip(W_gate, W_val, W_out, wgrad_store) runs the experts itself, inside this module's call, so that what
        wraps the module (FSDP2's unshard of the weights) happens around it as around the plain path. `x_fp8`: x's
        FP8 operand (bits, per-row scales) as the EP dispatch sent it (parallel.fp8_comm, model/fp8.py)."""
        if trip is not None:
            return trip(self.W_gate, self.W_val, self.W_out, self.wgrad_store)
        if self.fp8 is not None:
            counts_L = counts_L.tolist() if isinstance(counts_L, torch.Tensor) else counts_L
            return float8.experts(x_ND, self.W_gate, self.W_val, self.W_out, counts_L, self.fp8, x_fp8)
        if self.grouped(x_ND):
            if not isinstance(counts_L, torch.Tensor):
                counts_L = torch.tensor(counts_L, device=x_ND.device)
            counts_L = wgrad.group_offsets(counts_L)  # the grouped GEMMs' offsets, on the device
        elif isinstance(counts_L, torch.Tensor):
            counts_L = counts_L.tolist()  # the loop's split sizes: one host sync per call, not per expert
        if self.wgrad_store is not None and torch.is_grad_enabled():  # the same GEMMs, backward by hand
            return wgrad.experts(x_ND, self.W_gate, self.W_val, self.W_out, counts_L, self.wgrad_store)
        if isinstance(counts_L, torch.Tensor):
            return wgrad.grouped_swiglu(x_ND, self.W_gate, self.W_val, self.W_out, counts_L)
        # Split the weights once per call (backward is one stack), never W[e] in the loop:
        # indexing allocates a full-size zero gradient per expert (the baselines: ~45% of backward).
        gates, vals, outs = self.W_gate.unbind(0), self.W_val.unbind(0), self.W_out.unbind(0)
        ys = []
        for x, wg, wv, wo in zip(x_ND.split(counts_L), gates, vals, outs):
            ys.append((F.silu(x @ wg) * (x @ wv)) @ wo)  # (n_l, D); n_l may be 0
        return torch.cat(ys) if ys else x_ND.new_zeros(0, x_ND.shape[1])


# model.experts_impl "auto": (device type, compute dtype) -> grouped? Measured (docs/moe.md, "Grouped expert
# GEMMs"). CUDA's grouped kernel is bf16 on sm90/sm100 only; elsewhere _grouped_mm falls back to one mm per group
# after reading the offsets to the host (a sync per GEMM), so fp32 on CUDA keeps the loop.
AUTO_GROUPED = {("cpu", torch.float32): False, ("cpu", torch.bfloat16): False,
                ("cuda", torch.float32): False, ("cuda", torch.bfloat16): True}


def grouped_wins(x: torch.Tensor) -> bool:
    dev = x.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    if dev == "cuda" and torch.cuda.get_device_capability(x.device)[0] not in (9, 10):
        return False  # no grouped kernel: the fallback syncs
    return AUTO_GROUPED.get((dev, dtype), False)


def expert_counts(ids: torch.Tensor, n: int) -> torch.Tensor:
    """bincount(ids, minlength=n) for ids in [0, n), without bincount's host read of max(ids) on CUDA."""
    flat = ids.reshape(-1)
    return flat.new_zeros(n).scatter_add_(0, flat, torch.ones_like(flat))


def pack_expert_major(expert_ids_TK: torch.Tensor, num_experts: int):
    """Token-major assignments -> expert-major order, vectorised.

    Returns (order_N, token_idx_N, counts_E): assignment `order[n]` (flat index t*K+k) is the
    n-th in expert-major order, it belongs to token `token_idx[n]`, and expert e owns
    `counts_E[e]` consecutive rows. Dropped assignments (id == num_experts) come last, after
    sum(counts_E) rows: callers dispatch only that prefix.
    """
    flat_ids_N = expert_ids_TK.reshape(-1)
    order_N = torch.argsort(flat_ids_N, stable=True)  # stable: token order kept within an expert
    token_idx_N = order_N // expert_ids_TK.shape[1]
    counts_E = expert_counts(flat_ids_N, num_experts + 1)[:num_experts]  # bin E: dropped
    return order_N, token_idx_N, counts_E


def in_backward() -> bool:
    """True while autograd's engine runs a backward on this thread (a checkpointed block's recompute included);
    also true on CUDA's autograd device threads, which no Python thread-local would reach. Under
    parallel.ep_overlap_microbatches it names the lane of a call: the backward lane's, else the forward lane's."""
    return torch._C._current_graph_task_id() != -1


def capacity_keep(expert_ids_TK: torch.Tensor, weights_TK: torch.Tensor, num_experts: int,
                  capacity: int) -> torch.Tensor:
    """keep_TK: True for the `capacity` assignments of each expert with the highest weight, ties to the lower
    token index (two stable sorts, no loop), so the same assignments survive whatever the layout."""
    ids_N, w_N = expert_ids_TK.reshape(-1), weights_TK.reshape(-1)
    by_weight_N = torch.argsort(w_N, descending=True, stable=True)  # stable: equal weights keep index t*K+k order
    by_expert_N = by_weight_N[torch.argsort(ids_N[by_weight_N], stable=True)]  # expert-major, best first
    counts_E = expert_counts(ids_N, num_experts)
    start_E = counts_E.cumsum(0) - counts_E
    sorted_ids_N = ids_N[by_expert_N]
    rank_N = torch.arange(ids_N.numel(), device=ids_N.device) - start_E[sorted_ids_N]  # place in its expert's queue
    keep_N = torch.empty_like(ids_N, dtype=torch.bool)
    keep_N[by_expert_N] = rank_N < capacity
    return keep_N.view_as(expert_ids_TK)


class LocalDispatcher:
    """Single-device dispatch: all experts live here. `may_drop` (capacity_factor > 0): dropped assignments may
    sit past the kept prefix, whose length only the device knows on the grouped path."""

    def __init__(self, may_drop: bool = False):
        self.may_drop = may_drop

    def forward_done(self) -> None:
        """After a training forward (Transformer): nothing to record on one device."""

    def __call__(self, x_TD, expert_ids_TK, weights_TK, experts: ExpertFFN, num_experts: int,
                 positions: int | None = None):
        order_N, token_idx_N, counts_E = pack_expert_major(expert_ids_TK, num_experts)
        if experts.grouped(x_TD):  # no host sync: counts and offsets stay on the device
            x_ND = x_TD.index_select(0, token_idx_N)
            if self.may_drop:  # rows past the kept prefix: no expert computes them; zero them both ways
                dropped_N1 = (torch.arange(order_N.numel(), device=order_N.device) >= counts_E.sum()).unsqueeze(1)
                x_ND = x_ND.masked_fill(dropped_N1, 0)  # its backward zeroes their (unwritten) input gradient
                y_ND = experts(x_ND, counts_E).masked_fill(dropped_N1, 0)
            else:
                y_ND = experts(x_ND, counts_E)
            return combine(y_ND, weights_TK.reshape(-1).index_select(0, order_N), token_idx_N, x_TD.shape[0])
        counts = counts_E.tolist()  # the loop's one host sync per layer call, not per expert
        N = sum(counts)  # dropped assignments sort last: never computed
        order_N, token_idx_N = order_N[:N], token_idx_N[:N]
        x_ND = x_TD.index_select(0, token_idx_N)
        y_ND = experts(x_ND, counts)
        w_N = weights_TK.reshape(-1).index_select(0, order_N)
        return combine(y_ND, w_N, token_idx_N, x_TD.shape[0])


def combine(y_ND: torch.Tensor, w_N: torch.Tensor, token_idx_N: torch.Tensor, T: int) -> torch.Tensor:
    """Weight each expert output by its router weight and sum the K outputs of each token."""
    y_ND = y_ND * w_N.unsqueeze(1).to(y_ND.dtype)
    return y_ND.new_zeros(T, y_ND.shape[1]).index_add_(0, token_idx_N, y_ND)


class MoE(nn.Module):
    """Routed experts [expert_start, expert_end) of this shard (in the slots its `expert_shard` says), plus optional
    shared experts.

    Shared experts (`shared_ffn_dim` > 0: Qwen2-MoE, DeepSeek) see every token. n shared experts of hidden F
    are one SwiGLU of hidden n*F (SwiGLU is a sum over hidden units, so that is the same function). They
    are replicated like attention weights, never sharded over EP: their names must not contain ".experts."
    (`is_expert_param`). `shared_gate` scales their output by sigmoid(x @ w) per token (Qwen2-MoE).

    Router options (module docstring; defaults: Mixtral's softmax router with the plain Switch loss):
    score "softmax" | "sigmoid", routed_scale, bias_update_rate (> 0 adds `router_bias`), aux_coef,
    aux_scope "micro" | "sequence", z_loss_coef, capacity_factor (0 = dropless), n_group/topk_group
    (DeepSeekMoE's group-limited selection, `_mask_groups`).

    `lane_local_router_state` (set by parallel/ep.py's apply_ep for parallel.ep_overlap_microbatches): keep what
    `route` leaves for Transformer.forward (`last_counts_E`, `last_router_stats`) once per lane. With two lanes a
    checkpointed block's recompute (backward lane) runs `route` too, and could land between the forward lane's
    route and its read: the wrong microbatch's counts would reach the step's routing record (the log, the router-bias
    update, the placement window). Per lane (`in_backward`, the rule that picks a call's EP group), a recompute never
    touches what a forward reads.
    """
    lane_local_router_state: bool = False
    # MTP depth k's block (model/mtp.py) runs on every position; the last seq_tail = k of each whole sequence have
    # no target: they are never routed, nor counted in any statistic, as if the block ran on S - k positions.
    seq_tail: int = 0

    def __init__(self, d_model: int, ffn_dim: int, num_experts: int, top_k: int, norm_topk: bool,
                 expert_start: int, expert_end: int, *, shared_ffn_dim: int = 0, shared_gate: bool = False,
                 score: str = "softmax", routed_scale: float = 1.0, bias_update_rate: float = 0.0,
                 aux_coef: float = 1.0, aux_scope: str = "micro", z_loss_coef: float = 0.0,
                 capacity_factor: float = 0.0, n_group: int = 1, topk_group: int = 1, experts_impl: str = "loop",
                 tokens: TokenShard = LOCAL, expert_shard: ExpertShard | None = None):
        super().__init__()
        # The token ranks (tensor or context parallel, model/tokens.py; LOCAL: every token is here): this rank routes
        # its `runs` of each sequence's positions; tokens.sum / tokens.mean sum over the ranks holding the rest
        # (gradient straight through), so the balance loss, the z-loss and the counts are the whole microbatch's;
        # tokens.gather_routing puts the ranks' routing in sequence order (no gradient: capacity's ranking).
        self.tokens = tokens
        self.token_shards = tokens.size
        assert score in ("softmax", "sigmoid") and aux_scope in ("micro", "sequence"), (score, aux_scope)
        self.score, self.routed_scale, self.bias_update_rate = score, routed_scale, bias_update_rate
        self.aux_coef, self.aux_scope, self.z_loss_coef = aux_coef, aux_scope, z_loss_coef
        self.capacity_factor = capacity_factor
        self.n_group, self.topk_group = n_group, topk_group  # DeepSeekMoE's group-limited routing (route)
        # Replicated and checkpointed like a weight, but a buffer: the optimizer never sees it (update_bias moves it).
        self.register_buffer("router_bias", torch.zeros(num_experts) if bias_update_rate > 0 else None)
        # What the last route() left (`last_counts_E`, `last_router_stats`): [0] a forward's, [1] a backward's (a
        # checkpointed block's recompute), apart only with lane_local_router_state; else [0] holds every call's.
        # (their keys there from the start: a compiled block's trace guards on them)
        self.router_records: tuple[dict, dict] = tuple({"counts_E": None, "stats": None} for _ in range(2))
        self._stats_tail: dict[tuple, torch.Tensor] = {}  # (T*K, dtype, device) -> [0 dropped, T*K, 1]
        self.num_experts, self.top_k, self.norm_topk = num_experts, top_k, norm_topk
        self.expert_start, self.expert_end = expert_start, expert_end
        # Which global expert each slot of `experts` holds (model/experts.py): one slot per expert of [expert_start,
        # expert_end), and under a balanced placement spare slots for copies (parallel/placement.py)
        self.expert_shard = expert_shard if expert_shard is not None else LocalExperts(expert_start, expert_end)
        self.router = Linear(d_model, num_experts, bias=False)  # scores against all E experts
        slots = len(self.expert_shard.experts_at(self.expert_shard.rank))
        self.experts = ExpertFFN(slots, d_model, ffn_dim, experts_impl)
        self.dispatcher = LocalDispatcher(may_drop=bool(capacity_factor))
        self.shared_expert = SwiGLU(d_model, shared_ffn_dim) if shared_ffn_dim else None
        self.shared_expert_gate = Linear(d_model, 1, bias=False) if shared_ffn_dim and shared_gate else None

    def _router_record(self) -> dict:
        return self.router_records[self.lane_local_router_state and in_backward()]

    @property
    def last_counts_E(self) -> torch.Tensor | None:
        """Tokens per expert the last route() asked for (drops included; stats, no graph); this lane's."""
        return self._router_record().get("counts_E")

    @property
    def last_router_stats(self) -> torch.Tensor | None:
        """[balance loss, z-loss, dropped assignments, assignments, 1] of the last route() (stats, detached)."""
        return self._router_record().get("stats")

    def route(self, x_TD: torch.Tensor, B: int, S: int, whole: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(expert_ids_TK, weights_TK, aux) for T = B*S tokens: ids are E where capacity dropped the assignment;
        aux = aux_coef * balance + z_loss_coef * z, a constant zero when both coefficients are 0. `whole`: the
        routed positions of a whole sequence (default S * token_shards; less by seq_tail in an MTP block)."""
        T, K, E = x_TD.shape[0], self.top_k, self.num_experts
        whole = S * self.token_shards if whole is None else whole
        # Router in fp32 (stable softmax/sigmoid under bf16 autocast).
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            w = self.router.weight  # fp32 params: .float() would be the same tensor, kept so a deferred grad lands
            logits_TE = wgrad.linear(x_TD.float(), w if w.dtype == torch.float32 else w.float(), None,
                                     self.router.wgrad_store)
            scores_TE = logits_TE.softmax(dim=-1) if self.score == "softmax" else logits_TE.sigmoid()
        # Select on score + bias (the bias steers selection only), weight by the selected scores (DeepSeek-V3).
        if self.router_bias is None and self.n_group == 1:  # topk's values are the selected scores: no gather
            weights_TK, expert_ids_TK = scores_TE.topk(K, dim=-1)
        else:
            choice_TE = scores_TE if self.router_bias is None else scores_TE + self.router_bias
            if self.n_group > 1:  # group-limited: only experts of the topk_group best groups may be chosen
                choice_TE = self._mask_groups(choice_TE)
            expert_ids_TK = choice_TE.topk(K, dim=-1).indices
            weights_TK = scores_TE.gather(1, expert_ids_TK)
        if self.norm_topk:
            denom = weights_TK.sum(dim=-1, keepdim=True)
            if self.score == "sigmoid":  # sigmoids may underflow; K softmax scores sum to at least K/E
                denom = denom.clamp_min(1e-20)
            weights_TK = weights_TK / denom
        if self.routed_scale != 1.0:
            weights_TK = weights_TK * self.routed_scale

        # Switch/GShard balance loss E * sum_e f_e * P_e, f_e = share of the assignments to e, P_e = mean router
        # probability of e (sigmoid scores normalised per token, DeepSeek-V3); per microbatch or per sequence.
        counts_E = expert_counts(expert_ids_TK, E)  # bincount without its host read on CUDA
        probs_TE = scores_TE if self.score == "softmax" else scores_TE / scores_TE.sum(dim=-1, keepdim=True)
        balance, counts_E = self._balance(expert_ids_TK, probs_TE, counts_E, B, S, whole)
        with torch.set_grad_enabled(torch.is_grad_enabled() and bool(self.z_loss_coef)):  # a statistic only: no graph
            z_T = logits_TE.logsumexp(dim=-1).square()  # ST-MoE: keeps router logits small
            z_loss = self.tokens.mean(z_T, 0, B * whole)
        # 0 + x and 1 * x would be x: no op for the default coefficients (aux_coef 1, z_loss_coef 0)
        aux = (balance if self.aux_coef == 1.0 else self.aux_coef * balance) if self.aux_coef \
            else logits_TE.new_zeros(())
        if self.z_loss_coef:
            aux = aux + self.z_loss_coef * z_loss

        # Capacity before dispatch: the dropped assignments never leave this rank.
        stats = [balance.detach(), z_loss.detach()]
        if self.capacity_factor:
            keep_TK = self._capacity_keep(expert_ids_TK, weights_TK.detach(), B, S, whole)
            expert_ids_TK = expert_ids_TK.masked_fill(~keep_TK, E)
            stats.append((keep_TK.numel() - keep_TK.sum()).to(balance.dtype))
        record = self._router_record()
        record["counts_E"] = counts_E  # what the router asked for (drops included); bincount's: no graph
        # [balance, z, dropped, T*K, 1]: the constant tail cached per shape (two ops a call, no H2D copy per call)
        # (traced by a compiled block: a constant of the graph; a cache's missing key would be a guard, a recompile)
        tail = balance.new_tensor([0.0, T * K, 1.0]) if torch.compiler.is_compiling() else \
            self._stats_tail.get((T * K, balance.dtype, balance.device))
        if tail is None:
            tail = self._stats_tail[(T * K, balance.dtype, balance.device)] = balance.new_tensor([0.0, T * K, 1.0])
        record["stats"] = torch.cat([torch.stack(stats), tail[len(stats) - 2:]])
        return expert_ids_TK, weights_TK, aux

    def _mask_groups(self, choice_TE: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's node-limited routing: experts in n_group groups (contiguous ids: with experts placed per
        node, a group is a node); a group's score is the sum of its 2 best biased scores; each token keeps its
        topk_group best groups, the other experts' scores become -inf (transformers' DeepseekV3TopkRouter)."""
        T, E, G = choice_TE.shape[0], self.num_experts, self.n_group
        per_group_TGE = choice_TE.view(T, G, E // G)
        group_TG = per_group_TGE.topk(min(2, E // G), dim=-1).values.sum(dim=-1)
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool)
        keep_TG.scatter_(1, group_TG.topk(self.topk_group, dim=-1).indices, True)
        return per_group_TGE.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, E)

    def _balance(self, expert_ids_TK, probs_TE, counts_E, B: int, S: int, whole: int):
        """route's balance loss over the whole microbatch, and its counts: this rank holds S of the `whole` routed
        positions of each sequence (all of them on one device), whose counts and probabilities the token shard sums
        over the token ranks (`tokens.sum`, `tokens.mean`). Per microbatch, or (aux_scope "sequence", DeepSeek-V3's
        sequence-wise loss) per sequence, averaged over the B sequences."""
        E, K, tokens = self.num_experts, self.top_k, self.tokens
        counts_E = tokens.sum(counts_E)
        if self.aux_scope == "micro":
            f_E = counts_E.to(probs_TE.dtype) / (B * whole * K)
            return E * (f_E * tokens.mean(probs_TE, 0, B * whole)).sum(), counts_E
        hits_BE = probs_TE.new_zeros(B, E).scatter_add_(1, expert_ids_TK.view(B, S * K), probs_TE.new_ones(B, S * K))
        f_BE = tokens.sum(hits_BE) / (whole * K)
        return E * (f_BE * tokens.mean(probs_TE.view(B, S, E), 1, whole)).sum(dim=1).mean(), counts_E

    def _capacity_keep(self, expert_ids_TK, weights_TK, B: int, S: int, whole: int) -> torch.Tensor:
        """capacity_keep over the whole microbatch (B sequences of `whole` routed positions), this rank's (B, S)
        part of it. Across token ranks the ranking crosses them (weights first, so no per-expert offset would do):
        `tokens.gather_routing` (one all-gather of every rank's (weight, id) pairs, padded to the shard's length with
        "no expert"; the pairs themselves on one device) puts them in one process's token order; every rank ranks
        them all and keeps its own."""
        E, K = self.num_experts, self.top_k
        capacity = math.ceil(self.capacity_factor * B * whole * K / E)
        shard = (whole + self.seq_tail) // self.token_shards  # a rank's positions, routed or not
        w_BXK, ids_BXK = self.tokens.gather_routing(weights_TK.view(B, S, K), expert_ids_TK.view(B, S, K), shard, E)
        keep = capacity_keep(ids_BXK[:, :whole].reshape(B * whole, K), w_BXK[:, :whole].reshape(B * whole, K), E,
                             capacity).view(B, whole, K)  # the tail sits past `whole`
        parts = [keep[:, s:s + n] for s, n in self.tokens.runs(shard)]  # routed: its first S
        mine = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
        return mine[:, :S].reshape(B * S, K)

    @torch.no_grad()
    def update_bias(self, counts_E: torch.Tensor) -> None:
        """Aux-loss-free balancing (DeepSeek-V3; Wang et al. 2024): bias_e += rate * sign(mean load - load_e), with
        counts_E the optimizer step's GLOBAL tokens per expert (every data rank, every microbatch)."""
        load_E = counts_E.to(self.router_bias.dtype)
        self.router_bias += self.bias_update_rate * torch.sign(load_E.mean() - load_E)

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (y (B, S, D), this layer's weighted router loss on these tokens (see `route`))."""
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        whole = S * self.token_shards - self.seq_tail
        runs = self.tokens.runs(S)
        own = sum(min(n, max(0, whole - s)) for s, n in runs)  # routed: a prefix of this shard (seq_tail: the rest)
        r_TD = x_TD if own == S else x_BSD[:, :own].reshape(B * own, D)
        expert_ids_TK, weights_TK, aux = self.route(r_TD, B, own, whole)
        # positions: the rank's B*S, routed or not (an MTP tail routes fewer on one CP rank): static buffers' size
        y_TD = self.dispatcher(r_TD, expert_ids_TK, weights_TK.to(x_TD.dtype), self.experts, self.num_experts, B * S)
        if own < S:  # the tail's positions get no routed output (nothing reads them)
            y_TD = F.pad(y_TD.view(B, own, D), (0, 0, 0, S - own)).view(B * S, D)
        if self.shared_expert is not None:  # every token, on this rank: no dispatch
            shared_TD = self.shared_expert(x_TD)
            if self.shared_expert_gate is not None:
                shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
            y_TD = y_TD + shared_TD
        return y_TD.view(B, S, D), aux
