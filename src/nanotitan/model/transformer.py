"""Decoder-only MoE transformer, built from a ModelShardSpec (full model or one stage/expert shard).

Shapes: B batch, S sequence, D d_model, H heads, Hkv key/value heads, Dh head dim, V vocab.
Architecture (pos_emb="rope"): Mixtral's — RMSNorm pre-norm, RoPE attention without biases,
SwiGLU experts, softmax top-k router, untied head. pos_emb="learned" is the seed's absolute table
(owned by stage 0 like the token embedding). Options for the other published MoE families (hf.py maps
them): grouped-query attention (n_kv_heads), head_dim, q/k RMSNorm per head (Qwen3-MoE) or over the
whole projection (OLMoE), q/k/v biases (Qwen2-MoE), shared experts with a sigmoid gate (Qwen2-MoE),
dense layers by index, DeepSeek-V3's multi-head latent attention (model/mla.py, kv_lora_rank > 0) and YaRN
(model/rope.py).

Parameters are initialised by global identity: each tensor (and each expert slice) gets its own RNG
seeded by (run seed, global parameter name, global expert id), so a shard equals the matching slice
of the full model whatever rank builds it (docs/design.md §4). `init=False` leaves them as built (on the meta device:
parallel/build.py slices them for TP first, then fills each with `init_param` and the buffers with `init_buffers`).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..config.config import ModelConfig
from . import qk_max, wgrad
from .docs import doc_positions, doc_rope, positions_of
from .experts import ExpertShard
from .kv_cache import KVCache, cached_attention
from .mla import MLA
from .moe import MoE, SwiGLU
from .mtp import MTP, future_ids, mark_tails, mtp_layer_ids, whole_targets
from .norm import RMSNorm, full_norm
from .rope import apply_rope, rope_cache
from .wgrad import Linear
from .spec import ModelShardSpec
from .tokens import LOCAL, TokenShard, at_runs, loss_targets, target_tokens


def head_dim(cfg: ModelConfig) -> int:
    return cfg.head_dim or cfg.d_model // cfg.n_heads


def kv_heads(cfg: ModelConfig) -> int:
    return cfg.n_kv_heads or cfg.n_heads


def rope_dim(cfg: ModelConfig) -> int:
    """Rotary width of a head: MLA's shared rope part, else the whole head."""
    return cfg.qk_rope_head_dim if cfg.kv_lora_rank else head_dim(cfg)


class Attention(nn.Module):
    """Causal self-attention (MHA/GQA, q/k norms, biases). Its sequence is whole, or (context parallel) its token
    shard's positions (`seq_runs`: RoPE reads the table at them), and `tokens.attend` meets the other ranks' keys."""

    def __init__(self, cfg: ModelConfig, tokens: TokenShard = LOCAL):
        super().__init__()
        self.tokens = tokens
        D, H, Hkv, Dh = cfg.d_model, cfg.n_heads, kv_heads(cfg), head_dim(cfg)
        self.n_heads, self.n_kv_heads, self.head_dim, self.qk_norm = H, Hkv, Dh, cfg.qk_norm
        self.doc_positions = cfg.doc_positions == "doc"  # with a document layout: rope restarts per document
        self.q_proj = Linear(D, H * Dh, bias=cfg.attn_bias)
        self.k_proj = Linear(D, Hkv * Dh, bias=cfg.attn_bias)
        self.v_proj = Linear(D, Hkv * Dh, bias=cfg.attn_bias)
        self.o_proj = Linear(H * Dh, D, bias=False)
        if cfg.qk_norm == "head":  # Qwen3-MoE: one Dh-wide norm shared by every head
            self.q_norm, self.k_norm = RMSNorm(Dh, cfg.norm_eps), RMSNorm(Dh, cfg.norm_eps)
        elif cfg.qk_norm == "full":  # OLMoE: over the whole q (H*Dh) and k (Hkv*Dh) projections
            self.q_norm, self.k_norm = full_norm(H * Dh, cfg.norm_eps, tokens, H), \
                full_norm(Hkv * Dh, cfg.norm_eps, tokens, Hkv)

    def forward(self, x, rope, docs=None):
        """docs: the windows' document starts (B, S_whole) (model/docs.py), None: one causal sequence."""
        B, S, _ = x.shape
        q, k, v = self.project(x, rope, self.tokens.seq_runs,  # each token's global position (model/tokens.py)
                               docs if self.doc_positions else None)
        qk_max.observe(self, q, k, self.head_dim ** -0.5)  # train.qk_clip only (model/qk_max.py; refused under CP)
        y = self.tokens.attend(q, k, v, docs=docs)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, q.shape[1] * self.head_dim))

    def decode(self, x, rope, cache: KVCache, key: str):
        """forward for generation: x's S new tokens attend over the cache's earlier ones and themselves."""
        B, S, _ = x.shape
        q, k, v = self.project(x, rope, cache.positions)
        y = cached_attention(q, *cache.extend(key, 2, k, v))  # (B, H, S, Dh)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, q.shape[1] * self.head_dim))

    def project(self, x, rope, positions, starts=None):
        """q (B, H, S, Dh), k, v (B, Hkv, S, Dh) of x's S tokens: projected, normed, and roped at `positions(S)`,
        their global positions as (start, length) runs (with document starts (B, S_whole), at their places in
        their documents)."""
        B, S, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (B, S, H*Dh), (B, S, Hkv*Dh) x2
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        Dh = self.head_dim  # H, Hkv from the shapes: under tensor parallel a rank holds H/N of the heads (tp.py)
        H, Hkv = q.shape[-1] // Dh, k.shape[-1] // Dh
        q, k, v = q.view(B, S, H, Dh), k.view(B, S, Hkv, Dh), v.view(B, S, Hkv, Dh)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H or Hkv, S, Dh)
        if rope is not None:
            runs = positions(S)
            cos, sin = doc_rope(rope, runs, starts) if starts is not None else \
                (at_runs(rope[0], runs), at_runs(rope[1], runs))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v


class Block(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + ffn(norm(x)) (MoE or dense). A pipeline cut may fall between
    the halves (model/spec.py): the block then holds, and runs, only the half its shard owns."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, spec: ModelShardSpec, tokens: TokenShard = LOCAL,
                 expert_shard: ExpertShard | None = None):
        super().__init__()
        self.has_attn, self.has_ffn = spec.block_parts(layer_idx)
        self.tokens = tokens
        if self.has_attn:
            self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.attn = MLA(cfg, tokens) if cfg.kv_lora_rank else Attention(cfg, tokens)
        self.is_moe = self.has_ffn and is_moe_layer(cfg, layer_idx)
        if self.has_ffn:
            self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if self.is_moe:
            self.moe = MoE(cfg.d_model, cfg.ffn_dim, cfg.num_experts, cfg.top_k, cfg.norm_topk,
                           spec.expert_start, spec.expert_end, shared_ffn_dim=shared_hidden(cfg),
                           shared_gate=cfg.shared_expert_gate, score=cfg.router_score,
                           routed_scale=cfg.routed_scale, bias_update_rate=cfg.bias_update_rate,
                           aux_coef=cfg.aux_coef, aux_scope=cfg.aux_scope, z_loss_coef=cfg.z_loss_coef,
                           capacity_factor=cfg.capacity_factor, n_group=cfg.n_group, topk_group=cfg.topk_group,
                           experts_impl=cfg.experts_impl, tokens=tokens, expert_shard=expert_shard)
        elif self.has_ffn:
            self.mlp = SwiGLU(cfg.d_model, cfg.dense_ffn_dim or cfg.ffn_dim)

    def forward(self, x, rope, docs=None):
        self.tokens.place(docs)  # here, so that activation checkpointing's recompute places its own microbatch
        if self.has_attn:
            x = x + self.attn(self.attn_norm(x), rope, docs)
        return self.feed_forward(x)

    def decode(self, x, rope, cache: KVCache, key: str):
        """forward for generation (a whole block: generate runs the full model), attention over the cache."""
        return self.feed_forward(x + self.attn.decode(self.attn_norm(x), rope, cache, key))[0]

    def feed_forward(self, x):
        """x + the FFN half of the block (MoE or dense; x itself on a shard without it), and the MoE's weighted
        router losses."""
        if self.is_moe:
            y, aux = self.moe(self.ffn_norm(x))
            return x + y, aux
        aux = x.new_zeros((), dtype=torch.float32)
        return (x + self.mlp(self.ffn_norm(x)) if self.has_ffn else x), aux


class Transformer(nn.Module):
    """One shard of the model: forward(inp, targets) with inp tokens (B, S) on the first stage,
    hidden states (B, S, D) elsewhere. Returns (out, aux_sum): out is the hidden state, or the
    mean cross-entropy when targets are given on the last stage, or logits without targets;
    aux_sum is the sum of this shard's MoE router losses, each already weighted by its coefficients
    (aux_coef * balance + z_loss_coef * z per layer: the trainer only averages over layers and microbatches).
    With model.mtp_layers the shard with the head also runs the MTP modules in training forwards with targets
    (model/mtp.py) and returns a third loss term, (ce, aux_sum, mtp): mtp_coef * the MTP loss, which the caller adds
    to its objective as it adds the weighted aux_sum (parallel/pp/schedules.py)."""

    def __init__(self, cfg: ModelConfig, spec: ModelShardSpec | None = None, seed: int = 0, init: bool = True,
                 tokens: TokenShard = LOCAL, experts: Callable[[int], ExpertShard] | None = None):
        super().__init__()
        assert cfg.vocab_size > 0, "model.vocab_size=0 stands for data.vocab_size: resolve the config (resolve.py)"
        spec = spec or ModelShardSpec.full(cfg)
        self.cfg, self.spec = cfg, spec
        self.activation_checkpointing = False
        # The ranks that share this shard's tokens (model/tokens.py; LOCAL on one device): under tensor parallel the
        # embedding and the head are vocab-parallel, and so is the loss (`tokens.cross_entropy`).
        self.tokens = tokens
        self.wgrad_store: wgrad.WeightGradStore | None = None  # set by wgrad.attach: deferrable weight gradients
        # Training forwards only, per MoE layer, in forward order: (tokens per expert, MoE.last_router_stats) of each
        # forward; the step drains it (`take_routing`) and hands the counts on in its result (parallel/step.py)
        self.routing: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        if spec.has_token_embed or spec.embed_replica:  # the MTP reads it on the last stage (parallel/tied.py)
            self.tok_emb = tokens.embedding(cfg.vocab_size, cfg.d_model)
        if spec.has_pos_embed:
            self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        # Keys are global layer indices, so parameter names are the same in every layout.
        # The MTP blocks follow, numbered after the last decoder layer as in DeepSeek's checkpoints (model/mtp.py).
        # Each MoE layer's expert shard (model/experts.py): handed in per global layer index, else this spec's experts
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, spec, tokens, experts(i) if experts is not None else None)
                                     for i in [*spec.layers, *mtp_layer_ids(cfg, spec.mtp_layers)]})
        self.n_trunk = len(spec.layers)
        if spec.has_head:
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if spec.mtp_layers:
            self.mtp = MTP(cfg, spec.mtp_layers)
            mark_tails(self.layers, cfg, spec.mtp_layers)
        self.rope = None
        self.init_buffers()
        if init:
            self.init_weights(seed)

    # --- init by global identity -------------------------------------------------------------
    def init_buffers(self) -> None:
        """The buffers, computed (never random): the rope tables, the router biases at zero. Called again after
        a build on the meta device (parallel/build.py), outside it."""
        if self.cfg.pos_emb == "rope":
            cos, sin = rope_cache(self.cfg, rope_dim(self.cfg))
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        for moe in self.moe_layers():
            if moe.router_bias is not None:
                moe.router_bias = torch.zeros(moe.router_bias.shape)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        for name, p in self.named_parameters():
            self.init_param(name, p, seed)

    @torch.no_grad()
    def init_param(self, name: str, p: torch.Tensor, seed: int, part: tuple[int, int, int] | None = None) -> None:
        """Fill p with parameter `name`'s init. part = (dim, rank, n): p is rank's 1/n slice along dim (a TP
        shard): the whole tensor is generated, one parameter at a time, and p keeps its slice."""
        cfg = self.cfg
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            return
        if name.endswith(".bias"):
            p.zero_()
            return
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)  # residual projections (GPT-2)
        std = out_std if name.endswith(("o_proj.weight", "down_proj.weight", "W_out")) else cfg.init_std
        if ".experts." in name:  # never TP-sliced (experts fold onto EP: parallel/tp.py)
            assert part is None, name
            shard = self.layers[name.split(".")[1]].moe.expert_shard
            for l, e in enumerate(shard.experts_at(shard.rank)):  # one RNG per global expert id: shard == slice of full
                if e >= 0:
                    p[l].copy_(_normal(p[l].shape, std, seed, name, e))
                else:  # an empty slot (a placement's spare): zeros
                    p[l].zero_()
            return
        dim, rank, n = part or (0, 0, 1)
        shape = list(p.shape)
        shape[dim] *= n
        p.copy_(_normal(shape, std, seed, name, -1).chunk(n, dim=dim)[rank])

    # --- forward -----------------------------------------------------------------------------
    def _embed(self, table: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
        if self.wgrad_store is None or hasattr(table, "wgrad_store"):  # a table that taps itself (model/tokens.py)
            return table(idx)
        return F.embedding(idx, wgrad.tap(table.weight, self.wgrad_store))  # nn.Embedding's defaults

    def _run_block(self, key: str, x: torch.Tensor, rope, docs=None) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.layers[key]
        if self.activation_checkpointing and self.training:
            x, aux = checkpoint(block, x, rope, docs, use_reentrant=False)
        else:
            x, aux = block(x, rope, docs)
        if block.is_moe and self.training:  # read here, not in the MoE: a checkpoint recompute must not count twice
            self.routing.setdefault(key, []).append((block.moe.last_counts_E, block.moe.last_router_stats))
        return x, aux

    def forward(self, inp: torch.Tensor, targets: torch.Tensor | None = None, docs: torch.Tensor | None = None):
        """docs: the windows' document starts (B, S_whole) (model/docs.py; model.attn_mask=doc), None: causal."""
        spec = self.spec
        # MTP (training forwards with targets, model/mtp.py) also reads the embeddings of its future tokens, stacked
        # along the batch. Each of the embedding and the head runs once per microbatch, over every position that
        # needs it: a deferred weight gradient (zb1, the lanes' fill: model/wgrad.py) then lands one term per
        # parameter, as the sync expects.
        mtp = spec.mtp_layers > 0 and self.training and targets is not None
        B, S = inp.shape[0], inp.shape[1]
        self.tokens.place(docs)  # which positions this rank holds may depend on the documents (context parallel)
        future = None
        # MTP's targets are the whole sequence's, read at this rank's positions (context parallel: its chunks); its
        # depths' input tokens are the targets' tokens, a masked target's (SFT's prompts) included
        whole, runs = whole_targets(targets, self.tokens) if mtp else (None, None)
        ahead = future_ids(target_tokens(whole), runs, spec.mtp_layers) if mtp else None
        if spec.has_token_embed:
            x = self._embed(self.tok_emb, torch.cat([inp, ahead]) if mtp else inp)
            x, future = (x[:B], x[B:]) if mtp else (x, None)
            if spec.has_pos_embed:
                x = x + self._embed(self.pos_emb, self._learned_positions(S, docs, inp.device))
        else:
            x = inp
            if mtp:  # the last stage's replica of the embedding (parallel/tied.py)
                future = self._embed(self.tok_emb, ahead)
        rope = (self.rope_cos, self.rope_sin) if self.cfg.pos_emb == "rope" else None
        aux_sum = x.new_zeros((), dtype=torch.float32)
        for key in list(self.layers)[:self.n_trunk]:
            x, aux = self._run_block(key, x, rope, docs)
            aux_sum = aux_sum + aux
        if not spec.has_head:
            return x, aux_sum
        if not mtp:
            logits = self.head(self.norm(x))
            if targets is None:
                return logits, aux_sum
            # the token shard's: plain on one device, TP's logits stay vocab shards, CP's loss is its part
            return self.tokens.cross_entropy(logits, loss_targets(targets)), aux_sum
        hs, aux = self.mtp(x, future, lambda key, h: self._run_block(key, h, rope, docs))
        logits = self.head(torch.cat([self.norm(x), *hs]))  # (B + D*B, S, V), V/N under TP
        ce_of = self.tokens.cross_entropy
        ce = ce_of(logits[:B], loss_targets(targets))
        # A term of its own: ce stays the main head's CE (logged as ce_loss, comparable with runs without MTP).
        return ce, aux_sum + aux, self.cfg.mtp_coef * self.mtp.loss(logits[B:], loss_targets(whole), runs, ce_of)

    def _learned_positions(self, S: int, docs: torch.Tensor | None, device) -> torch.Tensor:
        """The learned table's rows for S positions: the window's, or each token's place in its document."""
        if docs is None or self.cfg.doc_positions == "global":
            return torch.arange(S, device=device)
        return doc_positions(docs, positions_of(self.tokens.seq_runs(S), device))

    def moe_layers(self) -> list[MoE]:
        return [b.moe for b in self.layers.values() if b.is_moe]

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits (B, S, V) of ids (B, S), the tokens that follow the cache's: the full model run over the new tokens
        only, each attending over the cache and the new ones before it (inference: no router records, no losses)."""
        S = ids.shape[1]
        x = self.tok_emb(ids)
        if self.spec.has_pos_embed:
            x = x + self.pos_emb(torch.arange(cache.length, cache.length + S, device=ids.device))
        rope = (self.rope_cos, self.rope_sin) if self.cfg.pos_emb == "rope" else None
        for key in list(self.layers)[:self.n_trunk]:
            x = self.layers[key].decode(x, rope, cache, key)
        cache.advance(S)
        return self.head(self.norm(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, pick) -> torch.Tensor:
        """idx (B, T) and max_new_tokens tokens after it, each pick(logits (B, V), fp32) -> (B, 1) of the last
        position's logits (full model only), with a KV cache: each new token runs through the model once. A context
        longer than model.max_seq_len slides: the cache restarts from the newest max_seq_len // 2 tokens."""
        assert self.spec == ModelShardSpec.full(self.cfg), "generate needs the full model"
        L = self.cfg.max_seq_len
        cache = KVCache(L)
        logits = self.decode(idx[:, -L:], cache)[:, -1]
        for i in range(max_new_tokens):
            nxt = pick(logits.float())
            idx = torch.cat([idx, nxt], dim=1)
            if i + 1 == max_new_tokens:
                break
            if cache.length == L:  # full: read the newest half again, at positions from 0
                cache.clear()
                logits = self.decode(idx[:, -max(1, L // 2):], cache)[:, -1]
            else:
                logits = self.decode(nxt, cache)[:, -1]
        return idx


@dataclass
class Routing:
    """A step's routing record of this rank's MoE layers: one row per layer, one column per training forward, in
    forward order (what `take_routing` drains; parallel/step.py hands it on in the step's result)."""
    keys: list[str]  # the MoE layers' global indices: the rows below
    counts: torch.Tensor  # (layers, forwards, E) int64: tokens per expert the router asked for (drops included)
    stats: torch.Tensor  # (layers, forwards, 5): each forward's MoE.last_router_stats
    received: torch.Tensor | None = None  # (layers, forwards, E): under EP, the assignments per expert the whole EP
    #                                       group's dispatch moved (parallel/ep.py `take_received`)


def take_routing(model: nn.Module) -> Routing:
    """The training forwards' records since the last call (`Transformer.routing`, shared by a StageChunks' chunks),
    cleared."""
    records = dict(model.routing)
    model.routing.clear()
    keys = [k for k in model.layers if k in records]
    if not keys:
        E = model.cfg.num_experts
        return Routing([], torch.zeros(0, 0, E, dtype=torch.long), torch.zeros(0, 0, 5))
    return Routing(keys, torch.stack([torch.stack([c for c, _ in records[k]]) for k in keys]),
                   torch.stack([torch.stack([s for _, s in records[k]]) for k in keys]))


def is_expert_param(name: str) -> bool:
    return ".experts." in name


def is_moe_layer(cfg: ModelConfig, layer_idx: int) -> bool:
    """The one rule for which layers hold an MoE FFN (the rest are dense SwiGLU): every moe_every-th layer,
    except the first first_k_dense (DeepSeek) and those listed in dense_layers (Qwen's mlp_only_layers)."""
    return (layer_idx % cfg.moe_every == 0 and layer_idx >= cfg.first_k_dense
            and layer_idx not in cfg.dense_layers)


def shared_hidden(cfg: ModelConfig) -> int:
    """Hidden size of the one SwiGLU that holds all shared experts of an MoE layer (0: none)."""
    return cfg.shared_experts * (cfg.shared_ffn_dim or cfg.ffn_dim)


def num_moe_layers(cfg: ModelConfig) -> int:
    return sum(1 for i in range(cfg.n_layers) if is_moe_layer(cfg, i))


def _normal(shape, std: float, seed: int, name: str, expert_id: int) -> torch.Tensor:
    key = zlib.crc32(f"{seed}/{name}/{expert_id}".encode())
    g = torch.Generator().manual_seed(key)
    return torch.randn(shape, generator=g).mul_(std)  # in place: one tensor of the shape (a TP build's transient)


def attn_flop_widths(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul parameters of one attention layer, per-head q.k + v width its scores and mix multiply over).
    MLA: the q path (low-rank or not), the latent's down- and up-projections, o; GQA: q, o and the narrower k, v."""
    D, H = cfg.d_model, cfg.n_heads
    if not cfg.kv_lora_rank:
        Dh = head_dim(cfg)
        return 2 * D * H * Dh + 2 * D * kv_heads(cfg) * Dh, 2 * Dh
    qk, R = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    q = (D * cfg.q_lora_rank + cfg.q_lora_rank * H * qk) if cfg.q_lora_rank else D * H * qk
    kv = D * (R + cfg.qk_rope_head_dim) + R * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv + H * cfg.v_head_dim * D, qk + cfg.v_head_dim


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (nanoGPT/PaLM): 6 * active matmul params + 6 * L * S * H * (qk + v width) for
    attention scores and mix (12 * L * S * H * Dh without MLA), counting top_k experts, the router, shared experts
    and their gate per MoE layer, GQA's narrower k/v projections and MLA's low-rank paths (MID, docs/design.md:
    ~33 MFLOP). Biases and norms are not matmuls."""
    D, L, H = cfg.d_model, cfg.n_layers, cfg.n_heads
    n_moe = num_moe_layers(cfg)
    attn, width = attn_flop_widths(cfg)
    shared = 3 * D * shared_hidden(cfg) + (D if cfg.shared_experts and cfg.shared_expert_gate else 0)
    moe_active = cfg.top_k * 3 * D * cfg.ffn_dim + D * cfg.num_experts + shared
    dense = 3 * D * (cfg.dense_ffn_dim or cfg.ffn_dim)
    n_active = L * attn + n_moe * moe_active + (L - n_moe) * dense + D * cfg.vocab_size
    return 6 * n_active + 6 * L * seq_len * H * width
