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


MX_BLOCK = 32  # mxfp8: elements per e8m0 scale along a GEMM's contraction dim (model/mxfp8.py)


def _skipped(module: str, skip) -> bool:
    return any(fnmatch.fnmatchcase(module, s) for s in skip)


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
            ("model.shared_ffn_dim", m.shared_experts * (m.shared_ffn_dim or m.ffn_dim) if m.num_experts else 0,
             ("gate_proj", "up_proj", "down_proj"))]  # every shared expert in one SwiGLU (model/transformer.py)
    return [w for w in out if w[1]]


def check_fp8(cfg) -> None:
    """train.fp8: torchao present, every FP8 GEMM dimension a multiple of 16 (the GPU kernel's rule, kept on CPU
    so a run that passes here runs there; 32 at mxfp8, its block), and only layouts whose scales are one process's
    (TP and CP reduce each amax over the ranks that hold the tensor: parallel/tp.py `cut_fp8`; mxfp8's blocks are
    local where each rank holds whole ones, `_check_mx_tokens`; the refusals are the GEMMs they cannot)."""
    t, p = cfg.train, cfg.parallel
    _check(not p.fp8_comm or t.fp8 != "off", "parallel.fp8_comm=true sends FP8 operands, and train.fp8=off makes "
           "none: --train.fp8 rowwise (or tensorwise), or --parallel.fp8_comm false")
    if t.fp8 == "off":
        return
    _check(importlib.util.find_spec("torchao") is not None,
           f"train.fp8={t.fp8} needs torchao: pip install 'nanotitan[fp8]' (or --train.fp8 off)")
    m = cfg.model
    by_tp = {"model.head_dim", "model.dense_ffn_dim", "model.shared_ffn_dim", "model.v_head_dim",
             "model.qk_nope_head_dim"} | (set() if m.num_experts else {"model.ffn_dim"})  # TP's split widths
    by_tp |= {"model.n_kv_heads"} if (m.n_kv_heads or m.n_heads) % p.tp == 0 else set()  # (else replicated)
    mult, why = (MX_BLOCK, " (MXFP8's block)") if t.fp8 == "mxfp8" else (16, "")
    # mxfp8 also blocks the router's and the shared-expert gate's widths (the default skips keep them whole; torchao
    # asserts on a width that is no multiple of 32, where the per-tensor/row recipes run any width on a CPU)
    mx = [("model.num_experts", m.num_experts, ("router",)),
          ("model.shared_expert_gate", int(m.shared_expert_gate), ("shared_expert_gate",))] if mult == MX_BLOCK else []
    for name, v, modules in _widths(m) + [w for w in mx if w[1]]:
        kept = [mod for mod in modules if not _skipped(mod, t.fp8_skip)]
        v, per = (v // p.tp, f" per TP rank (of {v})") if name in by_tp and p.tp > 1 else (v, "")
        _check(v % mult == 0 or not kept, f"{name} gives an FP8 GEMM dimension {v}{per}, not a multiple of {mult}"
               f"{why} ({', '.join(kept)}): make it one, add them to --train.fp8_skip, or --train.fp8 off")
    if t.fp8 == "mxfp8":
        _check_mx_tokens(cfg)
    experts_fp8 = m.num_experts and not _skipped("experts", t.fp8_skip)
    _check(p.ep_dispatch != "static" or not experts_fp8, f"train.fp8={t.fp8} with parallel.ep_dispatch=static: the "
           f"FP8 experts size their GEMMs (one per expert on CPU, the grouped launch's aligned rows on a GPU) by "
           f"counts read to the host, which static dispatch keeps on the device (--parallel.ep_dispatch dynamic, "
           f"add experts to --train.fp8_skip, or --train.fp8 off)")
    _check(not (p.fp8_comm and p.zero == 3 and t.compile), "parallel.fp8_comm=true at parallel.zero=3 gathers "
           "the FP8 weights as a tensor subclass the compiled blocks are not traced with: --train.compile false, or "
           "--parallel.fp8_comm false")
    _check(not p.ep_overlap, f"train.fp8={t.fp8} with parallel.ep_overlap: its expert chunks run their own GEMMs, "
           f"not written yet (--parallel.ep_overlap false, or --train.fp8 off)")
    fp8 = [mod for mod in ("k_proj", "v_proj", "kv_b_proj") if not _skipped(mod, t.fp8_skip)]
    kv = [mod for mod in fp8 if mod != "kv_b_proj"]
    _check(p.tp == 1 or m.kv_lora_rank or (m.n_kv_heads or m.n_heads) % p.tp == 0 or not kv,
           f"train.fp8={t.fp8} with parallel.tp={p.tp} not dividing model.n_kv_heads={m.n_kv_heads}: the replicated "
           f"{'/'.join(kv)} take partial output gradients, which FP8 would round before their sum: add them to "
           f"--train.fp8_skip, or make parallel.tp divide model.n_kv_heads")
    _check(p.cp == 1 or not m.kv_lora_rank or p.cp_impl != "ring" or "kv_b_proj" not in fp8,
           f"train.fp8={t.fp8} with MLA under parallel.cp_impl=ring: kv_b_proj expands each ring step's latent on "
           f"its own, so its scales would not be the whole sequence's: add kv_b_proj to --train.fp8_skip, or "
           f"--parallel.cp_impl a2a")


def _check_mx_tokens(cfg) -> None:
    """mxfp8: a weight gradient `dy^T @ x` takes its blocks along the tokens, 32 in a row of one microbatch's
    flattened (sequence, position) order. DP, ZeRO, PP and EP run a microbatch whole on a rank; CP and TP's token
    split (the shared experts, MTP's eh_proj, the router: each TP rank's sequence shard) cut every sequence into
    runs, so each run must be whole blocks for a rank's blocks to be one process's. The EP dispatch's FP8 payload is
    per-row e4m3 (model/fp8.py): not MXFP8's blocks."""
    t, p, m = cfg.train, cfg.parallel, cfg.model
    S, tokens = t.seq_len, t.micro_batch * t.seq_len // p.cp
    _check(not p.fp8_comm, "parallel.fp8_comm sends per-row FP8 operands, not MXFP8's blocks: --parallel.fp8_comm "
           "false with --train.fp8 mxfp8 (or --train.fp8 rowwise)")
    _check(tokens % MX_BLOCK == 0, f"train.fp8=mxfp8 takes the weight gradients' blocks along a microbatch's "
           f"{tokens} tokens a rank (train.micro_batch x train.seq_len / parallel.cp), not a multiple of {MX_BLOCK}: "
           f"change train.micro_batch or train.seq_len, or --train.fp8 rowwise")
    _check(p.cp == 1 or p.cp_split == "zigzag", "train.fp8=mxfp8 with parallel.cp_split=docs: each microbatch's CP "
           "runs follow its documents, not the 32-token blocks of the weight gradients: --parallel.cp_split zigzag, "
           "or --train.fp8 rowwise")
    _check(p.cp == 1 or S % (2 * p.cp * MX_BLOCK) == 0,
           f"train.fp8=mxfp8 with parallel.cp={p.cp}: each CP chunk of train.seq_len={S} holds {S // (2 * p.cp)} "
           f"tokens, not whole {MX_BLOCK}-token blocks of the weight gradients: make train.seq_len a multiple of "
           f"{2 * p.cp * MX_BLOCK}, or --train.fp8 rowwise")
    swiglu = not all(_skipped(x, t.fp8_skip) for x in ("gate_proj", "up_proj", "down_proj"))
    split = [mod for mod, on in (("shared experts", m.shared_experts and swiglu), ("eh_proj", m.mtp_layers and p.sp),
                                 ("router", m.num_experts), ("shared_expert_gate", m.shared_expert_gate))
             if on and (mod == "shared experts" or not _skipped(mod, t.fp8_skip))]
    run = S // p.cp // p.tp
    _check(p.tp == 1 or not split or run % MX_BLOCK == 0,
           f"train.fp8=mxfp8 with parallel.tp={p.tp}: {', '.join(split)} run on each TP rank's {run} tokens of a "
           f"sequence (train.seq_len / parallel.cp / parallel.tp), not whole {MX_BLOCK}-token blocks of the weight "
           f"gradients: make train.seq_len a multiple of {p.cp * p.tp * MX_BLOCK}, add them to --train.fp8_skip, "
           f"or --train.fp8 rowwise")
