"""Parameter and FLOP counts of the model's parts by formula, from the config alone: the one count that
config/fits.py (whether a job can fit at all) and the planner (plan/shape.py) both use, checked against real
`Transformer` shards in tests/plan/test_plan.py. Pure arithmetic (no torch): `m` is a ModelConfig, or anything with its
field names (the planner's ModelShape).

Shapes: D d_model, H heads, Dh head width, Hkv key/value heads; MLA (kv_lora_rank > 0, model/mla.py): Rq the
query's low rank (0: a plain q projection), R the latent, Dn/Dr/Dv the per-head key (no rope / rope) and value
widths.
"""

from __future__ import annotations


def mla(m) -> bool:
    return getattr(m, "kv_lora_rank", 0) > 0


def _dims(m) -> tuple[int, int, int, int]:
    """(D, H, Dh, Hkv), clamped: config/fits.py reads configs before their ranges are checked."""
    D, H = max(m.d_model, 0), max(m.n_heads, 1)
    return D, H, m.head_dim or max(D // H, 1), m.n_kv_heads or H


def rope_width(m) -> int:
    """Rotary width of a head (the RoPE tables' columns): MLA's shared rope part, else the whole head."""
    return m.qk_rope_head_dim if mla(m) else _dims(m)[2]


def attention_matmuls(m) -> tuple[int, int]:
    """(matmul parameters of one attention layer, per-head width of its scores q.k plus its mix of v): 2 x the
    first is its projections' forward FLOPs per token, 2 x S x H x the second its attention's (not causally
    halved). GQA: q, o and the narrower k, v; MLA: the q path, the latent's down- (with the shared rope key) and
    up-projections, o."""
    D, H, Dh, Hkv = _dims(m)
    if not mla(m):
        return 2 * D * H * Dh + 2 * D * Hkv * Dh, 2 * Dh
    Rq, R, Dn, Dr, Dv = m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    q = D * Rq + Rq * H * (Dn + Dr) if Rq else D * H * (Dn + Dr)
    return q + D * (R + Dr) + R * H * (Dn + Dv) + H * Dv * D, Dn + Dr + Dv


def attention_params(m) -> int:
    """One block's attention half: its RMSNorm, the projections, their biases (model.attn_bias: q/k/v without MLA;
    MLA's q_a, kv_a and o as HF's attention_bias), the q/k norms (model.qk_norm) or MLA's two low-rank norms."""
    D, H, Dh, Hkv = _dims(m)
    matmuls, _ = attention_matmuls(m)
    bias = bool(getattr(m, "attn_bias", False))
    if mla(m):
        Rq, R, Dr = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
        return D + matmuls + Rq + R + bias * (Rq + R + Dr + D)
    qk_norm = {"head": 2 * Dh, "full": (H + Hkv) * Dh}.get(getattr(m, "qk_norm", "none"), 0)
    return D + matmuls + bias * (H + 2 * Hkv) * Dh + qk_norm


def ffn_params(m, moe: bool, shared_hidden: int | None = None) -> tuple[int, int]:
    """(replicated params, params of ONE routed expert) of a block's FFN half: its RMSNorm and a dense SwiGLU, or
    the router, the shared experts (`shared_hidden`: their summed hidden width; default from the config) and
    their gate (model.shared_expert_gate)."""
    D, F = max(m.d_model, 0), max(m.ffn_dim, 0)
    if not moe:
        return D + 3 * D * max(m.dense_ffn_dim or F, 0), 0
    if shared_hidden is None:
        shared_hidden = max(m.shared_experts, 0) * max(m.shared_ffn_dim or F, 0)
    gate = D if shared_hidden and getattr(m, "shared_expert_gate", False) else 0
    return D + D * max(m.num_experts, 0) + 3 * D * shared_hidden + gate, 3 * D * F


def mtp_params(m) -> int:
    """One multi-token-prediction module's own parts (model/mtp.py), its block apart: the embedding's and the
    hidden state's norms, the projection of their concatenation, the shared head's norm."""
    D = max(m.d_model, 0)
    return 3 * D + 2 * D * D
