"""The memory model: predicted peak bytes of a rank of every pipeline stage, by cause (docs/planner.md §2).

What the runtime decides is read from the runtime: how many zero 2 reduce-scatters stay in flight
(`zero.IN_FLIGHT_BUCKETS`), how big a bucket is (`dp.bucket_bytes`), what FSDP shards and keeps gathered
(`fsdp.shards_experts`, `fsdp.experts_in_block_unit`, `fsdp.kept_gathered`), the zero 2/3 choices
(`sync.zero_memory_choices`, via the Context). Shapes: V vocab, D d_model, K top_k, E experts, T tokens of one
microbatch on one rank.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..config.config import Config
from ..parallel.dp import reducer as dp_reducer, fsdp, zero as zero_sharding
from ..parallel.pp import facts as pp_facts
from . import cp as cp_plan
from .context import Context
from .shape import Layout, ModelShape, StageSummary

# The routing skew the calibration measured (docs/calibration.md "Peak memory"): fitted to the busiest EP rank's
# saved activations on the 9 EP layouts of `bench layouts` (bench.toml, steps 1-3 from a fresh router,
# aux_coef 0.01). `nanotitan plan --peaks` prints the fit of a new measurement; `--expert-skew` overrides it.
EXPERT_SKEW = 0.53


@functools.lru_cache(maxsize=1024)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n <= 1; 0.564 for 2, 1.029 for 4): the integral of
    1 - Phi^n over x > 0 less that of Phi^n over x < 0, by the trapezoid rule."""
    if n <= 1:
        return 0.0
    h, hi, r2 = 2e-3, 8.0 + math.sqrt(2 * math.log(n)), math.sqrt(2)

    def above(x: float) -> float:  # 1 - Phi(x)^n, x >= 0, without cancellation
        return -math.expm1(n * math.log1p(-0.5 * math.erfc(x / r2)))

    def below(x: float) -> float:  # Phi(-x)^n, x >= 0
        return math.exp(n * math.log(0.5 * math.erfc(x / r2)))

    def trapezoid(f, b: float) -> float:  # over [0, b]; each side of 0 apart, as the integrand jumps there
        k = int(b / h)
        return b / k * (sum(f(b * i / k) for i in range(1, k)) + (f(0.0) + f(b)) / 2)

    return trapezoid(above, hi) - trapezoid(below, 8.0)


def expert_imbalance(cfg: Config, layout: Layout, shape: ModelShape, units: float, windows: float,
                     skew: float) -> float:
    """The busiest EP rank's received assignments over the mean (T*K per microbatch and MoE layer) at the peak of
    a stage that holds `units` (MoE layers x microbatches in flight) of them, its run showing `windows` such
    peaks per step and replica.

    With model.capacity_factor each source microbatch sends an expert at most ceil(cf*T*K/E) assignments, so a
    rank receives at most E times that: an exact bound, used as it is. Dropless: an expert's share of one
    microbatch's assignments varies with CV `skew` (opts.expert_skew, measured), independently per source
    microbatch and layer; a rank's load sums L = E/EP experts from EP sources over `units`, so its deviation
    from the mean has sd skew*sqrt((1 - 1/EP) / (L*EP*units)) (the 1 - 1/EP: the EP ranks share a fixed total),
    and the peak is the highest of the run's draws, one per rank, window, replica and step: the sd times the
    expected max of that many standard normals. Either way a rank never receives more than min(K, L) of each
    source token's K assignments. skew 0: a perfectly balanced router."""
    ep, E, K = layout.ep * layout.cp, shape.num_experts, shape.top_k  # the experts fold over CP (plan/cp.py)
    if ep == 1:
        return 1.0
    L, T = E // ep, layout.micro_batch * shape.seq_len // layout.cp
    bound, cf = ep * min(K, L) / K, cfg.model.capacity_factor
    if cf:
        bound = min(bound, E * math.ceil(cf * T * K / E) / (T * K))
    if not skew:  # a balanced router (what the dry run routes): the mean, or less where capacity < 1 drops
        return min(1.0, bound)
    if cf:
        return bound
    draws = cfg.train.steps * windows * layout.dp * ep
    sd = skew * math.sqrt((1 - 1 / ep) / (L * ep * max(units, 1.0)))
    return min(bound, 1.0 + sd * expected_max_normal(max(1, round(draws))))


@dataclass
class StageMemory:
    parts: dict[str, float]  # peak bytes by cause
    peak: float  # the larger of the step's peak (the parts' sum) and the checkpoint's
    ckpt: float  # peak bytes while saving or loading a checkpoint
    block: float  # one block's params (experts included): the time model's zero-3 all-gather count reads it


def stage_memory(c: Context, s: int, st: StageSummary) -> StageMemory:
    """Predicted peak bytes of a rank of stage `s`, by cause. Sharded DP (docs/dp.md): replicated params shard over
    the non-expert-DP group (dp*ep ranks), expert shards over expert-DP (dp ranks); padding (< 16*N elements a
    bucket) ignored."""
    zero, prec, M, shape = c.zero, c.prec, c.layout.microbatches, c.shape
    V, D = shape.vocab, shape.d_model
    n_local = st.n_ne + st.n_ex
    n_shard = st.n_ne / c.ne_group + st.n_ex / c.ex_group
    n_fsdp = st.n_ne + (st.n_ex if fsdp.shards_experts(c.layout.dp) else 0)  # zero 3: what FSDP shards
    opt_params = n_shard if zero >= 1 else n_local
    # no zero level changes what a microbatch keeps: the layout's other levels reuse it (Context.shared)
    act_bytes, recv_extra, imb = c.shared.get(("activations", s)) or c.shared.setdefault(
        ("activations", s), _activations(c, s, st))
    # Between steps a rank keeps params/grads/optimizer. During a step (docs/dp.md "Peak memory"): zero 2
    # "full" holds every full gradient bucket from the first backward to finish(), "shard" at most the buckets
    # in flight plus the one backward fills; zero 3 "never" the gathered params from the first forward to the
    # final backward, "always" those of the moment (below); zero 3 "full" accumulates unsharded gradients over
    # the microbatches (M = 1: one module's at a time).
    grad_params = n_shard if zero >= 2 else n_local
    root = (V * D if st.first else 0) + (V * D + D if st.last else 0)
    block = (n_local - root) / max(st.n_layers, 1)
    gathered, *z3 = _zero3_always(c, st, root)
    z2_carry, z2_moments = _zero2_shard(c, st, n_local, root)
    buffers, block_params, block_grads = max(_transients(c, st, recv_extra, imb, z3, z2_moments), key=sum)
    z_shard, z_reshard = c.z_shard, c.z_reshard
    parts = {"params": (n_shard if zero == 3 else n_local) * prec.param,
             "grads": grad_params * prec.grad,
             # Muon keeps one momentum buffer where AdamW keeps two moments (docs/optim.md "State")
             "optimizer": opt_params * (prec.master + prec.moments) - c.muon_elements(st) * prec.moments / 2,
             "grad_buckets": z2_carry + (0.0 if zero == 2 and z_shard
                                         else n_local if zero == 2 or (zero == 3 and M > 1 and not z_shard)
                                         else block if zero == 3 and not z_reshard else 0.0) * prec.grad
                             + block_grads,
             "gathered_params": (n_fsdp * prec.param if zero == 3 and not z_reshard else gathered + block_params),
             "activations": act_bytes, "buffers": buffers,
             "reserved": c.hw.mem_reserved_bytes}
    # Saving or loading a checkpoint (docs/dp.md "Checkpoints"): the state between steps plus one tensor in
    # flight (a box copied as DCP writes it, or a stored chunk read before its overlap is copied into the live
    # state), at most the largest tensor, in fp32 (AdamW's moments are stored fp32 whatever the params).
    biggest = max(V * D, D * shape.ffn_dim, D * (shape.dense_ffn_dim or shape.ffn_dim))
    ckpt = sum(parts[k] for k in ("params", "grads", "optimizer", "reserved")) + 4 * biggest
    return StageMemory(parts, max(sum(parts.values()), ckpt), ckpt, block)


def _activations(c: Context, s: int, st: StageSummary) -> tuple[float, float, float]:
    """(activation bytes held at the peak, received tokens beyond the mean, the busiest EP rank's imbalance)."""
    lay, T = c.layout, c.T
    # microbatches held at the peak, in whole-stage units (an interleaved chunk-microbatch is 1/V of one)
    held = pp_facts.in_flight(lay.schedule, lay.pp, s, lay.microbatches, c.n_virt, c.lanes)
    in_flight = held / c.n_virt
    # the busiest EP rank receives more than the mean T*K assignments (docs/planner.md "Expert imbalance")
    imb = c.opts.expert_load or expert_imbalance(c.cfg, lay, c.shape, st.n_moe * in_flight,
                                                 max(1.0, lay.microbatches * c.n_virt / held), c.skew)
    recv_extra = (imb - 1) * T  # tokens' worth of received bytes beyond the mean
    act_bytes = in_flight * (T * st.act_bytes + recv_extra * st.received_bytes + st.cast_bytes)
    if not c.ac:  # the CP ring's forward keeps one received K/V block per attention layer (plan/cp.py)
        act_bytes += in_flight * st.n_attn * cp_plan.saved_bytes(c.shape, T, lay.cp, lay.tp, c.prec.act,
                                                                 c.cfg.parallel.cp_impl)
    if c.unckpt is not None and lay.pp > 1 and s > 0:  # zb1's first stage runs 1F1B: no deferred W
        # zb1 under AC: a microbatch between its B and its W keeps what the deferred weight GEMMs read
        # (model/wgrad.py), about its uncheckpointed activations; stage s holds s of them beside its checkpointed ones
        u, w_pending = c.unckpt[s], min(s, lay.microbatches)
        act_bytes += w_pending * (T * (u.act_bytes - st.act_bytes) + u.cast_bytes - st.cast_bytes
                                  + recv_extra * (u.received_bytes - st.received_bytes))
    return act_bytes, recv_extra, imb


def _zero3_always(c: Context, st: StageSummary, root: float) -> tuple[float, float, float, tuple, float]:
    """zero 3 "always" (FSDP2 reshards every module after its forward and its backward): (gathered, ag, ag_last,
    in_block, ag_head). The root's params (embedding, head) stay gathered all step, and beside them one all-gather
    result FSDP2 holds apart from the params it copies out to: in backward a block's non-expert group, prefetched
    (`ag`); at the forward's end the last module's (the last block's experts), freed when the root's forward ends
    (`ag_last`). While a block runs, its own params too, and on the last stage the head's unsharded gradient
    (reduce-scattered with the root's at the end of backward): `in_block`. Measured with `nanotitan plan --dry-run`
    (docs/plans/mixtral-8x7b-h100.md). A block kept gathered after its forward (`fsdp.kept_gathered`: without PP
    the last) holds its params and experts through the head's forward and the logits' gradient, in place of the
    non-expert group the root's backward would prefetch (`ag_head`)."""
    if not (c.zero == 3 and c.z_reshard):
        return 0.0, 0.0, 0.0, (0.0, 0.0), 0.0
    prec, lay = c.prec, c.layout
    V, D = c.shape.vocab, c.shape.d_model
    ne_block = (st.n_ne - root) / max(st.n_layers, 1)
    ex_block = st.n_ex / max(st.n_layers, 1) if fsdp.shards_experts(lay.dp) else 0.0  # dp == 1: experts not FSDP's
    gathered, ag, ag_last = root * prec.param, ne_block * prec.param, (ex_block or ne_block) * prec.param
    if fsdp.experts_in_block_unit(lay.dp, lay.ep):  # the experts in their block's FSDP unit: a block per all-gather
        ag = ag_last = (ne_block + ex_block) * prec.param
    # Under checkpointing a block's recompute runs FSDP2's forward hooks: the all-gather result copied out there is
    # kept, as in a forward, until the next forward copy-out (the next recompute), so one more is alive through
    # every block's backward: at EP 1 a whole block's (the code held 3 blocks' worth, the planner 2: +6.5% at dp64
    # m8 on Mixtral-8x7B)
    held = ag_last if c.ac else 0.0
    in_block = (ag + held + (ne_block + ex_block) * prec.param, (V * D + D) * prec.grad if st.last else 0.0)
    kept = c.kept_blocks(st) * (ne_block + ex_block) * prec.param
    return gathered, ag, ag_last + kept, in_block, kept or ag


def _zero2_shard(c: Context, st: StageSummary, n_local: float, root: float) -> tuple[float, list[tuple]]:
    """zero 2 "shard" (ShardedReducer._launch_into_shard): (what the previous microbatch left in flight, the
    backward's moments). The bucket backward fills and those whose reduce-scatter is in flight, each in flight with
    its scratch on gloo (a CPU profile: comm.py's in-place exchange receives (N-1)/N of the bucket beside it until
    it lands). At the start of a backward (the logits' gradient) only what the previous microbatch left in flight
    (M = 1: none); once `zero.IN_FLIGHT_BUCKETS` buckets are launched, the next one filling beside them, and at its
    launch one more in flight with their scratch (the oldest lands next), by when the blocks whose params those
    buckets hold have freed their activations."""
    if not (c.zero == 2 and c.z_shard):
        return 0.0, []
    prec, T, M, n = c.prec, c.T, c.layout.microbatches, zero_sharding.IN_FLIGHT_BUCKETS
    bucket_elems = dp_reducer.bucket_bytes(c.cfg.parallel.bucket_mb) / prec.grad
    scratch = (c.ne_group - 1) / c.ne_group if c.hw.cores_per_node else 0.0
    carry = min(n_local, n * bucket_elems) * (1 + scratch) * prec.grad if M > 1 else 0.0
    head = c.shape.vocab * c.shape.d_model + c.shape.d_model if st.last else 0.0  # a last stage's first gradients
    moments = []
    for k in (n, n + 1):  # k buckets launched, each with its scratch
        done = min(1.0, max(0.0, k * bucket_elems - head) / max(n_local - root, 1.0))  # blocks past
        buckets = min(n_local, (n + 1) * bucket_elems) + k * scratch * bucket_elems
        moments.append((T * (st.act_layer_max_bytes - st.head_act_bytes - done * (st.act_bytes - st.head_act_bytes))
                        + st.cast_layer_max_bytes, 0.0, buckets * prec.grad - carry))
    return carry, moments


def _transients(c: Context, st: StageSummary, recv_extra: float, imb: float, z3: list, z2_moments: list) -> list:
    """The step's transients: (bytes, gathered params beside them, unsharded gradients beside them); the largest
    sum is the stage's peak."""
    ag, ag_last, in_block, ag_head = z3
    T, prec, ac, pp, ep = c.T, c.prec, c.ac, c.layout.pp, c.layout.ep * c.layout.cp  # experts fold over CP too
    # CP's attention beside a block's backward: the ring's blocks in flight, or the all-to-all's buffers (plan/cp.py)
    cp_buffers = cp_plan.buffer_bytes(c.shape, T, c.layout.cp, c.layout.tp, prec.act, c.cfg.parallel.cp_impl)
    if ac:  # the recomputed block's forward kept its ring's first K/V block (without AC: in the activations)
        cp_buffers += cp_plan.saved_bytes(c.shape, T, c.layout.cp, c.layout.tp, prec.act, c.cfg.parallel.cp_impl)
    V, D, K = c.shape.vocab, c.shape.d_model, c.shape.top_k
    heads = 1 + c.shape.mtp_layers  # the head runs over the main positions and every MTP depth's
    return [(2 * heads * T * V * 4 if st.last else 0.0, ag_head, 0.0),  # gradients of log-softmax, logits (fp32 CE)
            *z2_moments,  # zero 2 "shard": a bucket filling beside those in flight, and its launch
            # one block's backward (and its recompute, weight copies included, under AC); the head's
            # activations are freed by then
            (T * (st.act_layer_max_bytes - st.head_act_bytes) + st.cast_layer_max_bytes
             + (recv_extra * st.received_block_bytes if ac else 0.0) + cp_buffers, *in_block),
            # an MoE block's end of backward: its experts' weight-gradient pieces beside what it still holds
            # (the head's activations and weight copy freed too, and its experts' activations: on the
            # busiest rank more than the mean's)
            (T * (st.land_bytes - st.head_act_bytes) + st.land_fixed_bytes - st.head_cast_bytes
             - (0.0 if ac else recv_extra * st.received_block_bytes) if st.n_moe else 0.0, *in_block),
            # a forward's end: autocast's cached weight copies of the checkpointed blocks, and on the last
            # stage the bf16 logits beside their fp32 copy (the log-softmax output is in the activations); under
            # TP the vocab-parallel loss (parallel/tp.py _VocabCE) also holds its shifted logits beside their exp
            (st.cast_cache_bytes + (heads * T * V * (prec.act + 4 + (4 if c.layout.tp > 1 else 0))
                                    if st.last and prec.autocast else 0.0), ag_last, 0.0),
            # all-to-all send (T*K rows) + receive (the busiest rank's)
            ((1 + imb) * T * K * D * prec.act if ep > 1 and st.n_moe else 0.0, *in_block),
            (2 * T * D * prec.act if pp > 1 else 0.0, ag, 0.0)]  # P2P gradient buffers
