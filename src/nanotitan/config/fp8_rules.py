"""The config rules of FP8 training (train.fp8, model/fp8.py, docs/fp8.md): what an FP8 GEMM can take, and which
layouts compute the scales one process computes. A leaf like config.py, which calls it from `validate`."""

from __future__ import annotations

import fnmatch
import importlib.util

from .errors import check as _check

# Kept in high precision by default (docs/fp8.md, "What stays in high precision"): the embedding (a lookup), the
# output head (its logits feed the loss's softmax), the router and the shared-expert gate (a flipped score reroutes
# a token; their widths E and 1 are rarely multiples of 16), MLA's down projections (small GEMMs feeding a norm).
FP8_SKIP = ("tok_emb", "head", "router", "shared_expert_gate", "q_a_proj", "kv_a_proj_with_mqa")


def _widths(m) -> list[tuple[str, int, tuple[str, ...]]]:
    """(field, value, the modules whose GEMMs take it as a dimension) for every FP8 GEMM of the model."""
    hd = m.head_dim or m.d_model // max(m.n_heads, 1)
    out = [("model.d_model", m.d_model, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                        "down_proj", "experts", "eh_proj", "q_a_proj", "kv_a_proj_with_mqa"))]
    if m.kv_lora_rank:
        out += [("model.kv_lora_rank", m.kv_lora_rank, ("kv_b_proj",)),
                ("model.v_head_dim", m.n_heads * m.v_head_dim, ("o_proj", "kv_b_proj")),
                ("model.qk_nope_head_dim", m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim),
                 ("q_proj", "q_b_proj"))]
        if m.q_lora_rank:
            out.append(("model.q_lora_rank", m.q_lora_rank, ("q_a_proj", "q_b_proj")))
    else:
        out += [("model.head_dim", m.n_heads * hd, ("q_proj", "o_proj")),
                ("model.n_kv_heads", (m.n_kv_heads or m.n_heads) * hd, ("k_proj", "v_proj"))]
    out += [("model.ffn_dim", m.ffn_dim, ("experts",) if m.num_experts else ("gate_proj", "up_proj", "down_proj")),
            ("model.dense_ffn_dim", m.dense_ffn_dim, ("gate_proj", "up_proj", "down_proj")),
            ("model.shared_ffn_dim", m.shared_ffn_dim, ("gate_proj", "up_proj", "down_proj"))]
    return [w for w in out if w[1]]


def check_fp8(cfg) -> None:
    """train.fp8: torchao present, every FP8 GEMM dimension a multiple of 16 (the GPU kernel's rule, kept on CPU
    so a run that passes here runs there), and only layouts whose scales are one process's."""
    t, p = cfg.train, cfg.parallel
    if t.fp8 == "off":
        return
    _check(importlib.util.find_spec("torchao") is not None,
           f"train.fp8={t.fp8} needs torchao: pip install 'nanotitan[fp8]' (or --train.fp8 off)")
    for name, v, modules in _widths(cfg.model):
        kept = [mod for mod in modules if not any(fnmatch.fnmatchcase(mod, s) for s in t.fp8_skip)]
        _check(v % 16 == 0 or not kept, f"{name} gives an FP8 GEMM dimension {v}, not a multiple of 16 "
               f"({', '.join(kept)}): make it one, add them to --train.fp8_skip, or --train.fp8 off")
    for bad, line in [(p.tp > 1, "parallel.tp > 1: the scales of a TP-split GEMM need an amax over the group"),
                      (p.cp > 1, "parallel.cp > 1: the scales of a CP-split sequence need an amax over the group"),
                      (p.ep_overlap, "parallel.ep_overlap: its expert chunks run their own GEMMs")]:
        _check(not bad, f"train.fp8={t.fp8} with {line}, not written yet (--train.fp8 off)")
