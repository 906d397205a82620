"""Tensor parallelism in the planner (issue 41, docs/planner.md "TP"): what a TP group of N ranks saves, what it
sends, and which TP degrees a layout search tries.

The rank identity (docs/tp.md): tp is the fastest-varying axis, rank = ((dp*PP + pp)*EP + ep)*TP + tp, and a TP
group lives inside one node. So every other group of a TP layout is the group of the same layout without TP with
each member r widened to ranks r*TP .. r*TP + TP-1: it crosses nodes exactly when that group does on nodes of
node_size / TP ranks (`node_size`). The TP ranks of a microbatch share its T tokens; under SP each holds T/N of
them between the TP regions, and the MoE layers route those shards (experts folded onto EP: the experts are
sharded over the EP*TP ranks of the EP group widened by TP), so no token is routed twice.

Per rank, TP divides (Megatron-style, attention and dense FFN column/row-wise, embedding and head vocab-parallel):
    parameters, gradients, optimizer state   dense part / N (norm weights and routers stay whole); experts / N
    FLOPs                                    dense / N (heads, FFN columns, vocab columns); experts / N (T/N tokens)
    activations                              TP regions (q, k, v, attention output, FFN intermediates, logits) / N;
                                             SP regions (norms, residuals) / N with SP, whole without; the gathered
                                             input of each column-parallel linear stays whole (DTensor saves it)
Collectives per block of one microbatch (T*D elements each; Megatron's count; `block_collectives`):
    without SP   forward: 2 all-reduces (attention output, FFN output); backward: 2 all-reduces
    with SP      forward: 2 all-gathers + 2 reduce-scatters; backward: the same
An MoE block's FFN half under SP sends nothing on the TP link (its shard is routed over the widened EP group; a
shared expert is a dense FFN); without SP its tokens are split for routing and gathered back (1 all-gather each
way). The embedding adds 1 (SP: and 1 backward), the head 1 each way, and the vocab-parallel loss 2 small
all-reduces in its forward (the max, T floats; the target logit with the sum of exps, 2T); an MoE layer 2 more of
E numbers (the whole microbatch's expert counts and mean probabilities for the balance loss); with
model.qk_norm=full an attention layer 2 more of T floats each way (the q and k norms' sums of squares; the q one only
when the KV heads are replicated). These are the
collectives of parallel/tp.py, which sends them through parallel/comm/ on axis "tp", so the network emulator
holds each to the same ring formulas. MTP (model/mtp.py): each depth's block is one more layer of the last stage,
split as the others; its norms and eh_proj stay whole; the embedding and the head read (1 + mtp) times the tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from ..config.counts import mtp_params
from ..config.hardware import ring_allreduce_s, ring_half_s
from .shape import Layout, ModelShape, StageSummary

# The host's cost of a TP block beyond its GEMMs and calls (the regions' autograd functions, slicing and stacking the
# shards for the collectives), per block per microbatch, forward + backward, on CPU profiles only (on a GPU it
# overlaps the kernels). An estimate, not fitted: the load on the machine it was written on (docs/tp.md "Measured")
# buried it; `nanotitan bench tp --part layouts` on a quiet machine is the measurement to fit it to.
TP_BLOCK_OVERHEAD_S = 1.5e-3


def degrees(world: int, node_size: int) -> list[int]:
    """TP degrees a search tries: divisors of the world that divide a node (the TP group on one node's links)."""
    return [t for t in range(1, world + 1) if world % t == 0 and node_size % t == 0]


def node_size(per_node: int, tp: int) -> int:
    """Nodes as the TP-free layout sees them: the ranks of a node / tp (tp fastest, so r*tp+t on node r // that)."""
    return max(1, per_node // tp)


def block_collectives(shape: ModelShape, i: int, sp: bool) -> dict[str, int]:
    """TP collectives of layer i for one microbatch, forward and backward together, each on T*D elements:
    {"all-reduce": n, "all-gather": n, "reduce-scatter": n} (module docstring)."""
    shared = bool(shape.n_shared_experts)
    ffn = not shape.is_moe(i) or shared  # an FFN half split column/row-wise: a dense FFN or the shared experts
    if sp:
        halves = 1 + ffn  # each TP'd half: AG + RS forward, RS + AG backward
        return {"all-reduce": 0, "all-gather": 2 * halves, "reduce-scatter": 2 * halves}
    gathers = 2 if shape.is_moe(i) else 0  # the routed shard's output gathered back, its input gradient too
    return {"all-reduce": 2 * (1 + ffn), "all-gather": gathers, "reduce-scatter": 0}


def end_collectives(sp: bool, first: bool, last: bool) -> dict[str, int]:
    """The embedding's (first stage) and the head's (last stage) TP collectives of T*D elements, fwd + bwd."""
    n = {"all-reduce": 0, "all-gather": 0, "reduce-scatter": 0}
    if first:  # vocab-parallel embedding: partial sums out
        n["reduce-scatter" if sp else "all-reduce"] += 1
        n["all-gather"] += sp  # its backward gathers the output's gradient for the weight's rows
    if last:  # column-parallel head: its input gathered (SP), its input's gradient reduced
        n["all-gather" if sp else "all-reduce"] += sp
        n["reduce-scatter" if sp else "all-reduce"] += 1
    return n


def _ring_s(counts: dict[str, int], nbytes: float, tp: int, bw: float, lat: float) -> float:
    return (counts.get("all-reduce", 0) * ring_allreduce_s(nbytes, tp, bw, lat)
            + (counts.get("all-gather", 0) + counts.get("reduce-scatter", 0)) * ring_half_s(nbytes, tp, bw, lat))


def tp_comm_s(shape: ModelShape, layers: list[int], first: bool, last: bool, sp: bool, tp: int, T: int,
              elem_bytes: int, bw: float, lat: float) -> tuple[float, int]:
    """(link seconds, collective calls) of TP for one microbatch (forward + backward) on a stage holding
    `layers` (a last stage's MTP blocks among them), over a TP link of bus bandwidth `bw` and per-step latency
    `lat`. With MTP the last stage's embedding call also reads the depths' future tokens (mtp * T; a replica of
    the table under PP) and its head and loss run over (1 + mtp) * T rows (model/mtp.py)."""
    if tp == 1:
        return 0.0, 0
    mtp = shape.mtp_layers if last else 0
    counts = {"all-reduce": 0, "all-gather": 0, "reduce-scatter": 0}
    for i in layers:
        for op, n in block_collectives(shape, i, sp).items():
            counts[op] += n
    nbytes = T * shape.d_model * elem_bytes
    emb = end_collectives(sp, True, False) if first or mtp else {}
    head = end_collectives(sp, False, True) if last else {}
    t = (_ring_s(counts, nbytes, tp, bw, lat) + _ring_s(emb, (first + mtp) * nbytes, tp, bw, lat)
         + _ring_s(head, (1 + mtp) * nbytes, tp, bw, lat))
    calls = sum(counts.values()) + sum(emb.values()) + sum(head.values())
    if last:  # the vocab-parallel loss: the max (T floats), then the target's logit with the sum of exps (2T)
        t += (1 + mtp) * (ring_allreduce_s(4 * T, tp, bw, lat) + ring_allreduce_s(8 * T, tp, bw, lat))
        calls += 2 * (1 + mtp)
    n_moe = sum(shape.is_moe(i) for i in layers)  # the balance loss's counts and mean probabilities, E each
    t += 2 * n_moe * ring_allreduce_s(4 * shape.num_experts, tp, bw, lat)
    calls += 2 * n_moe
    if shape.qk_norm == "full":  # the q and k norms' sums of squares (T floats) each way; k's only if its heads split
        n = 2 * len(layers) * (1 + ((shape.n_kv_heads or shape.n_heads) % tp == 0))
        t += n * ring_allreduce_s(4 * T, tp, bw, lat)
        calls += n
    return t, calls


_tp_comm = functools.lru_cache(maxsize=4096)(tp_comm_s)  # the same stages recur across a search's variants


@functools.lru_cache(maxsize=256)
def _act_ratio(shape: ModelShape, tp: int, sp: bool, ac: bool) -> tuple[float, float]:
    """(kept activations, a block's backward working set) per rank at TP `tp` over TP 1, averaged over the
    layers, by the element counts of ModelShape.layer_act_elems (module docstring). Under activation
    checkpointing a block keeps its input: the residual stream, sharded with SP only."""
    D, F, K, E, H = shape.d_model, shape.ffn_dim, shape.top_k, shape.num_experts, shape.n_heads
    norm = 3 * D + 1
    sp_norm = (2 * D + 1) / tp + D if sp else norm  # norm in, 1/rms, normalised x sharded; the gathered output whole
    kept1 = kept = bwd1 = bwd = 0.0
    for i in range(shape.n_layers):
        kept1 += shape.layer_act_elems(i)
        bwd1 += shape.layer_bwd_elems(i)
        kept += sp_norm + (4 * D + H) / tp
        if shape.is_moe(i):  # each rank routes T/N tokens; without SP their norm ran on the whole sequence
            routed = E + 8 * K + K * (3 * D + 4 * F)
            kept += (norm / tp if sp else norm) + routed / tp + shape.n_shared_experts * 4 * F / tp
        else:
            kept += sp_norm + 4 * shape.dense_hidden / tp
        bwd += shape.layer_bwd_elems(i) / tp + (0.0 if sp else 2 * D * (1 - 1 / tp))
    if ac:
        return (1 / tp if sp else 1.0), (kept + bwd) / (kept1 + bwd1)
    return kept / kept1, bwd / bwd1


def shard_stages(shape: ModelShape, layout: Layout, stages: list[StageSummary], sp: bool,
                 ac: bool) -> list[StageSummary]:
    """What one rank of a TP group holds and does, from the stages of the same layout without TP."""
    return stages if layout.tp == 1 else list(_shard(shape, layout.tp, tuple(stages), sp, ac))


@functools.lru_cache(maxsize=4096)  # a layout's schedules and zero levels share its stages
def _shard(shape: ModelShape, tp: int, stages: tuple[StageSummary, ...], sp: bool,
           ac: bool) -> tuple[StageSummary, ...]:
    act, layer_max = _act_ratio(shape, tp, sp, ac)
    D, E = shape.d_model, shape.num_experts
    out = []
    for st in stages:
        mtp = shape.mtp_layers if st.last else 0  # MTP: its blocks split as any; its norms and eh_proj whole
        whole = (2 * D * st.n_layers + D * E * st.n_moe + (D if st.last else 0) + mtp * mtp_params(shape)
                 + (st.n_layers + mtp) * replicated_kv_params(shape, tp))
        # without SP each TP rank runs eh_proj on every token (with SP on its sequence shard)
        f_whole = 0.0 if sp else mtp * 4 * D * D
        head = 1 / tp  # the logits vocab-parallel (the final norm's 3D+1 are few beside V)
        out.append(dataclasses.replace(
            st, n_ne=(st.n_ne - whole) / tp + whole, n_ex=st.n_ex / tp, f_dense=(st.f_dense - f_whole) / tp + f_whole,
            f_expert=st.f_expert / tp, act=(st.act - st.head_act) * act + st.head_act * head,
            act_layer_max=st.act_layer_max * layer_max, head_act=st.head_act * head,
            act_bytes=(st.act_bytes - st.head_act_bytes) * act + st.head_act_bytes * head,
            act_layer_max_bytes=st.act_layer_max_bytes * layer_max, head_act_bytes=st.head_act_bytes * head,
            cast_bytes=st.cast_bytes / tp, cast_layer_max_bytes=st.cast_layer_max_bytes / tp,
            cast_cache_bytes=st.cast_cache_bytes / tp, land_bytes=st.land_bytes / tp,
            land_fixed_bytes=st.land_fixed_bytes / tp, head_cast_bytes=st.head_cast_bytes / tp,
            received_bytes=st.received_bytes / tp, received_block_bytes=st.received_block_bytes / tp))
    return tuple(out)


def replicated_kv_params(shape: ModelShape, tp: int) -> int:
    """Parameters of one attention layer that stay whole on every TP rank because GQA has fewer KV heads than TP
    ranks (parallel/tp.py `_attention`: k and v projections replicated, and a full k norm with them)."""
    kv = shape.n_kv_heads or shape.n_heads
    if shape.kv_lora_rank or kv % tp == 0:
        return 0
    width = kv * (shape.head_dim or shape.d_model // shape.n_heads)
    return 2 * width * (shape.d_model + shape.attn_bias) + (width if shape.qk_norm == "full" else 0)


def sharded_shape(shape: ModelShape, tp: int) -> ModelShape:
    """The shape the memory model's whole-model terms read (embedding and head rows): vocab-parallel, V / N."""
    return shape if tp == 1 else dataclasses.replace(shape, vocab=math.ceil(shape.vocab / tp))


def stage_layers(shape: ModelShape, st: StageSummary) -> tuple[int, ...]:
    """Layers standing for a stage's in TP's per-layer collectives: its n_moe MoE layers and as many dense ones
    as it holds besides (which layers does not matter, only how many of each kind)."""
    return _layers(shape, math.ceil(st.n_layers), st.n_moe)


@functools.lru_cache(maxsize=1024)  # a search asks for a handful of (layers, MoE layers) counts, per stage per layout
def _layers(shape: ModelShape, n: int, n_moe: int) -> tuple[int, ...]:
    every = range(shape.n_layers + shape.mtp_layers)  # MTP depth k's block is layer n_layers + k - 1
    moe = [i for i in every if shape.is_moe(i)][:n_moe]
    dense = [i for i in every if not shape.is_moe(i)][:max(0, n - len(moe))]
    return tuple(moe + dense)


def stage_tp_time(c, st: StageSummary) -> tuple[float, float]:
    """(TP seconds of one microbatch on a stage: link time, calls and DTensor's overhead; the link part of it,
    which is waiting, not work, under an emulated network). `c` is the plan's Context."""
    lay, hw = c.layout, c.hw
    if lay.tp == 1:
        return 0.0, 0.0
    link = hw.intra  # a TP group stays inside one node (refusal)
    link_s, calls = _tp_comm(c.shape, stage_layers(c.shape, st), st.first, st.last,
                             c.cfg.parallel.sp, lay.tp, c.T, c.prec.act, link.allreduce_bw, link.latency_s)
    over = calls * hw.p2p_call_s + (TP_BLOCK_OVERHEAD_S * st.n_layers if hw.cores_per_node else 0.0)
    return link_s + over, link_s
