"""The config rules of tensor parallel (parallel/tp.py, docs/tp.md): what TP splits must divide, and what it does not
split yet. A leaf like config.py, which calls it from `validate`."""

from __future__ import annotations

from .errors import check as _check


def check_tp(cfg) -> None:
    """Tensor parallel splits heads, hidden units, vocabulary and sequence N ways (parallel/tp.py, docs/tp.md)."""
    m, p, n, no = cfg.model, cfg.parallel, cfg.parallel.tp, f"with parallel.tp={cfg.parallel.tp}"  # the experts' fold:
    # config.py (`expert_ranks`)
    for name, v in [("model.n_heads", m.n_heads), ("model.ffn_dim", m.ffn_dim),
                    ("model.dense_ffn_dim", m.dense_ffn_dim or m.ffn_dim),
                    ("model.shared_ffn_dim", m.shared_experts * (m.shared_ffn_dim or m.ffn_dim)),
                    ("train.seq_len", cfg.train.seq_len), ("model.vocab_size", m.vocab_size or cfg.data.vocab_size)]:
        _check(v % n == 0, f"parallel.tp={n} must divide {name}={v} (--parallel.tp, or --{name})")
    kv = m.n_kv_heads or m.n_heads
    _check(kv % n == 0 or n % kv == 0, f"parallel.tp={n} and model.n_kv_heads={kv}: one must divide the other "
           "(KV heads are split, or replicated when fewer than the TP ranks) (--parallel.tp)")
    for bad, line in [(m.kv_lora_rank > 0 and m.attn_bias, "model.attn_bias with MLA (a row-parallel o bias)"),
                      (p.sp and m.pos_emb == "learned", "model.pos_emb=learned (--parallel.sp false, or rope)"),
                      (p.dp_impl == "torch_ddp", "parallel.dp_impl=torch_ddp (use bucketed)"),
                      (p.ep_overlap_microbatches, "parallel.ep_overlap_microbatches: two lanes would interleave the "
                                                  "TP collectives")]:
        _check(n == 1 or not bad, f"{line}: not {no} (--parallel.tp 1)")
