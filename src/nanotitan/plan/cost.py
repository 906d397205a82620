"""The cost model: predicted peak memory of a rank of every pipeline stage and the step time of one layout.

Every formula and its assumptions are written up in docs/planner.md (§2 memory, §3 time). Shapes: V vocab,
D d_model, K top_k, E experts, S seq_len, T = m*S tokens of one microbatch on one rank.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from ..config.config import Config, tidy_counts
from ..config.hardware import Hardware, ring_allreduce_s as _ring_allreduce_s, ring_half_s as _ring_half_s
from ..parallel import pp as pp_schedules
from ..parallel.dims import ParallelDims
from ..parallel.sync import zero_memory_choices
from ..parallel.zero import _IN_FLIGHT as ZERO2_IN_FLIGHT
from .shape import PRECISIONS, Layout, ModelShape, stage_summaries


@dataclass
class PlanOptions:
    precision: str = ""  # "" = from train.dtype (fp32 or bf16-autocast)
    zero: int | None = None  # parallel.zero level(s) to plan: None = every level the layout allows (0..3)
    zero1: bool = False  # old alias of zero=1 (`nanotitan plan --zero1`)
    activation_checkpointing: bool | None = None  # None = from train.activation_checkpointing
    global_batch: int = 0  # 0 = cfg.layout_batch
    micro_batch: int = 0  # fix m (0 = free): the MoE balance loss is per microbatch, so equal m = equal maths
    nodes: int = 0  # 0 = ceil(world / hardware.devices_per_node)
    ep_overlap: float = 0.0  # fraction of all-to-all time hidden behind compute (ours: 0; DeepSeek's DualPipe: ~1)
    # An emulated network (parallel/emulate.py, docs/emulate.md): groups cross nodes of this many ranks (0 = the
    # hardware's nodes), and link time is waiting (a held call), not CPU work that time-shared cores must do
    link_node_size: int = 0
    links_idle: bool = False
    shape_extra: dict = field(default_factory=dict)  # ModelShape fields our config cannot express
    # routing skew behind the busiest EP rank's load (expert_imbalance): the CV of an expert's share of one
    # microbatch's assignments; None = EXPERT_SKEW, 0 = a perfectly balanced router (what the dry run routes)
    expert_skew: float | None = None


@dataclass
class Prediction:
    layout: Layout
    step_time_s: float
    tokens_per_sec: float
    mem_by_stage: list[float]  # predicted peak bytes of a rank of each pipeline stage
    mem_limit: float
    fits: bool
    costs: dict[str, float]  # seconds per step on the critical path, by cause
    mem_parts_by_stage: list[dict[str, float]]  # bytes by cause, per stage
    ckpt_by_stage: list[float] = field(default_factory=list)  # peak bytes while saving or loading a checkpoint

    @property
    def state_bytes(self) -> dict[str, float]:
        """Predicted live param/grad/optimizer bytes of a rank of the heaviest stage between steps: what
        `metrics.live_tensor_bytes` measures (`param_bytes`, `grad_bytes`, `optim_bytes` in summary.json)."""
        parts = self.mem_parts
        return {"param_bytes": parts["params"], "grad_bytes": parts["grads"], "optim_bytes": parts["optimizer"]}

    @property
    def peak_mem(self) -> float:
        return max(self.mem_by_stage)

    @property
    def mem_parts(self) -> dict[str, float]:
        """Bytes by cause of the heaviest stage."""
        return self.mem_parts_by_stage[self.mem_by_stage.index(self.peak_mem)]

    @property
    def dominant(self) -> str:
        name = max(self.costs, key=self.costs.get)
        return f"{name} {100 * self.costs[name] / self.step_time_s:.0f}%"


# --- where groups sit ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)  # pure, and called for every prediction of a calibration fit
def _placement(layout: Layout, kind: str, per_node: int) -> tuple[bool, float]:
    """(crosses nodes, fraction of a member's peers on other nodes) for the worst group of `kind`
    at stage 0 of replica 0 and of the last replica/stage (ranks fill nodes in order)."""
    worst = (False, 0.0)
    for rank in (0, layout.dp * layout.pp * layout.ep - 1):
        ranks = ParallelDims(layout.dp, layout.pp, layout.ep, rank).group_ranks(kind)
        if len(ranks) < 2:
            continue
        nodes = [r // per_node for r in ranks]
        off = max(sum(n != me for n in nodes) / (len(ranks) - 1) for me in set(nodes))
        worst = max(worst, (len(set(nodes)) > 1, off))
    return worst


# --- cost model ----------------------------------------------------------------------------------
# zb1's split backward (B with the weight GEMMs deferred into a WeightGradStore, then W running them: the same
# kernels as one backward, model/wgrad.py) costs this much more than one backward: measured -2..+1% of the MID
# stage's backward, i.e. nothing beyond noise (docs/pp.md; the autograd-walk split it replaced cost ~9%).
ZB1_SPLIT_COST = 0.0


def balanced_layer_counts(cfg: Config, n_chunks: int, hw: Hardware,
                          activation_checkpointing: bool | None = None) -> list[float]:
    """Layers per pipeline chunk (pp * virtual stages of them) minimising the slowest chunk's time per
    microbatch, as this cost model times a stage: each layer's dense and expert GEMM FLOPs at the hardware's
    efficiency for their row counts, forward + 2x backward (+ recompute under AC), plus the per-layer overhead;
    the first chunk also pays for the embedding (its per-layer overhead), the last for the final norm, head
    and cross-entropy. Cuts may fall between a block's attention and its FFN (counts in multiples of 0.5,
    model/spec.py): the units are half-blocks, each chunk gets at least one, and on a tie a whole-layer cut
    wins. A pure function of the config and `hw`, so every rank computes the same split (resolve.py passes
    the built-in profile of the job's device kind)."""
    ac = cfg.train.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
    shape = ModelShape.from_config(cfg)
    T = cfg.train.micro_batch * shape.seq_len
    e_local = max(1, shape.num_experts // cfg.parallel.ep)
    peak = hw.peak_flops("bf16" if cfg.train.dtype == "bf16" else "fp32")
    eff_dense, eff_expert = _gemm_eff(hw, T), _gemm_eff(hw, T * shape.top_k / e_local)
    passes = 4 if ac else 3

    def seconds(f_dense: float, f_expert: float) -> float:  # one half-block: half the per-layer overhead
        return passes * T * (f_dense / (peak * eff_dense) + f_expert / (peak * eff_expert)) + hw.layer_overhead_s / 2

    halves = []  # unit 2i: block i's attention, 2i+1: its FFN
    for i in range(shape.n_layers):
        f_dense, f_expert = shape.layer_fwd_flops(i)
        f_attn = shape.attn_part(i)["f_dense"]
        halves += [seconds(f_attn, 0.0), seconds(f_dense - f_attn, f_expert)]
    embed = hw.layer_overhead_s
    head = seconds(2 * shape.d_model * shape.vocab, 0.0) + hw.layer_overhead_s / 2
    n, K = len(halves), n_chunks
    prefix = [0.0]
    for t in halves:
        prefix.append(prefix[-1] + t)

    def chunk_cost(c: int, lo: int, hi: int) -> float:
        return prefix[hi] - prefix[lo] + (embed if c == 0 else 0.0) + (head if c == K - 1 else 0.0)

    # best[c][i]: the least possible slowest chunk when chunks 0..c hold units [0, i); cut[c][i] its last start.
    INF = float("inf")
    best = [[INF] * (n + 1) for _ in range(K)]
    cut = [[0] * (n + 1) for _ in range(K)]
    for i in range(1, n + 1):
        best[0][i] = chunk_cost(0, 0, i)
    for c in range(1, K):
        for i in range(c + 1, n + 1):
            for j in sorted(range(c, i), key=lambda j: j % 2):  # whole-layer cuts first: they win ties
                v = max(best[c - 1][j], chunk_cost(c, j, i))
                if v < best[c][i] * (1 - 1e-9):
                    best[c][i], cut[c][i] = v, j
    counts, i = [], n
    for c in range(K - 1, 0, -1):
        j = cut[c][i]
        counts.append((i - j) / 2)
        i = j
    counts.append(i / 2)
    return tidy_counts(counts[::-1])


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
    ep, E, K = layout.ep, shape.num_experts, shape.top_k
    if ep == 1:
        return 1.0
    L, T = E // ep, layout.micro_batch * shape.seq_len
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


def zero_level(layout: Layout, opts: PlanOptions) -> int:
    """The layout's zero level; a zero-0 layout under PlanOptions(zero=Z) or the old zero1=True predicts at Z."""
    return layout.zero or (opts.zero if opts.zero is not None else (1 if opts.zero1 else 0))


def _gemm_eff(hw: Hardware, rows: float) -> float:
    return hw.compute_efficiency * rows / (rows + hw.gemm_half_rows)


def ep_overlap_exposed(a2a_s: float, lat_s: float, n: int, compute_s: float, tail_s: float = 0.0) -> float:
    """Exposed link time of one pass (forward or backward) of one MoE layer under parallel.ep_overlap: the trip
    (`a2a_s` of bytes each way, `lat_s` per call) in n groups, all outbound trips posted first and each group's
    return posted when its experts are done (`compute_s` in all), one link carrying one call at a time. The link
    carries 2n calls (2(a2a + n lat)), of which compute can cover what it lasts; the first trip out is always
    exposed, and the last return too, less `tail_s` of work that runs while it travels (backward: the last
    group's weight GEMMs). Without overlap: 2(a2a + lat)."""
    one = a2a_s / n + lat_s
    return max(2 * (a2a_s + n * lat_s) - compute_s, one + max(0.0, one - tail_s))


# parallel.ep_overlap_microbatches where a rank's two lanes share its cores (a CPU profile: every rank one thread
# per lane on its share of the node's cores): the part of a pair's link time left exposed anyway, because each trip
# completes only when the peer rank's same lane arrives, and that lane is late by whatever its other lane took of
# the core. Measured (docs/ep.md "Where the exposed wait goes"): PP1·EP2 M=8 emulated h800:1, commit f9eab7e,
# load 4-7: lanes ÷ off exposed EP wait 0.156 / 0.191 (min / median), step 0.818 / 0.868; 0.1 puts the model at
# 0.202 and 0.789. 0 on accelerator profiles (each lane its own stream; not measured).
LANES_SHARED_SKEW = 0.1


def ep_lanes_time(c_f: float, c_b: float, w_f: float, w_b: float, M: int, unpaired: int = 1, c_w: float = 0.0,
                  skew: float = 0.0) -> float:
    """Forwards and backwards of M microbatches on one stage under parallel.ep_overlap_microbatches (parallel/pp.py
    `_two_lanes`): `unpaired` forwards alone, M - unpaired pairs (a forward beside a backward), `unpaired` backwards
    alone. pp = 1 and a pipeline's last stage: 1 (F(0) alone, F(j+1) beside B(j), B(M-1) alone); an earlier 1f1b /
    zb1 stage: its warmup w (the warmup's forwards and the cooldown's backwards, F(w+j) beside B(j) between).
    c_f, c_b: a microbatch's forward and backward compute; w_f, w_b: their EP link time (one link, carrying one
    call at a time). c_w: the part of c_b that is weight-gradient GEMMs the backward lane runs while its own trips
    travel (pp.py `_StageRunner.backward`'s fill; on zb1's split stages the W due after it), so a backward
    alone exposes only max(w_b - c_w, 0). A lane cannot compute while it waits for its own trip, the two lanes share
    the rank's compute, and the link carries both lanes' trips, so a pair lasts at least each of max(c_f + c_b,
    w_f + w_b, c_f + w_f, c_b + max(w_b - c_w, 0)); the model takes that bound (the lanes interleave layer by
    layer, so the pieces pack finely), plus `skew` of the link time (LANES_SHARED_SKEW where the lanes share a
    CPU's cores: a trip waits for the peer's lane). With c_w = skew = 0, the model before the fill."""
    unpaired = min(max(unpaired, 1), M)
    b_own = c_b + max(w_b - c_w, 0.0)
    pair = max(c_f + c_b, w_f + w_b, c_f + w_f, b_own) + skew * (w_f + w_b)
    return unpaired * ((c_f + w_f) + b_own + skew * (w_f + w_b)) + (M - unpaired) * pair


def predict(cfg: Config, layout: Layout, hw: Hardware, opts: PlanOptions | None = None,
            shape: ModelShape | None = None) -> Prediction:
    """Predict per-rank peak memory of every stage and the step time of `layout` (docs/planner.md)."""
    opts = opts or PlanOptions()
    shape = shape or ModelShape.from_config(cfg, **opts.shape_extra)
    prec = PRECISIONS[opts.precision or ("bf16-autocast" if cfg.train.dtype == "bf16" else "fp32")]
    ac = cfg.train.activation_checkpointing if opts.activation_checkpointing is None else opts.activation_checkpointing
    dp, pp, ep, M, m = layout.dp, layout.pp, layout.ep, layout.microbatches, layout.micro_batch
    world = dp * pp * ep
    nodes = opts.nodes or math.ceil(world / hw.devices_per_node)
    per_node = math.ceil(world / nodes)
    ranks_on_node = min(world, per_node)
    D, S, V, K, E = shape.d_model, shape.seq_len, shape.vocab, shape.top_k, shape.num_experts
    T = m * S  # tokens of one microbatch on one rank
    e_local = E // ep
    peak = hw.peak_flops("bf16" if prec.act == 2 else "fp32", ranks_on_node)
    eff_dense, eff_expert = _gemm_eff(hw, T), _gemm_eff(hw, T * K / max(e_local, 1))  # expert GEMM rows grow with EP

    def link(kind):
        crosses, off = _placement(layout, kind, opts.link_node_size or per_node)
        return (hw.inter if crosses else hw.intra), off

    ep_link, ep_off = link("ep")
    pp_link, _ = link("pp")
    ne_link, _ = link("non_expert_dp")
    ex_link, _ = link("expert_dp")

    n_virt = pp_schedules.virtual_stages(layout.schedule, pp, cfg.parallel.virtual_stages)
    lanes = cfg.parallel.ep_overlap_microbatches and ep > 1 and M > 1  # two lanes (pp.py), any schedule
    counts = cfg.parallel.pp_layers
    if counts == "auto":
        counts = balanced_layer_counts(cfg, pp * n_virt, hw, ac)
    # parallel.ep_overlap runs the experts in groups (_ExpertTrip), with their own weight-gradient landing
    trips = bool(cfg.parallel.ep_overlap) and ep > 1 and min(cfg.parallel.ep_chunks, e_local) > 1
    stages = stage_summaries(shape, layout, counts, ac, n_virt, prec, trips)
    # zb1 under AC: a microbatch between its B and its W keeps what the deferred weight GEMMs read (model/wgrad.py),
    # about its uncheckpointed activations; stage s holds s of them (its deferred W's) beside its checkpointed ones.
    unckpt = stage_summaries(shape, layout, counts, False, n_virt, prec) if ac and layout.schedule == "zb1" else None

    # Memory of a rank of each stage. Sharded DP (docs/dp.md): replicated params shard over the non-expert-DP
    # group (dp*ep ranks), expert shards over expert-DP (dp ranks); padding (< 16*N elements a bucket) ignored.
    zero = zero_level(layout, opts)
    skew = EXPERT_SKEW if opts.expert_skew is None else opts.expert_skew
    z_accumulate, z_reshard = zero_memory_choices(zero, pp, layout.schedule, cfg.parallel.zero_accumulate,
                                                  cfg.parallel.zero3_reshard)
    z_shard, z_reshard = z_accumulate == "shard", z_reshard == "always"
    bucket_elems = cfg.parallel.bucket_mb * 2**20 / prec.grad
    ne_group, ex_group = dp * ep, dp
    mem_by_stage, parts_by_stage, ckpt_by_stage = [], [], []
    block_by_stage = []  # a block's params (experts included) per stage, for the zero-3 all-gather count below
    for s, st in enumerate(stages):
        n_local = st.n_ne + st.n_ex
        n_shard = st.n_ne / ne_group + st.n_ex / ex_group
        n_fsdp = st.n_ne + (st.n_ex if ex_group > 1 else 0)  # zero 3: what FSDP shards (dp == 1: not the experts)
        opt_params = n_shard if zero >= 1 else n_local
        # microbatches held at the peak, in whole-stage units (an interleaved chunk-microbatch is 1/V of one)
        held = pp_schedules.in_flight(layout.schedule, pp, s, M, n_virt, lanes)
        in_flight = held / n_virt
        # the busiest EP rank receives more than the mean T*K assignments (docs/planner.md "Expert imbalance")
        imb = expert_imbalance(cfg, layout, shape, st.n_moe * in_flight, max(1.0, M * n_virt / held), skew)
        recv_extra = (imb - 1) * T  # tokens' worth of received bytes beyond the mean
        act_bytes = in_flight * (T * st.act_bytes + recv_extra * st.received_bytes + st.cast_bytes)
        if unckpt is not None and pp > 1 and s > 0:  # zb1's first stage runs 1F1B: no deferred W
            w_pending = min(s, M)
            act_bytes += w_pending * (T * (unckpt[s].act_bytes - st.act_bytes) + unckpt[s].cast_bytes - st.cast_bytes
                                      + recv_extra * (unckpt[s].received_bytes - st.received_bytes))
        # Between steps a rank keeps params/grads/optimizer. During a step (docs/dp.md "Peak memory"): zero 2
        # "full" holds every full gradient bucket from the first backward to finish(), "shard" at most the buckets
        # in flight plus the one backward fills; zero 3 "never" the gathered params from the first forward to the
        # final backward, "always" those of the moment (below); zero 3 "full" accumulates unsharded gradients over
        # the microbatches (M = 1: one module's at a time).
        grad_params = n_shard if zero >= 2 else n_local
        root = (V * D if st.first else 0) + (V * D + D if st.last else 0)
        block = (n_local - root) / max(st.n_layers, 1)
        block_by_stage.append(block)
        # zero 3 "always" (FSDP2 reshards every module after its forward and its backward): the root's params
        # (embedding, head) stay gathered all step, and beside them one all-gather result FSDP2 holds apart from
        # the params it copies out to: in backward a block's non-expert group, prefetched; at the forward's end
        # the last module's (the last block's experts), freed when the root's forward ends. While a block runs,
        # its own params too, and on the last stage the head's unsharded gradient (reduce-scattered with the
        # root's at the end of backward). Measured with `nanotitan plan --dry-run` (docs/plans/mixtral-8x7b-h100.md).
        # Without PP the last block is not resharded after its forward (fsdp.apply_fsdp, torchtitan's default): its
        # params and experts stay gathered through the head's forward and the logits' gradient, in place of the
        # non-expert group the root's backward would prefetch.
        gathered, ag, ag_last, in_block, ag_head = 0.0, 0.0, 0.0, (0.0, 0.0), 0.0
        if zero == 3 and z_reshard:
            ne_block = (st.n_ne - root) / max(st.n_layers, 1)
            ex_block = st.n_ex / max(st.n_layers, 1) if ex_group > 1 else 0.0  # dp == 1: experts not FSDP's
            gathered, ag, ag_last = root * prec.param, ne_block * prec.param, (ex_block or ne_block) * prec.param
            if ep == 1:  # the experts in their block's FSDP unit (fsdp.apply_fsdp): a whole block per all-gather
                ag = ag_last = (ne_block + ex_block) * prec.param
            in_block = (ag + (ne_block + ex_block) * prec.param, (V * D + D) * prec.grad if st.last else 0.0)
            kept = (ne_block + ex_block) * prec.param if pp == 1 else 0.0
            ag_head, ag_last = kept or ag, ag_last + kept
        # zero 2 "shard" (ShardedReducer._launch_into_shard): the bucket backward fills and those whose reduce-scatter
        # is in flight, each in flight with its scratch on gloo (a CPU profile: comm.py's in-place exchange receives
        # (N-1)/N of the bucket beside it until it lands). At the start of a backward (the logits' gradient) only
        # what the previous microbatch left in flight (M = 1: none); once _IN_FLIGHT buckets are launched, the next
        # one filling beside them, and at its launch _IN_FLIGHT + 1 in flight with their scratch (the oldest lands
        # next), by when the blocks whose params those buckets hold have freed their activations.
        z2_carry, z2_moments = 0.0, []
        if zero == 2 and z_shard:
            scratch = (ne_group - 1) / ne_group if hw.cores_per_node else 0.0
            z2_carry = min(n_local, ZERO2_IN_FLIGHT * bucket_elems) * (1 + scratch) * prec.grad if M > 1 else 0.0
            head = V * D + D if st.last else 0.0  # the first gradients of a last stage's backward
            for k in (ZERO2_IN_FLIGHT, ZERO2_IN_FLIGHT + 1):  # k buckets launched, each with its scratch
                done = min(1.0, max(0.0, k * bucket_elems - head) / max(n_local - root, 1.0))  # blocks past
                buckets = min(n_local, (ZERO2_IN_FLIGHT + 1) * bucket_elems) + k * scratch * bucket_elems
                z2_moments.append((T * (st.act_layer_max_bytes - st.head_act_bytes
                                        - done * (st.act_bytes - st.head_act_bytes)) + st.cast_layer_max_bytes,
                                   0.0, buckets * prec.grad - z2_carry))
        # the largest transient: (bytes, gathered params beside it, unsharded gradients beside it)
        transient = [(2 * T * V * 4 if st.last else 0.0, ag_head, 0.0),  # gradients of log-softmax, logits (fp32 CE)
                     *z2_moments,  # zero 2 "shard": a bucket filling beside those in flight, and its launch
                     # one block's backward (and its recompute, weight copies included, under AC); the head's
                     # activations are freed by then
                     (T * (st.act_layer_max_bytes - st.head_act_bytes) + st.cast_layer_max_bytes
                      + (recv_extra * st.received_block_bytes if ac else 0.0), *in_block),
                     # an MoE block's end of backward: its experts' weight-gradient pieces beside what it still holds
                     # (the head's activations and weight copy freed too, and its experts' activations: on the
                     # busiest rank more than the mean's)
                     (T * (st.land_bytes - st.head_act_bytes) + st.land_fixed_bytes - st.head_cast_bytes
                      - (0.0 if ac else recv_extra * st.received_block_bytes) if st.n_moe else 0.0, *in_block),
                     # a forward's end: autocast's cached weight copies of the checkpointed blocks, and on the last
                     # stage the bf16 logits beside their fp32 copy (the log-softmax output is in the activations)
                     (st.cast_cache_bytes + (T * V * (prec.act + 4) if st.last and prec.autocast else 0.0),
                      ag_last, 0.0),
                     # all-to-all send (T*K rows) + receive (the busiest rank's)
                     ((1 + imb) * T * K * D * prec.act if ep > 1 and st.n_moe else 0.0, *in_block),
                     (2 * T * D * prec.act if pp > 1 else 0.0, ag, 0.0)]  # P2P gradient buffers
        buffers, block_params, block_grads = max(transient, key=sum)
        parts = {"params": (n_shard if zero == 3 else n_local) * prec.param,
                 "grads": grad_params * prec.grad,
                 "optimizer": opt_params * (prec.master + prec.moments),
                 "grad_buckets": z2_carry + (0.0 if zero == 2 and z_shard
                                             else n_local if zero == 2 or (zero == 3 and M > 1 and not z_shard)
                                             else block if zero == 3 and not z_reshard else 0.0) * prec.grad
                                 + block_grads,
                 "gathered_params": (n_fsdp * prec.param if zero == 3 and not z_reshard else gathered + block_params),
                 "activations": act_bytes, "buffers": buffers,
                 "reserved": hw.mem_reserved_bytes}
        # Saving or loading a checkpoint (docs/dp.md "Checkpoints"): the state between steps plus one tensor in
        # flight (a box copied as DCP writes it, or a stored chunk read before its overlap is copied into the live
        # state), at most the largest tensor, in fp32 (AdamW's moments are stored fp32 whatever the params).
        biggest = max(V * D, D * shape.ffn_dim, D * (shape.dense_ffn_dim or shape.ffn_dim))
        ckpt = sum(parts[k] for k in ("params", "grads", "optimizer", "reserved")) + 4 * biggest
        mem_by_stage.append(max(sum(parts.values()), ckpt))
        parts_by_stage.append(parts)
        ckpt_by_stage.append(ckpt)

    # Time of one microbatch (forward + backward) on each stage, on a rank that has its cores to itself.
    t_stage, t_bwd, t_fwd, t_links = [], [], [], []
    for s, st in enumerate(stages):
        t_f = T * (st.f_dense / (peak * eff_dense) + st.f_expert / (peak * eff_expert))
        t_b = 2 * t_f + (t_f if ac else 0.0)  # backward = 2x forward, plus the recompute
        if layout.schedule == "zb1" and pp > 1 and s > 0:  # zb1's first stage runs 1F1B (parallel/pp.py)
            t_b *= 1 + ZB1_SPLIT_COST  # (under AC, B's recompute is the only one: W runs GEMMs on what B kept)
        # What one rank sends per all-to-all: its T*K assignments minus those staying local, split
        # between peers on its node and peers elsewhere; the slower of the two paths bounds it.
        a2a_bytes = T * K * D * prec.act * (ep - 1) / ep
        a2a_one = max(a2a_bytes * (1 - ep_off) / hw.intra.a2a_bw, a2a_bytes * ep_off / hw.inter.a2a_bw)
        # 4 payload all-to-alls per MoE layer (dispatch/combine, fwd/bwd) + 1 count exchange, each a call.
        lat = (ep - 1) * ep_link.latency_s
        a2a_link = st.n_moe * (4 * a2a_one + 5 * lat) if ep > 1 else 0.0
        calls = 5
        n_ch = min(cfg.parallel.ep_chunks, e_local) if cfg.parallel.ep_overlap and ep > 1 else 1
        if n_ch > 1 and st.n_moe:  # parallel.ep_overlap: only the exposed part of the chunked trips
            t_x = T * st.f_expert / (peak * eff_expert) / st.n_moe  # one layer's expert forward
            deferred = layout.schedule == "zb1" and pp > 1 and s > 0  # zb1's B: weight GEMMs wait for W
            a2a_link = st.n_moe * (lat + ep_overlap_exposed(a2a_one, lat, n_ch, t_x)
                                   + ep_overlap_exposed(a2a_one, lat, n_ch, (1 if deferred else 2) * t_x,
                                                        0.0 if deferred else t_x / n_ch))
            calls = 1 + 4 * n_ch
        if lanes and st.n_moe:
            # two lanes: a forward's trips hidden behind another microbatch's backward and the reverse. The
            # forward's share of the link time: its dispatch and combine plus the count exchange (3 calls of 5).
            # Where the link is a CPU's own work (gloo without an emulator), nothing hides behind compute.
            w_f = a2a_link * (2 * a2a_one + 3 * lat) / (4 * a2a_one + 5 * lat)
            if opts.links_idle or not hw.cores_per_node:
                # the warmup's forwards (in whole-stage units) run alone: 0 (pp = 1, 1F1B's last stage) is F(0) and
                # B(M-1); gpipe's M: no forward beside a backward, only the fill hides the backwards' trips
                unpaired = pp_schedules.warmup(layout.schedule, pp, s, M, n_virt) / n_virt
                # what runs while a backward's own trips travel: its weight-gradient GEMMs, about one forward's; on
                # zb1's split stages the W due after it (none for the first s backwards), as much again
                split = layout.schedule == "zb1" and pp > 1 and s > 0
                c_w = t_f * max(M - s, 0) / M if split else t_f
                a2a_link = ep_lanes_time(t_f, t_b, w_f, a2a_link - w_f, M, unpaired, c_w,
                                         LANES_SHARED_SKEW if hw.cores_per_node else 0.0) / M - (t_f + t_b)
        a2a = a2a_link + (st.n_moe * calls * hw.a2a_call_s if ep > 1 else 0.0)
        # P2P per microbatch; interleaved: a microbatch enters and leaves each rank V times (2V-1 at the ends)
        sends = ((0 if st.last else 1) + (0 if st.first else 1)) if n_virt == 1 else 2 * n_virt - 1
        p2p_link = sends * (T * D * prec.act / pp_link.p2p_bw + pp_link.latency_s)
        p2p = p2p_link + sends * 2 * hw.p2p_call_s  # a send and its recv each cost a call
        t_links.append(dict(ep_a2a=a2a_link, pp_p2p=p2p_link) if opts.links_idle else {})
        over = st.n_layers * hw.layer_overhead_s
        a2a -= min(opts.ep_overlap * a2a, t_f + t_b)  # what an overlapping schedule hides, at most the compute
        t_stage.append(dict(compute=t_f + t_b, ep_a2a=a2a, pp_p2p=p2p, overhead=over))
        t_bwd.append(t_b)
        t_fwd.append(t_f)
    totals = [sum(x.values()) for x in t_stage]
    slow = max(range(pp), key=totals.__getitem__)
    # Fill + drain through every other stage, M at the slowest. Interleaved fills and drains in chunks (1/V of
    # a stage); zb1's fill/drain slot is F+B-W of a stage, 1/3 of F+B+W with backward = 2x forward, B = W.
    drain = {"interleaved": 1 / n_virt, "zb1": 1 / 3}.get(layout.schedule, 1.0) if pp > 1 else 1.0
    t_pipe = M * totals[slow] + drain * (sum(totals) - totals[slow])

    # DP gradient sync (zero 0: all-reduce; zero >= 1: reduce-scatter): overlaps the last microbatch's backward
    # (dp_overlap of it), and stage s finishes that backward s stage-backwards before stage 0 does, so it has
    # that much idle slack too. Zero 1/2 then all-gather the updated params, waited at the end of the step
    # (exposed); zero 3 all-gathers each module's params once at the step's first forward (prefetched: hidden
    # behind dp_overlap of that forward), or with zero3_reshard "always" around each forward and backward.
    exposed_dp, t_opt, t_ar_by_stage, t_opt_by_stage = 0.0, 0.0, [], []
    mean_bwd = sum(t_bwd) / pp
    red = 2 if cfg.parallel.reduce_dtype == "bf16" else prec.grad  # bytes per gradient on the DP wire
    # A reduce-scatter or all-gather is half a ring all-reduce: NCCL's own, and on gloo (a CPU profile) ZeRO's direct
    # send/recv exchanges (comm.reduce_scatter / all_gather on comm.SHARDED_BY_EXCHANGE), which move a ring's bytes.
    half = _ring_half_s
    sync = half if zero else _ring_allreduce_s
    for s, st in enumerate(stages):
        t_ar = (sync(st.n_ne * red, ne_group, ne_link.allreduce_bw, ne_link.latency_s)
                + sync(st.n_ex * red, ex_group, ex_link.allreduce_bw, ex_link.latency_s))
        t_ag = 0.0 if not zero else (half(st.n_ne * prec.param, ne_group, ne_link.allreduce_bw, ne_link.latency_s)
                                     + half(st.n_ex * prec.param, ex_group, ex_link.allreduce_bw, ex_link.latency_s))
        # "shard" (zero 2/3) reduce-scatters every microbatch, each behind its own backward; zero 3 "always"
        # all-gathers each module around every microbatch's forward and backward (2M), prefetched behind them,
        # but without PP the last block only before its forward (M: kept for its backward, fsdp.apply_fsdp)
        n_rs = M if zero >= 2 and z_shard else 1
        n_ag = 2 * M if zero == 3 and z_reshard else 1
        if n_ag > 1 and pp == 1:
            n_ag -= M * block_by_stage[s] / max(st.n_ne + st.n_ex, 1)
        t_rs_each = t_ar
        ag_exposed = (max(0.0, n_ag * t_ag - hw.dp_overlap * (t_fwd[s] + (t_bwd[s] if n_ag > 1 else 0.0))
                          * (M if n_ag > 1 else 1)) if zero == 3 else t_ag)
        exposed_dp = max(exposed_dp, (n_rs - 1) * max(0.0, t_rs_each - hw.dp_overlap * t_bwd[s])
                         + max(0.0, t_rs_each - hw.dp_overlap * t_bwd[s] - s * mean_bwd) + ag_exposed)
        t_ar = n_rs * t_rs_each + n_ag * t_ag
        n_opt = (st.n_ne / ne_group + st.n_ex / ex_group) if zero else st.n_ne + st.n_ex
        # AdamW reads param, grad, master, moments and writes param, master, moments.
        t_opt_by_stage.append(n_opt * (2 * prec.param + prec.grad + 2 * prec.master + 2 * prec.moments) / hw.mem_bw)
        t_opt = max(t_opt, t_opt_by_stage[-1])
        t_ar_by_stage.append(t_ar)

    costs = {k: M * v for k, v in t_stage[slow].items()}
    costs["bubble"] = t_pipe - M * totals[slow]
    costs["overhead"] += hw.step_overhead_s
    costs["dp_allreduce"] = exposed_dp
    costs["optimizer"] = t_opt
    step = t_pipe + exposed_dp + t_opt + hw.step_overhead_s

    # Every rank's CPU-seconds by cause (dp*ep ranks run each stage, each its M microbatches and its step):
    # where ranks time-share a CPU node's cores, this work / the cores bounds the step too (Hardware.time_shared).
    work = {k: 0.0 for k in ("compute", "ep_a2a", "pp_p2p", "overhead", "dp_allreduce", "optimizer")}
    for s in range(pp):
        for k, v in t_stage[s].items():
            work[k] += dp * ep * M * max(0.0, v - t_links[s].get(k, 0.0))  # an emulated link's hold is no work
        work["overhead"] += dp * ep * hw.step_overhead_s
        work["dp_allreduce"] += 0.0 if opts.links_idle else dp * ep * t_ar_by_stage[s]
        work["optimizer"] += dp * ep * t_opt_by_stage[s]
    step, costs = hw.time_shared(step, costs, work, nodes, ranks_on_node)
    B = dp * ep * M * m
    limit = hw.mem_per_rank(ranks_on_node)
    return Prediction(layout, step, B * S / step, mem_by_stage, limit, max(mem_by_stage) <= limit, costs,
                      parts_by_stage, ckpt_by_stage)
