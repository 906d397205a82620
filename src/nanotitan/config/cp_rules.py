"""The config rules of context parallel (parallel/cp.py, docs/cp.md): what CP splits must divide, and what it does
not split yet. A leaf like config.py, which calls it from `validate`."""

from __future__ import annotations

from .errors import check as _check


MIN_CHUNK = 64  # tokens: parallel.cp_split=docs cuts no finer (a block pair's kernel call would outweigh its saving)


def chunks_per_half(S: int, n: int) -> int:
    """g: the chunks of S/(2n*g) tokens a CP rank holds per zigzag half under documents (parallel/cp_split.py): the
    largest of 4, 2, 1 that divides S/(2n) and leaves chunks of at least MIN_CHUNK tokens."""
    for g in (4, 2):
        if S % (2 * n * g) == 0 and S // (2 * n * g) >= MIN_CHUNK:
            return g
    return 1


def check_cp(cfg) -> None:
    """Context parallel cuts each sequence into 2*cp chunks, rank i holding chunks i and 2cp-1-i (parallel/cp.py)."""
    m, p, t, n = cfg.model, cfg.parallel, cfg.train, cfg.parallel.cp
    _check(p.cp_impl in ("ring", "a2a"), f"parallel.cp_impl={p.cp_impl!r} must be ring or a2a (--parallel.cp_impl)")
    _check(p.cp_split in ("zigzag", "docs"),
           f"parallel.cp_split={p.cp_split!r} must be zigzag or docs (--parallel.cp_split)")
    _check(p.cp_split == "zigzag" or m.attn_mask == "doc",
           "parallel.cp_split=docs balances documents: it needs model.attn_mask=doc (--model.attn_mask doc, or "
           "--parallel.cp_split zigzag)")
    if n == 1:
        return
    S, chunk = t.seq_len, t.seq_len // (2 * n)
    _check(S % (2 * n) == 0, f"train.seq_len={S} must be a multiple of 2*parallel.cp = {2 * n}: each CP rank holds "
           f"two of its 2*cp chunks (--train.seq_len {max(2 * n, S // (2 * n) * 2 * n)}, or --parallel.cp)")
    _check(not (p.tp > 1 and p.sp) or (S // n) % p.tp == 0,
           f"train.seq_len/parallel.cp = {S // n} must be a multiple of parallel.tp={p.tp}: sequence parallel splits "
           f"each CP rank's tokens over TP (--train.seq_len, or --parallel.sp false)")
    if p.cp_impl == "a2a":  # Ulysses trades the sequence shard for a head shard: a TP rank's heads split cp ways
        heads = m.n_heads // p.tp
        kv = m.n_heads if m.kv_lora_rank else max((m.n_kv_heads or m.n_heads) // p.tp, 1)  # MLA expands per head
        _check(heads % n == 0 and (kv % n == 0 or n % kv == 0),
               f"parallel.cp_impl=a2a splits heads over parallel.cp={n}: model.n_heads={m.n_heads} per TP rank "
               f"({heads}) must be a multiple of it and its KV heads ({kv}) a multiple or a divisor "
               "(--parallel.cp_impl ring)")
    _check(m.mtp_layers < chunk, f"model.mtp_layers={m.mtp_layers} must be < train.seq_len/(2*parallel.cp) = {chunk}: "
           "MTP's untargeted tail must lie in the last chunk (--train.seq_len, or --parallel.cp)")
    fine = chunk // chunks_per_half(S, n)
    _check(p.cp_split == "zigzag" or m.mtp_layers < fine,
           f"model.mtp_layers={m.mtp_layers} must be < parallel.cp_split=docs's chunk of {fine} tokens: MTP's "
           "untargeted tail must lie in the last chunk (--parallel.cp_split zigzag, or --train.seq_len)")
    for bad, line in [(m.pos_emb == "learned", "model.pos_emb=learned (--model.pos_emb rope)"),
                      (p.dp_impl == "torch_ddp", "parallel.dp_impl=torch_ddp, whose average over its group is not "
                                                 "the CP ranks' sum (use bucketed)"),
                      (p.ep_overlap_microbatches, "parallel.ep_overlap_microbatches: two lanes would interleave the "
                                                  "CP collectives"),
                      (t.qk_clip > 0, "train.qk_clip, whose per-head max logit needs every key, not the ring's "
                                      "blocks (--train.qk_clip 0)")]:
        _check(not bad, f"{line}: not with parallel.cp={n} (--parallel.cp 1)")
