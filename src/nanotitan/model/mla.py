"""Multi-head latent attention (DeepSeek-V2/V3; transformers' DeepseekV3Attention).

Shapes: B batch, S sequence, D d_model, H heads, R kv_lora_rank (the latent), Dn qk_nope_head_dim,
Dr qk_rope_head_dim, Dv v_head_dim.

Keys and values are up-projected from one latent per token (kv_a_proj_with_mqa -> RMSNorm -> kv_b_proj): that
latent, R wide, is what an inference KV cache holds. The RoPE part of the key (Dr) is one head shared by all H
heads, straight from x; each head's query and key are [nope part, rope part]. The query has an optional
low-rank path of its own (q_lora_rank > 0: q_a_proj -> RMSNorm -> q_b_proj; DeepSeek-V2-Lite has a plain
q_proj). Parameters are replicated (no ".experts." in a name): EP and PP treat them as attention weights.

Attention runs from the per-token latent (B, S, R + Dr): the normed c_kv and the roped shared key, which
`LatentExpand` up-projects to each head's (k, v). On one device that is the same arithmetic as expanding first;
under context parallel (parallel/cp.py) the ring carries that latent instead of whole per-head keys and values.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..config.config import ModelConfig
from . import qk_max
from .docs import doc_rope
from .kv_cache import KVCache, cached_attention
from .norm import RMSNorm
from .rope import apply_rope, softmax_scale
from .tokens import LOCAL, TokenShard, at_runs
from .wgrad import Linear


class LatentExpand(nn.Module):
    """latent (B, S, R + Dr) -> (k (B, H, S, Dn + Dr), v (B, H, S, Dv)) through MLA's kv_b_proj; the rope key is
    one head shared by every head. Built per call around the MLA's own kv_b_proj (not a child: names unchanged)."""

    def __init__(self, kv_b_proj: nn.Module, R: int, Dn: int, Dr: int, Dv: int):
        super().__init__()
        self.kv_b_proj, self.widths = kv_b_proj, (R, Dn, Dr, Dv)

    def forward(self, latent):
        R, Dn, Dr, Dv = self.widths
        B, S, _ = latent.shape
        c, k_rot = latent.split([R, Dr], dim=-1)
        kv = self.kv_b_proj(c).view(B, S, -1, Dn + Dv).transpose(1, 2)
        k_nope, v = kv.split([Dn, Dv], dim=-1)  # (B, H, S, Dn), (B, H, S, Dv)
        k = torch.cat([k_nope, k_rot.unsqueeze(1).expand(B, kv.shape[1], S, Dr)], dim=-1)
        return k, v


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig, tokens: TokenShard = LOCAL):
        super().__init__()
        self.tokens = tokens
        D, H, bias = cfg.d_model, cfg.n_heads, cfg.attn_bias  # HF's attention_bias: q_a, kv_a and o
        self.n_heads, self.kv_lora_rank = H, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk = self.nope + self.rope
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(D, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)  # HF's DeepseekV3RMSNorm default eps, not rms_norm_eps
            self.q_b_proj = Linear(cfg.q_lora_rank, H * qk, bias=False)
        else:
            self.q_proj = Linear(D, H * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(D, cfg.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(H * self.v_dim, D, bias=bias)
        self.scale = softmax_scale(cfg, qk)
        self.doc_positions = cfg.doc_positions == "doc"  # with a document layout: rope restarts per document

    def forward(self, x, rope, docs=None):
        """docs: the windows' document starts (B, S_whole) (model/docs.py), None: one causal sequence."""
        B, S, _ = x.shape
        q, latent = self.project(x, rope, self.tokens.seq_runs,  # global positions (context parallel: its chunks)
                                 docs if self.doc_positions else None)
        expand = LatentExpand(self.kv_b_proj, self.kv_lora_rank, self.nope, self.rope, self.v_dim)
        if getattr(self, "qk_track", False) and torch.is_grad_enabled():  # train.qk_clip only: the keys once more
            with torch.no_grad():
                k = expand(latent)[0]
            qk_max.observe(self, q, k, self.scale)  # (model/qk_max.py; refused under CP)
        y = self.tokens.attend_latent(q, latent, expand, self.scale, docs=docs)  # (B, H, S, Dv)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, q.shape[1] * self.v_dim))

    def decode(self, x, rope, cache: KVCache, key: str):
        """forward for generation: the cache holds each earlier token's latent (B, T, R + Dr), up-projected here."""
        B, S, _ = x.shape
        q, latent = self.project(x, rope, cache.positions)
        (latent,) = cache.extend(key, 1, latent)
        expand = LatentExpand(self.kv_b_proj, self.kv_lora_rank, self.nope, self.rope, self.v_dim)
        y = cached_attention(q, *expand(latent), self.scale)  # (B, H, S, Dv)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, q.shape[1] * self.v_dim))

    def project(self, x, rope, positions, starts=None):
        """q (B, H, S, Dn + Dr) and the per-token latent (B, S, R + Dr) of x's S tokens, roped at `positions(S)`,
        their global positions as (start, length) runs (with document starts (B, S_whole), at their places in their
        documents)."""
        B, S, _ = x.shape
        Dn, Dr = self.nope, self.rope
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        H = q.shape[-1] // (Dn + Dr)  # from the shape: under tensor parallel a rank holds H/N heads (parallel/tp.py)
        q_nope, q_rot = q.view(B, S, H, Dn + Dr).transpose(1, 2).split([Dn, Dr], dim=-1)  # (B, H, S, Dn), (.., Dr)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, Dr], dim=-1)  # (B, S, R), (B, S, Dr)
        runs = positions(S)
        cos, sin = doc_rope(rope, runs, starts) if starts is not None else \
            (at_runs(rope[0], runs), at_runs(rope[1], runs))
        q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot.unsqueeze(1), cos, sin)  # k_rot (B, 1, S, Dr)
        q = torch.cat([q_nope, q_rot], dim=-1)  # (B, H, S, Dn + Dr)
        return q, torch.cat([self.kv_a_layernorm(latent), k_rot.squeeze(1)], dim=-1)  # (B, S, R + Dr)
