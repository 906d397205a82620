"""Rotary position embeddings: the cos/sin tables (plain RoPE, or YaRN-scaled) and their application.

Layout: HF's rotate_half (the two halves of a head are the pairs). DeepSeek checkpoints store the rotary dims
interleaved (x0, x1), (x2, x3), ...; interop/hf.py permutes those weight rows on import (and back on export),
so one convention serves every family and the logits are transformers' bit for bit.

YaRN (Peng et al. 2023; transformers' `_compute_yarn_parameters`): frequencies above the beta_fast boundary are
kept, those below beta_slow divided by `factor`, a linear ramp between; cos/sin carry the attention factor
mscale(factor, mscale) / mscale(factor, mscale_all_dim). DeepSeek's MLA also scales its softmax by
mscale(factor, mscale_all_dim)^2 (`softmax_scale`).
"""

from __future__ import annotations

import math

import torch

from ..config.config import ModelConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def inv_freq(cfg: ModelConfig, dim: int) -> tuple[torch.Tensor, float]:
    """(per-pair inverse frequencies (dim/2,) in fp64, factor on cos/sin) for `dim` rotary dims."""
    base = 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if cfg.rope_scaling == "none":
        return base, 1.0
    f, orig = cfg.rope_factor, cfg.rope_original_max_len or cfg.max_seq_len

    def dim_of(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times in orig
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low = max(math.floor(dim_of(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(dim_of(cfg.rope_beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / ((high - low) or 1e-3)).clamp(0, 1)  # HF's ramp
    keep = 1 - ramp  # 1: extrapolate (high frequency, kept), 0: interpolate (divided by factor)
    freq = base / f * (1 - keep) + base * keep
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        attn = yarn_mscale(f, cfg.rope_mscale) / yarn_mscale(f, cfg.rope_mscale_all_dim)
    else:
        attn = yarn_mscale(f)
    return freq, attn


def rope_cache(cfg: ModelConfig, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (max_seq_len, dim) in fp32, rotate_half layout, YaRN's attention factor folded in."""
    freq, attn = inv_freq(cfg, dim)
    ang = torch.outer(torch.arange(max(cfg.max_seq_len, 1), dtype=torch.float64), freq)  # (S, dim/2)
    ang = torch.cat([ang, ang], dim=-1)  # (S, dim)
    return (ang.cos() * attn).float(), (ang.sin() * attn).float()


def apply_rope(x, cos, sin):
    """x (B, H, S, Dh); rotate_half convention (matches HF Mixtral/Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def softmax_scale(cfg: ModelConfig, qk_dim: int) -> float:
    """Attention's softmax scale: qk_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 (DeepSeek's MLA)."""
    scale = qk_dim ** -0.5
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
    return scale
