"""Decoder-only MoE transformer, built from a ModelShardSpec (full model or one stage/expert shard).

Shapes: B batch, S sequence, D d_model, H heads, Dh head dim, V vocab.
Architecture (pos_emb="rope"): Mixtral's — RMSNorm pre-norm, RoPE attention without biases,
SwiGLU experts, softmax top-k router, untied head. pos_emb="learned" is the seed's absolute table
(owned by stage 0 like the token embedding).

Parameters are initialised by global identity: each tensor (and each expert slice) gets its own RNG
seeded by (run seed, global parameter name, global expert id), so a shard equals the matching slice
of the full model whatever rank builds it (DESIGN §4).
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from .moe import MoE
from .spec import ModelShardSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_cache(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)  # (S, Dh/2)
    ang = torch.cat([ang, ang], dim=-1)  # (S, Dh), HF's rotate_half layout
    return ang.cos().float(), ang.sin().float()


def apply_rope(x, cos, sin):
    """x (B, H, S, Dh); rotate_half convention (matches HF Mixtral/Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D = cfg.d_model
        self.n_heads = cfg.n_heads
        self.q_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)

    def forward(self, x, rope):
        B, S, D = x.shape
        H = self.n_heads
        q = self.q_proj(x).view(B, S, H, D // H).transpose(1, 2)  # (B, H, S, Dh)
        k = self.k_proj(x).view(B, S, H, D // H).transpose(1, 2)
        v = self.v_proj(x).view(B, S, H, D // H).transpose(1, 2)
        if rope is not None:
            cos, sin = rope[0][:S], rope[1][:S]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, D))


class DenseFFN(nn.Module):
    """SwiGLU MLP for non-MoE layers (moe_every > 1)."""

    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.up_proj = nn.Linear(d_model, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, spec: ModelShardSpec):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.is_moe = layer_idx % cfg.moe_every == 0
        if self.is_moe:
            self.moe = MoE(cfg.d_model, cfg.ffn_dim, cfg.num_experts, cfg.top_k, cfg.norm_topk,
                           spec.expert_start, spec.expert_end)
        else:
            self.mlp = DenseFFN(cfg.d_model, cfg.ffn_dim)

    def forward(self, x, rope):
        x = x + self.attn(self.attn_norm(x), rope)
        if self.is_moe:
            y, aux = self.moe(self.ffn_norm(x))
        else:
            y, aux = self.mlp(self.ffn_norm(x)), x.new_zeros((), dtype=torch.float32)
        return x + y, aux


class Transformer(nn.Module):
    """One shard of the model: forward(inp, targets) with inp tokens (B, S) on the first stage,
    hidden states (B, S, D) elsewhere. Returns (out, aux_sum): out is the hidden state, or the
    mean cross-entropy when targets are given on the last stage, or logits without targets;
    aux_sum is the sum of this shard's MoE balance losses."""

    def __init__(self, cfg: ModelConfig, spec: ModelShardSpec | None = None, seed: int = 0):
        super().__init__()
        spec = spec or ModelShardSpec.full(cfg)
        self.cfg, self.spec = cfg, spec
        self.activation_checkpointing = False
        self.expert_load: dict[str, torch.Tensor] = {}  # tokens per expert per MoE layer since last reset
        if spec.has_token_embed:
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if spec.has_pos_embed:
            self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        # Keys are global layer indices, so parameter names are the same in every layout.
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, spec) for i in spec.layers})
        if spec.has_head:
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.rope = None
        if cfg.pos_emb == "rope":
            cos, sin = rope_cache(max(cfg.max_seq_len, 1), cfg.d_model // cfg.n_heads, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights(seed)

    # --- init by global identity -------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        cfg = self.cfg
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)  # residual projections (GPT-2)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = out_std if name.endswith(("o_proj.weight", "down_proj.weight", "W_out")) else cfg.init_std
            if ".experts." in name:
                start = self.spec.expert_start
                for l in range(p.shape[0]):  # one RNG per global expert id: shard == slice of full
                    p[l].copy_(_normal(p[l].shape, std, seed, name, start + l))
            else:
                p.copy_(_normal(p.shape, std, seed, name, -1))

    # --- forward -----------------------------------------------------------------------------
    def forward(self, inp: torch.Tensor, targets: torch.Tensor | None = None):
        spec = self.spec
        if spec.has_token_embed:
            x = self.tok_emb(inp)
            if spec.has_pos_embed:
                x = x + self.pos_emb(torch.arange(inp.shape[1], device=inp.device))
        else:
            x = inp
        rope = (self.rope_cos, self.rope_sin) if self.cfg.pos_emb == "rope" else None
        aux_sum = x.new_zeros((), dtype=torch.float32)
        for key, block in self.layers.items():
            if self.activation_checkpointing and self.training:
                x, aux = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x, aux = block(x, rope)
            aux_sum = aux_sum + aux
            if block.is_moe:  # read here, not in the MoE: a checkpoint recompute must not count twice
                load = self.expert_load.get(key)
                counts = block.moe.last_counts_E
                self.expert_load[key] = counts if load is None else load + counts
        if not spec.has_head:
            return x, aux_sum
        logits = self.head(self.norm(x))
        if targets is None:
            return logits, aux_sum
        ce = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return ce, aux_sum

    def moe_layers(self) -> list[MoE]:
        return [b.moe for b in self.layers.values() if b.is_moe]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8, top_k: int = 50,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample continuations (full model only)."""
        assert self.spec == ModelShardSpec.full(self.cfg), "generate needs the full model"
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.cfg.max_seq_len:]
            logits, _ = self(ctx)
            logits = logits[:, -1, :].float() / max(temperature, 1e-5)
            if top_k:
                v, _ = logits.topk(min(top_k, logits.shape[-1]))
                logits[logits < v[:, [-1]]] = -float("inf")
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def is_expert_param(name: str) -> bool:
    return ".experts." in name


def num_moe_layers(cfg: ModelConfig) -> int:
    return sum(1 for i in range(cfg.n_layers) if i % cfg.moe_every == 0)


def _normal(shape, std: float, seed: int, name: str, expert_id: int) -> torch.Tensor:
    key = zlib.crc32(f"{seed}/{name}/{expert_id}".encode())
    g = torch.Generator().manual_seed(key)
    return torch.randn(shape, generator=g) * std


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (nanoGPT/PaLM): 6 * active matmul params + 12 * L * D * S for attention
    scores, counting top_k experts and the router per MoE layer (MID model of BASELINES: ~33 MFLOP)."""
    D, Fh, L = cfg.d_model, cfg.ffn_dim, cfg.n_layers
    n_moe = num_moe_layers(cfg)
    attn = 4 * D * D
    moe_active = cfg.top_k * 3 * D * Fh + D * cfg.num_experts
    dense = 3 * D * Fh
    n_active = L * attn + n_moe * moe_active + (L - n_moe) * dense + D * cfg.vocab_size
    return 6 * n_active + 12 * L * seq_len * D
