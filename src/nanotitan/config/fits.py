"""Whether a job's model can fit at all, from the config alone: checked before anything is allocated, so an absurd
size (`--data.vocab_size 1000000000000`, `--model.d_model 1000000000`) ends in one line naming the field, the GiB a
rank would need and the GiB this machine has, instead of an allocator error or a machine swapping to death.

The estimate is a floor, cheap and deliberately generous: one rank's share of the parameters (its layers under PP,
its experts under EP, the embeddings it holds) x bytes per parameter (fp32 weights, gradients and AdamW's two
moments, each divided over the data ranks at the ZeRO level that shards it), plus the RoPE tables. Activations are
left out: a job it lets through may still not fit (the planner's figure, `nanotitan plan`, is the close one), but one
it refuses cannot. It is compared with this host's whole memory, the most one rank could ever get.

Pure arithmetic on the config (no torch, no loop over layers: n_layers may be 10**9 here).
"""

from __future__ import annotations

import copy

from . import counts
from .hardware import GiB, host_memory_bytes

FP32 = 4
MAX_VOCAB = 2**32 - 1  # token ids are stored as at most uint32 (data/prepare.py)
# The fields whose size the estimate grows with, named by the refusal: the one whose shrinking shrinks it the most.
SIZE_FIELDS = ("data.vocab_size", "model.vocab_size", "model.d_model", "model.n_layers", "model.ffn_dim",
               "model.num_experts", "model.n_heads", "model.n_kv_heads", "model.head_dim", "model.max_seq_len",
               "model.dense_ffn_dim", "model.shared_experts", "model.shared_ffn_dim", "model.q_lora_rank",
               "model.kv_lora_rank", "model.qk_nope_head_dim", "model.qk_rope_head_dim", "model.v_head_dim",
               "model.mtp_layers")


def _moe_layers(m, lo: int = 0, hi: int | None = None) -> int:
    """Layers lo..hi-1 (default: every decoder layer) with an MoE FFN (transformer.is_moe_layer), counted without
    visiting each layer."""
    k, hi = max(m.moe_every, 1), max(m.n_layers, 0) if hi is None else hi
    start = max(max(m.first_k_dense, 0), lo)
    first = -(-start // k) * k  # the first multiple of moe_every at or past first_k_dense and lo
    every = max(0, -(-(hi - first) // k)) if first < hi else 0
    listed = {i for i in m.dense_layers if first <= i < hi and i % k == 0}
    return max(0, every - len(listed))


def rank_params(cfg, whole: bool = False) -> tuple[float, float]:
    """(parameters the busiest rank holds, float32 buffer elements it holds: the RoPE tables), from the config's
    layout: layers split over pp (the first stage's share, rounded up; the last's, rounded down, with the head and
    the MTP depths and their replica of the embedding), experts over ep. Parts counted by config/counts.py, as
    the planner counts them. `whole`: the full model in one process (export, generate), whatever layout trained
    it."""
    m, p = cfg.model, cfg.parallel
    ep, stages = (1, 1) if whole else (max(p.ep, 1), max(p.pp, 1))
    D, L = max(m.d_model, 0), max(m.n_layers, 0)
    V = max(m.vocab_size or cfg.data.vocab_size, 0)
    attn = counts.attention_params(m)
    moe_ne, one_expert = counts.ffn_params(m, True)
    moe = moe_ne + one_expert * max(m.num_experts, 0) / ep
    dense = counts.ffn_params(m, False)[0]
    n_moe = _moe_layers(m)
    per_layer = (n_moe * moe + (L - n_moe) * dense) / max(L, 1) + attn
    mtp, n_mtp_moe = max(m.mtp_layers, 0), _moe_layers(m, L, L + max(m.mtp_layers, 0))
    mtp_params = mtp * (attn + counts.mtp_params(m)) + n_mtp_moe * moe + (mtp - n_mtp_moe) * dense
    pos = m.max_seq_len * D if m.pos_emb == "learned" else 0
    if stages == 1:
        params = L * per_layer + 2 * V * D + pos + mtp_params
    else:
        last = L // stages * per_layer + V * D + (V * D + mtp_params if mtp else 0)
        params = max(-(-L // stages) * per_layer + V * D + pos, last)
    rope = 2 * max(m.max_seq_len, 1) * counts.rope_width(m) if m.pos_emb == "rope" else 0
    return params, rope


def rank_bytes(cfg, training: bool = True, whole: bool = False) -> float:
    """Bytes the busiest rank needs at least: its parameters x (weights, gradients, AdamW's two moments), each
    sharded over the data ranks from the ZeRO level that shards it (1: optimizer state, 2: + gradients, 3: +
    weights), plus the RoPE tables. `training=False`: the weights only (a model loaded to sample or export)."""
    params, buffers = rank_params(cfg, whole)
    if not training:
        return (params + buffers) * FP32
    n, zero = max(cfg.parallel.dp * cfg.parallel.ep, 1), cfg.parallel.zero
    per_param = FP32 * ((1 / n if zero >= 3 else 1) + (1 / n if zero >= 2 else 1) + 2 * (1 / n if zero >= 1 else 1))
    return params * per_param + buffers * FP32


def _culprit(cfg, **how) -> str:
    """The size field that, brought down to 1, shrinks the estimate the most: the one the refusal names. The
    vocabulary is one trial (model.vocab_size is data.vocab_size's unless set apart, or init.from_hf's)."""
    m, d = cfg.model, cfg.data
    own_vocab = bool(cfg.init.from_hf) or (m.vocab_size not in (0, d.vocab_size))
    best = ("", rank_bytes(cfg, **how))
    for name in SIZE_FIELDS:
        if name == ("data.vocab_size" if own_vocab else "model.vocab_size"):
            continue
        section, key = name.split(".")
        if not getattr(getattr(cfg, section), key):  # 0 is off or automatic (kv_lora_rank 0: no MLA): never the culprit
            continue
        trial = copy.copy(cfg)
        trial.model, trial.data = copy.copy(m), copy.copy(d)
        setattr(getattr(trial, section), key, 1)
        if key == "vocab_size":
            trial.model.vocab_size = trial.data.vocab_size = 1
        if (need := rank_bytes(trial, **how)) < best[1]:
            best = (name, need)
    return best[0]


def vocab_too_large(cfg) -> str:
    """validate(): '' or the line refusing a data.vocab_size past what uint32 token ids hold, with the GiB it
    would take (the token files store ids as uint32 at most: no machine makes such a vocabulary work)."""
    v = cfg.data.vocab_size
    if v <= MAX_VOCAB:
        return ""
    floor = copy.copy(cfg)
    floor.model = copy.copy(cfg.model)
    floor.model.vocab_size = v
    return (f"data.vocab_size={v} is more than token ids hold ({MAX_VOCAB}), and the model "
            f"would need {rank_bytes(floor) / GiB:,.1f} GiB per rank, this machine has "
            f"{host_memory_bytes() / GiB:,.1f} GiB (--data.vocab_size)")


def does_not_fit(cfg, mem_bytes: float | None = None, training: bool = True, whole: bool = False) -> str:
    """'' when the busiest rank's floor (rank_bytes) fits in this host's memory (`mem_bytes`), else one line naming
    the field, e.g. "model.d_model=1000000000 needs 238,418,825,507.2 GiB per rank before any activation (...), and
    this machine has 23.5 GiB (--model.d_model, ...)". Under parallel.auto the layout is not chosen yet: checked
    once the planner has.
    `training`, `whole`: as rank_bytes and rank_params take them."""
    if cfg.parallel.auto and not whole:
        return ""
    if training and cfg.train.device == "cuda":
        # Gradients and AdamW's moments live on the GPU, whose size this layer does not know. The host now fills
        # one parameter at a time (parallel/build.py); holding the weights' total to it is a conservative bound.
        training = False
    need = rank_bytes(cfg, training, whole)
    have = host_memory_bytes() if mem_bytes is None else mem_bytes
    if need <= have:
        return ""
    name = _culprit(cfg, training=training, whole=whole) or "model.d_model"
    section, key = name.split(".")
    p = cfg.parallel
    source = f"init.from_hf={cfg.init.from_hf!r} gives " if cfg.init.from_hf and section == "model" else ""
    what = (f"fp32 weights, gradients and AdamW state at dp={p.dp} pp={p.pp} ep={p.ep} zero={p.zero}" if training
            else "its fp32 weights, in one process" if whole else "its fp32 weights")
    fix = f"--{name}, or more ranks: --parallel.pp/--parallel.ep" if training and not whole else name
    return (f"{source}{name}={getattr(getattr(cfg, section), key)} needs {need / GiB:,.1f} GiB per rank before any "
            f"activation ({what}), and this machine has {have / GiB:,.1f} GiB ({fix})")
