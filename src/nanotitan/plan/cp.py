"""Context parallelism in the planner (docs/planner.md "CP"): what a CP group of N ranks saves, what it
sends on which link, and which CP degrees a layout search tries.

The rank identity (tp fastest, cp next, as Megatron and torchtitan):
    rank = ((((dp * PP + pp) * EP + ep) * CP + cp) * TP + tp)
so a CP group (fixed dp, pp, ep, tp) is TP-strided and its CP x TP ranks are contiguous: inside one node when
CP*TP ranks fit a node, else the CP group crosses nodes (`placement`, on parallel/dims.py's groups). The other
groups: EP varies (ep, cp, tp) (the experts fold over EP x CP x TP), non-expert DP (dp, ep, cp), expert DP dp, PP pp.

Per rank, CP divides a microbatch's T = m*S tokens by N (each rank holds chunks i and 2N-1-i of 2N): its saved
activations, its GEMM FLOPs and the bytes of every per-token collective (EP, TP, PP) fall N-fold; a query still
meets the keys of its whole causal prefix, so the attention FLOPs per token stay (ModelShape counts 2*S*H*width).
Dense parameters are replicated over CP (their gradients reduced and zero-sharded over dp*ep*cp), the experts
sharded over ep*cp*tp. What CP adds, per attention layer of one microbatch on one rank, with B the bytes of its
local K/V block (T/N tokens x `kv_elems`):
    ring  forward: N-1 hops, each sending and receiving one block (K and V in one message: 2(N-1) tensor
          transfers), each posted before the block it overlaps; forward keeps the first block it received
          (`saved_bytes`, per attention layer) so that the backward needs N-2 K/V hops, and N-1 of dK/dV in fp32
          (parallel/cp_attn.py accumulates them in fp32 as they travel from the first rank that used them; the
          last hop brings them home, and the owner adds its own share there). Backward: the second K/V block
          travels behind the first's compute; from then on each step's dK/dV hop leaves in one batch with the
          next K/V hop (one latency for both), posted after the block, overlapping the next one; the last dK/dV
          hop home overlaps the own block, which runs last. Exposed is what a message lasts beyond one block's
          attention (forward: 1/N of the layer's score-and-mix FLOPs; backward: twice that). In flight beside a
          layer's backward: the block computed and the next (2B), the gradients travelling and arriving (2 fp32
          blocks), the step's zero-padded dK/dV (B), dq's fp32 accumulator, and under MLA the block's up-projected
          per-head K/V and their gradients.
    a2a   Ulysses: q, k, v to head shards and the output back, (N-1)/N of `a2a_elems` per token each way (KV
          heads fewer than N are repeated to N first); the backward the same; not overlapped. Buffers: the send
          and the receive side of q, k, v and the output.
GQA sends its KV heads (split over TP where they divide), never repeated copies; MLA sends its latent
(kv_lora_rank + rope dim per token, whole on every TP rank) and up-projects locally.
"""

from __future__ import annotations

import functools

from ..config.counts import attention_matmuls
from ..parallel.dims import ParallelDims
from .context import worst_crossing
from .shape import Layout, ModelShape


def degrees(world: int, seq_len: int) -> list[int]:
    """CP degrees a search tries: divisors of the world that split the sequence into 2*cp equal chunks."""
    return [c for c in range(1, world + 1) if world % c == 0 and seq_len % (2 * c) == 0] or [1]


def kv_elems(shape: ModelShape, tp: int) -> int:
    """Elements per token one ring hop carries on a TP rank: MLA's latent (post-norm c_kv and the roped k_rope,
    whole on every TP rank), else the rank's KV heads' keys and values (all KV heads where they do not split)."""
    if shape.kv_lora_rank:
        return shape.kv_lora_rank + shape.qk_rope_head_dim
    kv, hd = shape.n_kv_heads or shape.n_heads, shape.head_dim or shape.d_model // shape.n_heads
    return (kv // tp if kv % tp == 0 else kv) * 2 * hd


def whole_kv_elems(shape: ModelShape, tp: int = 1) -> int:
    """Elements per token of whole per-head K and V on a TP rank (MLA up-projected): what a ring would carry
    without the latent, and what MLA's ring expands each received block to."""
    H = shape.n_heads // tp
    if shape.kv_lora_rank:
        return H * (shape.qk_nope_head_dim + shape.qk_rope_head_dim + shape.v_head_dim)
    return kv_elems(shape, tp)


def q_elems(shape: ModelShape, tp: int) -> int:
    """Elements per token of a TP rank's queries (MLA: nope + rope per head)."""
    hd = shape.qk_nope_head_dim + shape.qk_rope_head_dim if shape.kv_lora_rank else (shape.head_dim or
                                                                                      shape.d_model // shape.n_heads)
    return shape.n_heads // tp * hd


def a2a_elems(shape: ModelShape, tp: int, cp: int) -> int:
    """Elements per token Ulysses' all-to-alls move per attention layer forward on a TP rank: q, k, v and the output
    (MLA: the up-projected per-head k and v; GQA: the KV heads, repeated to cp heads where fewer)."""
    H = shape.n_heads // tp
    if shape.kv_lora_rank:
        qk, dv = shape.qk_nope_head_dim + shape.qk_rope_head_dim, shape.v_head_dim
        return H * (2 * qk + 2 * dv)
    hd = shape.head_dim or shape.d_model // shape.n_heads
    kv = kv_elems(shape, tp) // (2 * hd)
    return 2 * H * hd + 2 * hd * (kv if kv % cp == 0 else cp)


def ring_bytes(shape: ModelShape, tokens: float, cp: int, tp: int, elem: int) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends (and receives) per attention layer of a microbatch whose `tokens`
    are its local T/N: forward N-1 blocks, backward N-2 blocks of K/V and N-1 of dK/dV in fp32 (module docstring)."""
    if cp == 1:
        return 0.0, 0.0
    per_token = tokens * kv_elems(shape, tp)
    return (cp - 1) * per_token * elem, (cp - 2) * per_token * elem + (cp - 1) * per_token * 4


def saved_bytes(shape: ModelShape, tokens: float, cp: int, tp: int, elem: int, impl: str) -> float:
    """Bytes the ring's forward keeps per attention layer for its backward beyond the local q, k, v, out and lse:
    the first block it received (its backward then starts one hop ahead)."""
    return tokens * kv_elems(shape, tp) * elem if cp > 1 and impl == "ring" else 0.0


def a2a_bytes(shape: ModelShape, tokens: float, cp: int, tp: int, elem: int) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends to its CP peers per attention layer under cp_impl a2a."""
    b = tokens * a2a_elems(shape, tp, cp) * elem * (cp - 1) / cp
    return b, b


def buffer_bytes(shape: ModelShape, tokens: float, cp: int, tp: int, elem: int, impl: str) -> float:
    """Bytes CP's attention holds beside one layer's backward (module docstring): the ring's blocks in flight with
    their gradients, dq's accumulator (and MLA's up-projected block with its gradient), or the all-to-all's send
    and receive buffers."""
    if cp == 1:
        return 0.0
    if impl == "a2a":
        return 2 * tokens * a2a_elems(shape, tp, cp) * elem
    kv = tokens * kv_elems(shape, tp)
    expand = 2 * tokens * whole_kv_elems(shape, tp) * elem if shape.kv_lora_rank else 0.0
    return 3 * kv * elem + 2 * kv * 4 + tokens * q_elems(shape, tp) * 4 + expand


def core_flops(shape: ModelShape, tp: int) -> float:
    """Forward FLOPs per token of one layer's scores and mix (what the ring's hops overlap), on a TP rank."""
    return 2 * (shape.attn_span or shape.seq_len) * shape.n_heads * attention_matmuls(shape)[1] / tp


def ring_exposed(kv_s: float, grad_s: float, lat_s: float, cp: int, block_s: float) -> tuple[float, float]:
    """(exposed, link) seconds of one layer's ring, forward + backward: K/V hops of `kv_s` and dK/dV hops of
    `grad_s` over the link, `lat_s` per message, a forward block's compute `block_s` (the backward's twice that).
    Every message hides behind one block: forward N-1 K/V hops; backward the second K/V block alone (N > 2),
    then after each of the N-1 blocks its dK/dV hop, batched with the next K/V hop while one is left."""
    fwd = (cp - 1) * max(0.0, kv_s + lat_s - block_s)
    bwd_msgs = ([kv_s] if cp > 2 else []) + [grad_s + (kv_s if s + 2 < cp else 0.0) for s in range(1, cp)]
    bwd = sum(max(0.0, m + lat_s - 2 * block_s) for m in bwd_msgs)
    link = (cp - 1) * (kv_s + lat_s) + sum(m + lat_s for m in bwd_msgs)
    return fwd + bwd, link


def stage_cp_time(c, st) -> tuple[float, float]:
    """(CP seconds of one microbatch on a stage, on the critical path; the link time in it), `c` the plan's Context.
    On a CPU profile the P2P is the host's work (gloo), so nothing hides behind compute unless the link is an
    emulated wait (opts.links_idle)."""
    lay, hw, shape = c.layout, c.hw, c.shape
    N = lay.cp
    if N == 1 or not st.n_attn:
        return 0.0, 0.0
    link, _ = c.links["cp"]
    impl = c.cfg.parallel.cp_impl
    if impl == "a2a":
        fwd, _ = a2a_bytes(shape, c.T, N, lay.tp, c.prec.act)
        one = 2 * (fwd / link.a2a_bw + 4 * (N - 1) * link.latency_s)  # q, k, v out and back; the backward's alike
        calls = 8
        return st.n_attn * (one + calls * hw.a2a_call_s), st.n_attn * one
    kv = c.T * kv_elems(shape, lay.tp) / link.p2p_bw
    block = c.T * core_flops(shape, lay.tp) / (c.peak * c.eff_dense) / N
    hidden = not hw.cores_per_node or c.opts.links_idle
    exposed, _ = ring_exposed(kv * c.prec.act, kv * 4, link.latency_s, N, block if hidden else 0.0)
    calls = 2 * (3 * N - 4)  # every hop an isend and an irecv: N-1 forward; backward N-2 K/V and N-1 dK/dV
    return st.n_attn * (exposed + calls * hw.p2p_call_s), st.n_attn * exposed


@functools.lru_cache(maxsize=4096)
def placement(layout: Layout, kind: str, per_node: int) -> tuple[bool, float]:
    """(crosses nodes, fraction of a member's peers on other nodes) of the worst group of `kind` among those of the
    first and the last rank, nodes of `per_node` ranks filled in rank order (context.placement's rule, on the
    runtime's own CP identity: `ParallelDims`)."""
    return worst_crossing(lambda r: ParallelDims(layout.dp, layout.pp, layout.ep, r, tp=layout.tp, cp=layout.cp),
                          layout.dp * layout.pp * layout.ep * layout.cp * layout.tp, kind, per_node)
