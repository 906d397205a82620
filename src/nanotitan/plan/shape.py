"""The model and the layout as the planner sees them: parameter, FLOP and activation counts by formula,
a layout (dp, pp, ep, schedule, M, m), bytes per training state, and what one rank of each stage holds.

Shapes: V vocab, D d_model, F expert hidden, Fd dense FFN hidden, E experts, K top_k, S seq_len.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

from ..config.counts import attention_matmuls, attention_params, ffn_params, mtp_params
from ..config.config import SECTIONS, Config
from ..config.layout import expert_ranks
from ..model.spec import block_halves, even_counts, layer_bounds
from ..parallel.pp import facts as pp_facts

# ModelShape's fields read from model.* as they are (attention variants, MLA, MTP)
MODEL_FIELDS = ("n_kv_heads", "head_dim", "attn_bias", "qk_norm", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "mtp_layers")


@dataclass(frozen=True)
class ModelShape:
    """Parameter and FLOP counts by formula (config/counts.py, shared with config/fits.py; checked against real
    `Transformer` shards in tests). The attention fields are the config's (model.*: GQA, biases, q/k norms, MLA
    when kv_lora_rank > 0); mtp_layers multi-token-prediction modules (model/mtp.py) run on the last stage."""

    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn_dim: int  # expert hidden size (and the dense FFN's, unless dense_ffn_dim)
    num_experts: int
    top_k: int
    moe_every: int
    seq_len: int
    pos_table: int = 0  # rows of a learned position table on stage 0 (0 with rope)
    dense_ffn_dim: int = 0  # hidden size of the dense FFN layers (0 = ffn_dim)
    first_dense: int = 0  # the first k layers are dense (DeepSeek-V3: 3)
    n_shared_experts: int = 0  # always-on experts per MoE layer, replicated like non-expert params
    dense_layers: tuple[int, ...] = ()  # layers dense whatever moe_every says (Qwen's mlp_only_layers)
    n_kv_heads: int = 0  # 0 = n_heads
    head_dim: int = 0  # 0 = d_model / n_heads
    attn_bias: bool = False
    qk_norm: str = "none"
    q_lora_rank: int = 0  # MLA (kv_lora_rank > 0): the query's low rank (0: a plain q projection)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0  # multi-token-prediction depths, on the last stage with a replica of the embedding
    # what a query's attention spans, x 2 (plan/docs.py): 0 = the window (causal), else under packed documents the
    # documents' span (sum d^2 / S), times the slowest CP rank's share of the work over the mean
    attn_span: float = 0.0

    @staticmethod
    def from_config(cfg: Config, **extra) -> "ModelShape":
        m = cfg.model
        # The model's own dense-layer rules and widths (a shared expert of another width counts by its size).
        from_model = dict(first_dense=m.first_k_dense, dense_layers=tuple(m.dense_layers),
                          dense_ffn_dim=m.dense_ffn_dim,
                          n_shared_experts=round(m.shared_experts * (m.shared_ffn_dim or m.ffn_dim) / m.ffn_dim),
                          **{k: getattr(m, k) for k in MODEL_FIELDS})
        return ModelShape(vocab=m.vocab_size or cfg.data.vocab_size, d_model=m.d_model, n_layers=m.n_layers,
                          n_heads=m.n_heads, ffn_dim=m.ffn_dim, num_experts=m.num_experts, top_k=m.top_k,
                          moe_every=m.moe_every, seq_len=cfg.train.seq_len,
                          pos_table=m.max_seq_len if m.pos_emb == "learned" else 0, **{**from_model, **extra})

    def is_moe(self, i: int) -> bool:
        """Same rule as model.transformer.is_moe_layer (moe_every, first k dense, listed dense layers)."""
        return i >= self.first_dense and i % self.moe_every == 0 and i not in self.dense_layers

    @property
    def dense_hidden(self) -> int:
        return self.dense_ffn_dim or self.ffn_dim

    def layer_params(self, i: int) -> tuple[int, int]:
        """(non-expert params, params of ONE routed expert) of layer i."""
        ffn, expert = ffn_params(self, self.is_moe(i), self.n_shared_experts * self.ffn_dim)
        return attention_params(self) + ffn, expert

    def layer_fwd_flops(self, i: int) -> tuple[float, float]:
        """Forward FLOPs per token of layer i: (dense part, routed-expert part).
        Matches model.transformer.flops_per_token: attention scores count 2*S*H*(qk + v width) (not halved)."""
        D, F = self.d_model, self.ffn_dim
        dense = self.attn_part(i)["f_dense"]
        if self.is_moe(i):
            return dense + 2 * D * self.num_experts + 6 * D * F * self.n_shared_experts, 6 * D * F * self.top_k
        return dense + 6 * D * self.dense_hidden, 0.0

    def attn_part(self, i: int) -> dict:
        """Layer i's attention half (a pipeline cut may fall after it, model/spec.py): non-expert params, dense
        forward FLOPs per token, activation and backward elements per token; the FFN half is the rest."""
        D, H = self.d_model, self.n_heads
        matmuls, width = attention_matmuls(self)
        span = self.attn_span or self.seq_len  # keys per query x 2 (causal: the window; documents: plan/docs.py)
        return dict(params=attention_params(self), f_dense=2 * matmuls + 2 * span * H * width,
                    act=3 * D + 1 + self._attn_saved(), bwd=2 * D)

    def _attn_saved(self) -> float:
        """Elements per token the attention keeps past its input norm (4-byte units). Standard: q and k after RoPE,
        v, the SDPA output (o_proj reads it as a view), the log-sum-exp. MLA (model/mla.py): the q low-rank path's
        norm (its input, 1/rms, the normalised and weighted latents), the kv latent's (its input is the whole
        down-projection, the shared rope key included), then SDPA's q and k (the concatenated nope and rope parts),
        v (padded to their width, so that SDPA takes its flash path), its output, and o_proj's copy of the output's
        first Dv columns. Listed with saved_tensors_hooks (model/mla.py at d 256, 8 heads)."""
        H = self.n_heads
        if not self.kv_lora_rank:
            return 4 * H * (self.head_dim or self.d_model // H) + H
        Rq, R, Dn, Dr, Dv = (self.q_lora_rank, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim,
                             self.v_head_dim)
        q_path = 3 * Rq + 1 if Rq else 0
        return q_path + (R + Dr) + 1 + 2 * R + 4 * H * (Dn + Dr) + H * Dv + H

    def layer_act_elems(self, i: int) -> float:
        """Elements autograd keeps per token for layer i's backward (listed in docs/planner.md;
        4-byte units, int64 indices count 2)."""
        D, F, K, E = self.d_model, self.ffn_dim, self.top_k, self.num_experts
        norm = 3 * D + 1  # RMSNorm keeps its input, 1/rms and the unweighted normalised x; the next linear its output
        attn = norm + self._attn_saved()  # q, k (after RoPE), v, SDPA output, logsumexp (MLA: its latents too)
        if self.is_moe(i):
            # router probs, top-k weights/ids and the expert-major order; per assignment: gathered x,
            # 4 SwiGLU F-vectors, expert output and weighted output in combine
            return attn + norm + E + 8 * K + K * (3 * D + 4 * F) + self.n_shared_experts * 4 * F
        return attn + norm + 4 * self.dense_hidden

    def layer_bwd_elems(self, i: int) -> float:
        """Extra elements per token alive while layer i runs backward (gradients of its intermediates)."""
        D, K = self.d_model, self.top_k
        return (3 * K * D + 2 * D) if self.is_moe(i) else (2 * self.dense_hidden + 2 * D)

    def half_bytes(self, i: int, part: str, prec: "Precision", ep: int = 1) -> tuple[float, float, float, float]:
        """Layer i's attention ("attn") or FFN ("ffn") half in bytes: (kept per token for backward, extra per token
        while it runs backward, weights its forward copies and keeps for backward, the part of those copies autocast
        also caches until the microbatch's forward ends). Plain precisions: the element counts above at prec.act
        bytes each, no copies. Under bf16 autocast (our trainer's train.dtype=bf16, listed with saved_tensors_hooks
        and checked by `nanotitan plan --dry-run`) the residual stream, the norms, the router and the log-softmax
        stay fp32; a linear keeps the bf16 copy of its input (one per linear: q, k and v each cast the normalised x)
        and of its weight, re-made at every forward (so per microbatch in flight). Autocast caches the copies of
        parameters (not of the experts' unbound slices) for the whole forward, checkpointed blocks included."""
        D, F, K, E, H = self.d_model, self.ffn_dim, self.top_k, self.num_experts, self.n_heads
        moe = self.is_moe(i)
        if not prec.autocast:
            attn = self.attn_part(i)
            if part == "attn":
                return attn["act"] * prec.act, attn["bwd"] * prec.act, 0.0, 0.0
            return (self.layer_act_elems(i) - attn["act"]) * prec.act, self.layer_bwd_elems(i) * prec.act, 0.0, 0.0
        half = prec.act
        if part == "attn":
            copies = half * attention_matmuls(self)[0]
            if self.kv_lora_rank:
                return self._mla_autocast_bytes(), 4 * 2 * D, copies, copies
            # norm input + 1/rms (fp32), the logsumexp (fp32); bf16: 3 input casts, SDPA's q, k, v and its output
            return 4 * (2 * D + 1 + H) + half * 7 * D, 4 * 2 * D, copies, copies
        if moe:
            n_sh = self.n_shared_experts
            # fp32: the norm (its output feeds the fp32 router), router probs, top-k sums and weights; int64: ids,
            # expert-major order, token index. Per assignment (bf16): the expert input (cast once before an EP
            # dispatch, once per matmul without EP), 4 SwiGLU F-vectors, expert output, weighted output, weight.
            x_in = 1 if ep > 1 else 2
            kept = (4 * (3 * D + 1 + E + 2 + K) + 8 * 3 * K + half * K * (x_in * D + 4 * F + 2 * D + 1)
                    + (half * (2 * D + 4 * n_sh * F) if n_sh else 0.0))
            shared = n_sh * 3 * D * F  # the router stays fp32: no copy
            return kept, half * 3 * K * D + 4 * 2 * D, half * (E // ep * 3 * D * F + shared), half * shared
        Fd = self.dense_hidden
        copies = half * 3 * D * Fd
        return 4 * (2 * D + 1) + half * (2 * D + 4 * Fd), half * 2 * Fd + 4 * 2 * D, copies, copies

    def _mla_autocast_bytes(self) -> float:
        """MLA's attention half under bf16 autocast, bytes per token kept for backward: the block's norm and the
        log-sum-exp in fp32 as above; one bf16 cast of the normalised x (the q and kv down-projections share it);
        each low-rank norm runs in fp32 on the bf16 latent (its fp32 input copy, 1/rms, its output) and the
        up-projection keeps a bf16 cast of that output; SDPA's bf16 q, k, padded v and output, and o_proj's copy."""
        D, H = self.d_model, self.n_heads
        Rq, R, Dn, Dr, Dv = (self.q_lora_rank, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim,
                             self.v_head_dim)
        low_rank = lambda r: (4 * 2 * r + 4 + 2 * r) if r else 0  # noqa: E731
        return 4 * (2 * D + 1 + H) + 2 * D + low_rank(Rq) + low_rank(R) + 2 * (4 * H * (Dn + Dr) + H * Dv)

    def received_bytes(self, i: int, prec: "Precision") -> float:
        """Bytes per token of MoE layer i's FFN half that sit on the rank owning the experts, and so grow with the
        assignments that rank receives (EP: the busiest rank's load, not the mean; cost.expert_imbalance): per
        assignment the experts' input (the matmuls save it; the dispatcher casts it before sending under
        autocast) and the four SwiGLU F-vectors. The rest of the half (norm, router, routing indices, and
        `combine`'s weighted outputs) stays on the source rank: T*K assignments whatever the routing."""
        return self.top_k * (self.d_model + 4 * self.ffn_dim) * prec.act if self.is_moe(i) else 0.0

    def expert_grad_landing(self, i: int, prec: "Precision", ep: int = 1, overlap: bool = False
                            ) -> tuple[float, float, float]:
        """MoE layer i's FFN half at the end of its backward, when its routed experts' weight gradients land:
        (bytes per token it still keeps from the forward, bytes per token of gradients, fixed bytes). ExpertFFN
        unbinds each stacked weight (model/moe.py), and autograd's unbind backward waits for every local expert's
        gradient piece, in the param dtype, then stacks them: at the first stack the pieces of all three weights
        and one stacked weight are alive, 4·L·D·F parameters' worth. Per token: the norm, router and routing
        indices, the experts' input gradient (K·D: fp32 without EP, where the experts read the fp32 norm output)
        and the residual stream's; the experts' activations and weight copies are freed by then, the shared
        experts' too (their backward runs first). parallel.ep_overlap's _ExpertTrip (parallel/ep.py) is one
        autograd node: what it saved (the weights' copies, the experts' activations) lives until it returns, beside
        the groups' gradients in the compute dtype and all three weights' whole gradients in the param dtype."""
        D, F, K, E = self.d_model, self.ffn_dim, self.top_k, self.num_experts
        w = E // ep * D * F  # elements of one local stacked weight
        c, p = prec.act, prec.param  # compute and param (so gradient-piece) dtypes
        if not prec.autocast:
            keep, grads = (3 * D + 1 + E + 8 * K) * c, (K * D + 2 * D) * c
        else:
            keep = 4 * (3 * D + 1 + E + 2 + K) + 8 * 3 * K
            grads = (c if ep > 1 else 4) * K * D + 4 * 2 * D
        if not overlap:
            return keep, grads, 4 * w * p
        copies = 3 * w * c if c != p else 0.0  # _cast is a no-op when the weights are in the compute dtype
        return keep + c * K * (D + 4 * F), grads, copies + 3 * w * (c + p) + (w * c if c != p else 0.0)

    def head_bytes(self, prec: "Precision") -> tuple[float, float]:
        """The head (final norm, LM head, log-softmax): (bytes kept per token, weight bytes its forward copies)."""
        D, V = self.d_model, self.vocab
        if not prec.autocast:
            return (3 * D + 1 + V) * prec.act, 0.0
        return 4 * (2 * D + 1 + V) + prec.act * D, prec.act * V * D  # fp32 norm and log-softmax; bf16 input cast

    def total_params(self) -> int:
        """Every parameter once, the MTP modules' included (not the last stage's replica of the embedding)."""
        n = self.vocab * self.d_model * 2 + self.d_model + self.pos_table * self.d_model
        for i in range(self.n_layers + self.mtp_layers):  # MTP depth k's block is layer n_layers + k - 1
            ne, ex = self.layer_params(i)
            n += ne + ex * self.num_experts
        return n + self.mtp_layers * mtp_params(self)

    def mtp_act(self, prec: "Precision") -> tuple[float, float]:
        """One MTP depth's own parts (its block apart), per token: (elements, bytes at `prec`) kept for backward.
        The embedding's and the hidden state's norms (input, 1/rms, normalised x each) and eh_proj's input, their
        concatenation (under autocast the fp32 norms and a bf16 cast of the concatenation)."""
        D = self.d_model
        elems = 2 * (2 * D + 1) + 2 * D
        return elems, (4 * 2 * (2 * D + 1) + prec.act * 2 * D) if prec.autocast else elems * prec.act


def mtp_seconds(shape: ModelShape, seconds) -> float:
    """What the MTP depths add to the last pipeline chunk, by `seconds(f_dense, f_expert)` of one half-block: each
    depth's block, its eh_proj and one more pass of the head (steptime.balanced_layer_counts)."""
    D, V = shape.d_model, shape.vocab
    return sum(seconds(*shape.layer_fwd_flops(shape.n_layers + k)) + seconds(4 * D * D + 2 * D * V, 0.0)
               for k in range(shape.mtp_layers))


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    ep: int
    schedule: str
    microbatches: int  # M
    micro_batch: int  # m
    zero: int = 0  # parallel.zero: 0 replicated DP, 1 optimizer state, 2 + gradients, 3 + parameters sharded
    tp: int = 1  # parallel.tp, the fastest axis: world = dp*pp*ep*cp*tp (plan/tp.py)
    cp: int = 1  # parallel.cp, next to tp: each sequence split over cp ranks (plan/cp.py)

    def short(self) -> str:
        return (f"dp{self.dp} pp{self.pp} ep{self.ep} {self.schedule if self.pp > 1 else '-'} "
                f"M{self.microbatches} m{self.micro_batch}" + (f" z{self.zero}" if self.zero else "")
                + (f" tp{self.tp}" if self.tp > 1 else "") + (f" cp{self.cp}" if self.cp > 1 else ""))

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.ep * self.cp * self.tp

    @property
    def moe_ep(self) -> int:
        """Ranks the experts of a stage are sharded over: EP folded with CP and TP."""
        return expert_ranks(self.ep, self.cp, self.tp)

    def as_tuple(self) -> tuple[int, int, int, str, int, int, int]:
        return self.dp, self.pp, self.ep, self.schedule, self.microbatches, self.micro_batch, self.zero


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each training state, and per activation element."""

    param: int
    grad: int
    master: int  # fp32 master copy when params are kept in bf16 (0 = params are the master)
    moments: int  # AdamW's two moments together
    act: int
    autocast: bool = False  # fp32 params computed under bf16 autocast: mixed-dtype activations (ModelShape.half_bytes)


PRECISIONS = {
    "fp32": Precision(4, 4, 0, 8, 4),  # our trainer, train.dtype=fp32
    "bf16-autocast": Precision(4, 4, 0, 8, 2, autocast=True),  # our trainer, train.dtype=bf16: fp32 states
    "bf16-master": Precision(2, 4, 4, 8, 2),  # Megatron-style: bf16 params, fp32 grads/master/moments
    # DeepSeek-V3 report sec. 3.3.3: bf16 moments, fp32 master weights and gradients.
    "bf16-master-bf16-moments": Precision(2, 4, 4, 4, 2),
}


def trainer_precision(dtype: str) -> str:
    """The PRECISIONS name of what our trainer runs at `train.dtype`."""
    return "bf16-autocast" if dtype == "bf16" else "fp32"


def layout_config(cfg: Config, layout: Layout) -> Config:
    """A copy of cfg running `layout` (pp_layers kept only when it still matches pp, or is "auto"; virtual stages
    only where the layout runs more than one chunk per rank: interleaved with pp > 1). Each section is copied (a
    search builds one per candidate layout: a deep copy was a third of a 2,048-rank plan's time); the lists inside
    them are shared, and nothing changes them in place."""
    c = copy.copy(cfg)
    for name in SECTIONS:
        setattr(c, name, copy.copy(getattr(cfg, name)))
    p = c.parallel
    p.dp, p.pp, p.ep, p.schedule, p.microbatches = layout.dp, layout.pp, layout.ep, layout.schedule, layout.microbatches
    p.zero, p.tp, p.cp = layout.zero, layout.tp, layout.cp
    c.train.micro_batch = layout.micro_batch
    p.virtual_stages = pp_facts.virtual_stages(layout.schedule, layout.pp, p.virtual_stages)
    if p.pp_layers != "auto" and len(p.pp_layers) != layout.pp * p.virtual_stages:
        p.pp_layers = []
    p.auto = False
    return c


@dataclass(frozen=True)
class StageSummary:
    """What one rank of pipeline stage s owns and does per token (elements / FLOPs)."""

    n_ne: int  # non-expert params (replicated over the non-expert-DP group)
    n_ex: int  # this rank's expert params (E/EP experts of each MoE layer)
    f_dense: float  # forward FLOPs per token outside routed experts
    f_expert: float  # forward FLOPs per token in routed experts
    act: float  # activation elements kept per token of one microbatch
    act_layer_max: float  # extra elements per token while the largest layer runs backward
    head_act: float  # part of `act` that belongs to the head (freed before the layers' backward)
    n_moe: int
    n_layers: float  # a half of a split block counts 0.5
    first: bool
    last: bool
    # the same in bytes at the precision stage_summaries was given (mixed dtypes under autocast), and the bf16
    # weight copies autocast keeps: per microbatch in flight (`cast`), or the largest block's while it recomputes
    # and runs backward under activation checkpointing (`cast_layer_max`)
    act_bytes: float = 0.0
    act_layer_max_bytes: float = 0.0
    head_act_bytes: float = 0.0
    cast_bytes: float = 0.0
    cast_layer_max_bytes: float = 0.0
    cast_cache_bytes: float = 0.0  # checkpointed blocks' cached weight copies, alive until a forward's end
    # the largest MoE block at its experts' weight-gradient landing (ModelShape.expert_grad_landing): bytes per
    # token (under checkpointing its recomputed attention half included) and fixed bytes (the gradient pieces)
    land_bytes: float = 0.0
    land_fixed_bytes: float = 0.0
    head_cast_bytes: float = 0.0  # part of `cast_bytes`: the head's weight copy (freed with its activations)
    # bytes per token held on the experts' side (ModelShape.received_bytes), at a balanced router: the part of
    # `act_bytes` that grows with the assignments a rank receives, and the largest MoE block's (its FFN half,
    # in the transients: the block's backward, its gradient landing, the all-to-all's receive buffer)
    received_bytes: float = 0.0
    received_block_bytes: float = 0.0
    n_attn: float = 0.0  # attention halves the rank holds (MTP blocks' included): CP's ring or all-to-all runs in each


def stage_summaries(shape: ModelShape, layout: Layout, pp_layers: list[float] | None = None,
                    activation_checkpointing: bool = False, virtual_stages: int = 1,
                    prec: Precision | None = None, ep_overlap: bool = False) -> list[StageSummary]:
    """Per-stage (per pipeline rank) parameter, FLOP and activation counts; layers split as `model.spec` does:
    pp_layers are the layers of each of the pp*virtual_stages chunks (even when not given), rank s holding
    chunks s, s+pp, ... (interleaved schedule). The *_bytes fields are at `prec` (default fp32); `ep_overlap`:
    the experts run in _ExpertTrip's groups (parallel.ep_overlap with more than one group). Only pp, ep and m of
    the layout matter: a search asks for the same summaries many times, so they are cached (read-only)."""
    grid = Layout(1, layout.pp, layout.ep, "1f1b", 1, layout.micro_batch)
    return list(_summaries(shape, grid, tuple(pp_layers) if pp_layers else None, bool(activation_checkpointing),
                           virtual_stages, prec or PRECISIONS["fp32"], ep_overlap))


@functools.lru_cache(maxsize=4096)
def _summaries(shape: ModelShape, layout: Layout, pp_layers: tuple[float, ...] | None, ac: bool, virtual_stages: int,
               prec: Precision, ep_overlap: bool) -> tuple[StageSummary, ...]:
    """stage_summaries, on hashable arguments."""
    activation_checkpointing = ac
    pp, D, V = layout.pp, shape.d_model, shape.vocab
    T = layout.micro_batch * shape.seq_len
    e_local = shape.num_experts // layout.ep
    n_chunks = pp * virtual_stages
    counts = list(pp_layers) if pp_layers and len(pp_layers) == n_chunks else even_counts(shape.n_layers, n_chunks)
    out = []
    for s in range(pp):
        # (block, owns attention, owns FFN) of every block the rank's chunks touch (a .5 bound splits one)
        blocks = [b for c in range(s, n_chunks, pp)
                  for b in block_halves(*layer_bounds(shape.n_layers, n_chunks, c, counts))]
        first, last = s == 0, s == pp - 1
        n_ne = (V * D + shape.pos_table * D if first else 0) + (V * D + D if last else 0)
        mtp = shape.mtp_layers if last else 0
        if mtp:  # the MTP depths on the last stage: their blocks, their own parts, a replica of the embedding
            blocks += [(shape.n_layers + k, True, True) for k in range(mtp)]
            n_ne += mtp * mtp_params(shape) + (0 if first else V * D)
        n_ex, f_dense, f_expert, act, act_layer_max, n_moe, n_layers = 0, 0.0, 0.0, 0.0, 0.0, 0, 0.0
        act_b, layer_max_b, cast_b, cast_max_b, cache_b = 0.0, 0.0, 0.0, 0.0, 0.0
        recv_b, recv_block_b = 0.0, 0.0
        n_attn = sum(has_attn for _, has_attn, _ in blocks)
        land = None  # (per token, fixed) of the heaviest MoE block at its weight-gradient landing
        for i, has_attn, has_ffn in blocks:
            halves = [shape.half_bytes(i, part, prec, layout.ep) for part, own in (("attn", has_attn),
                                                                                  ("ffn", has_ffn)) if own]
            kept_b, bwd_b, copies = sum(h[0] for h in halves), max(h[1] for h in halves), sum(h[2] for h in halves)
            cache_b += sum(h[3] for h in halves) if ac else 0.0  # without AC they are the copies kept anyway
            # checkpointing keeps each block's input (the fp32 residual stream under autocast) and re-makes the
            # rest, weight copies included, one block at a time in its backward
            act_b += (4 if prec.autocast else prec.act) * D if ac else kept_b
            if has_ffn:
                recv = shape.received_bytes(i, prec)
                recv_b += 0.0 if ac else recv  # checkpointing rebuilds them one block at a time
                recv_block_b = max(recv_block_b, recv)
            layer_max_b = max(layer_max_b, bwd_b + (kept_b if ac else 0.0))
            cast_b, cast_max_b = (cast_b, max(cast_max_b, copies)) if ac else (cast_b + copies, cast_max_b)
            if has_ffn and shape.is_moe(i):
                keep, grads, fixed = shape.expert_grad_landing(i, prec, layout.ep, ep_overlap)
                if ac:  # the recomputed block is still alive: its attention half whole, the FFN's routing part
                    attn = halves[0] if has_attn else (0.0, 0.0, 0.0, 0.0)
                    keep, fixed = keep + attn[0], fixed + attn[2]
                else:  # the block's kept bytes are in the microbatch's activations: less what its FFN freed
                    keep, fixed = keep - halves[-1][0], fixed - halves[-1][2]
                if land is None or T * (keep + grads) + fixed > T * land[0] + land[1]:
                    land = (keep + grads, fixed)
            ne, one_expert = shape.layer_params(i)
            fd, fe = shape.layer_fwd_flops(i)
            a, bwd = shape.layer_act_elems(i), shape.layer_bwd_elems(i)
            if not (has_attn and has_ffn):  # one half of a split block
                attn = shape.attn_part(i)
                if has_attn:
                    ne, one_expert, fd, fe, a, bwd = attn["params"], 0, attn["f_dense"], 0.0, attn["act"], attn["bwd"]
                else:
                    ne, fd, a = ne - attn["params"], fd - attn["f_dense"], a - attn["act"]
            n_ne, n_ex = n_ne + ne, n_ex + one_expert * e_local
            f_dense, f_expert = f_dense + fd, f_expert + fe
            act += D if activation_checkpointing else a  # checkpointing keeps only each block's input
            # backward of one layer: its gradients' working set, plus its recomputed activations under AC
            act_layer_max = max(act_layer_max, bwd + (a if activation_checkpointing else 0.0))
            n_moe += shape.is_moe(i) and has_ffn
            n_layers += (has_attn + has_ffn) / 2
        head_act = 3 * D + 1 + V if last else 0  # final norm (as in a layer), log-softmax output
        # each of the rank's chunks holds its output until the gradient comes back (fp32 residual stream under
        # autocast), and under autocast also the bf16 wire buffer its input arrived in (pp/schedules.py widens a copy)
        chunks = list(range(s, n_chunks, pp))
        act_b += (4 if prec.autocast else prec.act) * D * sum(c != n_chunks - 1 for c in chunks)
        act_b += (prec.act * D * sum(c != 0 for c in chunks)) if prec.autocast else 0.0
        head_b, head_cast = shape.head_bytes(prec) if last else (0.0, 0.0)
        if last:  # the head runs once over the main positions and every MTP depth's: 1 + mtp times the tokens
            heads, (mtp_e, mtp_b) = 1 + mtp, shape.mtp_act(prec)
            f_dense += heads * 2 * D * V + mtp * 4 * D * D  # + each depth's eh_proj
            head_act = heads * head_act
            act += head_act + mtp * mtp_e
            head_b = heads * head_b  # per token of the microbatch; one weight copy (one head call)
            act_b, cast_b = act_b + head_b + mtp * mtp_b, cast_b + head_cast  # the head is never checkpointed
        out.append(StageSummary(n_ne, n_ex, f_dense, f_expert, act, act_layer_max, head_act, n_moe, n_layers,
                                first, last, act_b, layer_max_b, head_b, cast_b, cast_max_b, cache_b,
                                *(land or (0.0, 0.0)), head_cast, recv_b, recv_block_b, n_attn))
    return tuple(out)
