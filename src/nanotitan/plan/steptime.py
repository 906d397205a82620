"""The time model: the step time of one layout, by cause on the critical path (docs/planner.md §3), and the
pipeline split that balances it (`balanced_layer_counts`).

Shapes: V vocab, D d_model, K top_k, E experts, S seq_len, T = m*S tokens of one microbatch on one rank.
"""

from __future__ import annotations

import functools
import math

from ..config.config import Config
from ..config.parse import tidy_counts
from ..config.hardware import Hardware, ring_allreduce_s, ring_half_s
from ..parallel.pp import facts as pp_facts
from . import cp as cp_plan, fp8 as fp8_plan, tp as tp_plan
from .context import Context
from .shape import ModelShape, StageSummary, mtp_seconds
from .skew import group_node_crossings, time_imbalance

# zb1's split backward (B with the weight GEMMs deferred into a WeightGradStore, then W running them: the same
# kernels as one backward, model/wgrad.py) costs this much more than one backward: measured -2..+1% of the MID
# stage's backward, i.e. nothing beyond noise (docs/pp.md; the autograd-walk split it replaced cost ~9%).
ZB1_SPLIT_COST = 0.0

# parallel.ep_overlap_microbatches where a rank's two lanes share its cores (a CPU profile: every rank one thread
# per lane on its share of the node's cores): the part of a pair's link time left exposed anyway, because each trip
# completes only when the peer rank's same lane arrives, and that lane is late by whatever its other lane took of
# the core. Measured (docs/ep.md "Where the exposed wait goes"): PP1·EP2 M=8 emulated h800:1, commit f9eab7e,
# load 4-7: lanes ÷ off exposed EP wait 0.156 / 0.191 (min / median), step 0.818 / 0.868; 0.1 puts the model at
# 0.202 and 0.789. 0 on accelerator profiles (each lane its own stream; not measured).
LANES_SHARED_SKEW = 0.1


def gemm_eff(hw: Hardware, rows: float) -> float:
    """The hardware's GEMM efficiency at `rows` rows (half of compute_efficiency at gemm_half_rows)."""
    return hw.compute_efficiency * rows / (rows + hw.gemm_half_rows)


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
    eff_dense, eff_expert = gemm_eff(hw, T), gemm_eff(hw, T * shape.top_k / e_local)
    return list(_split(shape, n_chunks, T, peak, eff_dense, eff_expert, 4 if ac else 3, hw.layer_overhead_s))


@functools.lru_cache(maxsize=256)  # a search asks it once per layout, with a handful of distinct arguments
def _split(shape: ModelShape, n_chunks: int, T: int, peak: float, eff_dense: float, eff_expert: float, passes: int,
           layer_overhead_s: float) -> tuple[float, ...]:
    """balanced_layer_counts' dynamic programme, on the numbers it reads."""

    def seconds(f_dense: float, f_expert: float) -> float:  # one half-block: half the per-layer overhead
        return passes * T * (f_dense / (peak * eff_dense) + f_expert / (peak * eff_expert)) + layer_overhead_s / 2

    halves = []  # unit 2i: block i's attention, 2i+1: its FFN
    for i in range(shape.n_layers):
        f_dense, f_expert = shape.layer_fwd_flops(i)
        f_attn = shape.attn_part(i)["f_dense"]
        halves += [seconds(f_attn, 0.0), seconds(f_dense - f_attn, f_expert)]
    embed = layer_overhead_s
    head = seconds(2 * shape.d_model * shape.vocab, 0.0) + layer_overhead_s / 2
    head += mtp_seconds(shape, seconds)  # the MTP depths run on the last chunk
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
    return tuple(tidy_counts(counts[::-1]))


def ep_overlap_exposed(a2a_s: float, lat_s: float, n: int, compute_s: float, tail_s: float = 0.0) -> float:
    """Exposed link time of one pass (forward or backward) of one MoE layer under parallel.ep_overlap: the trip
    (`a2a_s` of bytes each way, `lat_s` per call) in n groups, all outbound trips posted first and each group's
    return posted when its experts are done (`compute_s` in all), one link carrying one call at a time. The link
    carries 2n calls (2(a2a + n lat)), of which compute can cover what it lasts; the first trip out is always
    exposed, and the last return too, less `tail_s` of work that runs while it travels (backward: the last
    group's weight GEMMs). Without overlap: 2(a2a + lat)."""
    one = a2a_s / n + lat_s
    return max(2 * (a2a_s + n * lat_s) - compute_s, one + max(0.0, one - tail_s))


def ep_lanes_time(c_f: float, c_b: float, w_f: float, w_b: float, M: int, unpaired: int = 1, c_w: float = 0.0,
                  skew: float = 0.0) -> float:
    """Forwards and backwards of M microbatches on one stage under parallel.ep_overlap_microbatches
    (parallel/pp/schedules.py `lanes.two_lanes`): `unpaired` forwards alone, M - unpaired pairs (a forward beside a
    backward), `unpaired` backwards alone. pp = 1 and a pipeline's last stage: 1 (F(0) alone, F(j+1) beside B(j), B(M-1)
    alone); an earlier 1f1b / zb1 stage: its warmup w (the warmup's forwards and the cooldown's backwards, F(w+j) beside
    B(j) between). c_f, c_b: a microbatch's forward and backward compute; w_f, w_b: their EP link time (one link,
    carrying one call at a time). c_w: the part of c_b that is weight-gradient GEMMs the backward lane runs while its
    own trips travel (pp/runner.py `FillRunner`'s fill; on zb1's split stages the W due after it), so a backward
    alone exposes only max(w_b - c_w, 0). A lane cannot compute while it waits for its own trip, the two lanes share
    the rank's compute, and the link carries both lanes' trips, so a pair lasts at least each of max(c_f + c_b,
    w_f + w_b, c_f + w_f, c_b + max(w_b - c_w, 0)); the model takes that bound (the lanes interleave layer by
    layer, so the pieces pack finely), plus `skew` of the link time (LANES_SHARED_SKEW where the lanes share a
    CPU's cores: a trip waits for the peer's lane). With c_w = skew = 0, the model before the fill."""
    unpaired = min(max(unpaired, 1), M)
    b_own = c_b + max(w_b - c_w, 0.0)
    pair = max(c_f + c_b, w_f + w_b, c_f + w_f, b_own) + skew * (w_f + w_b)
    return unpaired * ((c_f + w_f) + b_own + skew * (w_f + w_b)) + (M - unpaired) * pair


def step_time(c: Context, block_by_stage: list[float]) -> tuple[float, dict[str, float]]:
    """(step seconds, seconds per step on the critical path by cause) of the layout; `block_by_stage`: one block's
    params per stage (the memory model's), for zero 3's all-gather count."""
    lay, hw, opts = c.layout, c.hw, c.opts
    pp, M = lay.pp, lay.microbatches
    # Time of one microbatch (forward + backward) on each stage, on a rank that has its cores to itself.
    # the busiest EP rank's received assignments over the mean (routing skew, capped by capacity): its expert GEMMs
    # and all-to-all bytes set each MoE layer's pace (plan/skew.py)
    f = imbalance(c)
    per_stage = c.shared.get("stage_times") or c.shared.setdefault(
        "stage_times", [_stage_time(c, s, st, f) for s, st in enumerate(c.stages)])
    t_stage, t_fwd, t_bwd, t_links = (list(x) for x in zip(*per_stage))
    totals = [sum(x.values()) for x in t_stage]
    slow = max(range(pp), key=totals.__getitem__)
    # Fill + drain through every other stage, M at the slowest. Interleaved fills and drains in chunks (1/V of
    # a stage); zb1's fill/drain slot is F+B-W of a stage, 1/3 of F+B+W with backward = 2x forward, B = W.
    drain = {"interleaved": 1 / c.n_virt, "zb1": 1 / 3}.get(lay.schedule, 1.0) if pp > 1 else 1.0
    t_pipe = M * totals[slow] + drain * (sum(totals) - totals[slow])
    exposed_dp, t_opt, t_ar_by_stage, t_opt_by_stage = _dp_sync(c, t_fwd, t_bwd, block_by_stage)

    costs = {k: M * v for k, v in t_stage[slow].items()}
    costs["bubble"] = t_pipe - M * totals[slow]
    costs["overhead"] += hw.step_overhead_s
    costs["dp_allreduce"] = exposed_dp
    costs["optimizer"] = t_opt
    costs["grad_norm"] = t_norm = grad_norm_sync(c)
    step = t_pipe + exposed_dp + t_norm + t_opt + hw.step_overhead_s

    # Every rank's CPU-seconds by cause (dp*ep ranks run each stage, each its M microbatches and its step):
    # where ranks time-share a CPU node's cores, this work / the cores bounds the step too (Hardware.time_shared).
    ranks = lay.dp * lay.ep * lay.cp * lay.tp
    work = {k: 0.0 for k in ("compute", "ep_a2a", "pp_p2p", "overhead", "dp_allreduce", "grad_norm", "optimizer")
            + (("tp",) if lay.tp > 1 else ()) + (("cp",) if lay.cp > 1 else ())}
    for s in range(pp):
        for k, v in t_stage[s].items():
            work[k] += ranks * M * max(0.0, v - t_links[s].get(k, 0.0))  # an emulated link's hold is no work
        work["overhead"] += ranks * hw.step_overhead_s
        work["dp_allreduce"] += 0.0 if opts.links_idle else ranks * t_ar_by_stage[s]
        work["optimizer"] += ranks * t_opt_by_stage[s]
        work["grad_norm"] += 0.0 if opts.links_idle else ranks * t_norm
    # An emulated hold at the step's end (links_idle) is every rank waiting at once: no rank's work fills it.
    held = dict(dp_allreduce=exposed_dp, grad_norm=t_norm) if opts.links_idle else None
    return hw.time_shared(step, costs, work, c.nodes, c.ranks_on_node, held)


def imbalance(c: Context) -> float:
    """`skew.time_imbalance` of the Context's layout, once per layout (its zero levels share it)."""
    f = c.shared.get("time_imbalance")
    return f if f is not None else c.shared.setdefault("time_imbalance",
                                                        time_imbalance(c.cfg, c.layout, c.shape, c.skew))


def muon_time(c: Context) -> float:
    """Muon's seconds per step on one rank beyond AdamW's element-wise update (docs/planner.md "Muon"): its
    share of the Newton-Schulz FLOPs at the matmul peak of train.muon_ns_dtype (fp32, or bf16: Newton-Schulz runs
    in it whatever train.dtype is, optim/newton_schulz.py; GEMMs of the matrices' short side, ~d_model rows), and
    the owner gathers and scatters: the dense matrices' over their non-expert-DP link (TP's node-local link at
    zero 0), the experts' over the expert-DP link. 0 under AdamW."""
    if c.muon is None:
        return 0.0
    m, hw = c.muon, c.hw
    peak = hw.peak_flops("bf16" if c.cfg.train.muon_ns_dtype == "bf16" else "fp32", c.ranks_on_node)
    t_ns = m["ns_flops_rank"] / (peak * gemm_eff(hw, c.shape.d_model))
    moves = ((m["traffic_bytes_rank_dense"], c.links["non_expert_dp"][0] if c.zero >= 1 else hw.intra),
             (m["traffic_bytes_rank_expert"], c.links["expert_dp"][0]))
    return t_ns + sum(b / link.allreduce_bw + 2 * link.latency_s for b, link in moves if b)  # gather + scatter


def grad_norm_sync(c: Context) -> float:
    """The global gradient norm's scalar all-reduces, once per step between the DP sync and the optimizer
    (parallel/clip.py, which every step runs, grad_clip 0 included): over the EP group (whole gradients, zero 0;
    zero 3's experts left whole at DP 1), over the sharded group (zero >= 1: the stage's DP x EP x TP ranks) and over
    PP. Each is a 4-byte ring: 2(g - 1) latencies of its link, which under an emulated network (dilated latencies)
    are tens of milliseconds, on a GPU cluster tens of microseconds."""
    lay, zero = c.layout, c.zero
    groups = []  # (group size, link kind)
    if lay.moe_ep > 1 and (zero == 0 or (zero == 3 and lay.dp == 1)):
        groups.append((lay.moe_ep, "ep"))
    if zero and lay.dp * lay.moe_ep > 1:
        groups.append((lay.dp * lay.moe_ep, "non_expert_dp"))
    if lay.pp > 1:
        groups.append((lay.pp, "pp"))
    return sum(ring_allreduce_s(4, g, c.links[k][0].allreduce_bw, c.links[k][0].latency_s) for g, k in groups)


def _stage_time(c: Context, s: int, st: StageSummary,
                f: float = 1.0) -> tuple[dict[str, float], float, float, dict[str, float]]:
    """One microbatch on stage `s` on its busiest EP rank (`f`: its received assignments over the mean): (seconds by
    cause, forward compute, backward compute, what is waiting rather than work: link holds under opts.links_idle, and
    the skew's excess, which the other ranks of the group spend waiting, not computing)."""
    lay, hw, opts, prec = c.layout, c.hw, c.opts, c.prec
    pp, ep, n_virt = lay.pp, lay.moe_ep, c.n_virt  # experts folded onto EP: the EP group widened by CP and TP
    T, D = c.T, c.shape.d_model
    t_x = T * st.f_expert / (c.peak_expert * c.eff_expert)  # the experts' forward at the mean load
    t_f = T * st.f_dense / (c.peak_dense * c.eff_dense) + f * t_x
    t_b = 2 * t_f + (t_f if c.ac else 0.0)  # backward = 2x forward, plus the recompute
    passes = 4 if c.ac else 3
    if lay.schedule == "zb1" and pp > 1 and s > 0:  # zb1's first stage runs 1F1B (parallel/pp/schedules.py)
        t_b *= 1 + ZB1_SPLIT_COST  # (under AC, B's recompute is the only one: W runs GEMMs on what B kept)
    a2a_link, balanced_link, calls = _ep_link_time(c, s, st, t_f, t_b, f, t_x)
    skew_a2a = a2a_link - balanced_link  # what the skew adds is the others' wait, not work (the balanced link is)
    a2a = a2a_link + (st.n_moe * calls * hw.a2a_call_s if ep > 1 else 0.0)
    # P2P per microbatch; interleaved: a microbatch enters and leaves each rank V times (2V-1 at the ends)
    sends = ((0 if st.last else 1) + (0 if st.first else 1)) if n_virt == 1 else 2 * n_virt - 1
    pp_link = c.links["pp"][0]
    p2p_link = sends * (T * D * prec.act / pp_link.p2p_bw + pp_link.latency_s)
    p2p = p2p_link + sends * 2 * hw.p2p_call_s  # a send and its recv each cost a call
    tp_s, tp_link = tp_plan.stage_tp_time(c, st)  # TP's collectives on the intra-node link (plan/tp.py)
    cp_s, cp_link = cp_plan.stage_cp_time(c, st)  # CP's ring or all-to-all, what the attention does not hide
    links = (dict(ep_a2a=a2a_link, pp_p2p=p2p_link, tp=tp_link, cp=cp_link) if opts.links_idle
             else dict(ep_a2a=skew_a2a))
    links["compute"] = (f - 1) * t_x * passes
    over = st.n_layers * hw.layer_overhead_s
    a2a -= min(opts.ep_overlap * a2a, t_f + t_b)  # what an overlapping schedule hides, at most the compute
    return (dict(compute=t_f + t_b, ep_a2a=a2a, pp_p2p=p2p, overhead=over) | ({"tp": tp_s} if lay.tp > 1 else {})
            | ({"cp": cp_s} if lay.cp > 1 else {}),
            t_f, t_b, links)


def _ep_link_time(c: Context, s: int, st: StageSummary, t_f: float, t_b: float, f: float = 1.0,
                  t_x: float = 0.0) -> tuple[float, float, int]:
    """(EP all-to-all link seconds of one microbatch on stage `s` on its busiest rank, the same at a balanced load,
    all-to-all calls per MoE layer); `f`: the busiest rank's received assignments over the mean, whose bytes its
    dispatch receives and its combine sends; `t_x`: the stage's expert forward at the mean load (in t_f f times)."""
    t_f0 = t_f - (f - 1) * t_x  # the balanced rank's compute, which the overlap and lanes models hide trips behind
    t_b0 = t_b * t_f0 / t_f if t_f else 0.0
    link, calls = _ep_link_at(c, s, st, t_f, t_b, f)
    return link, (_ep_link_at(c, s, st, t_f0, t_b0, 1.0)[0] if f != 1 else link), calls


def _ep_link_at(c: Context, s: int, st: StageSummary, t_f: float, t_b: float, f: float) -> tuple[float, int]:
    """(EP all-to-all link seconds of one microbatch on stage `s` at received load `f`, calls per MoE layer)."""
    lay, hw, cfg = c.layout, c.hw, c.cfg
    pp, ep, M = lay.pp, lay.moe_ep, lay.microbatches  # TP: EP*CP*TP ranks route T/TP tokens each (T: CP's share)
    ep_link, ep_off = c.links["ep"]
    # What one rank sends per all-to-all: its T*K assignments minus those staying local, split
    # between peers on its node and peers elsewhere; the slower of the two paths bounds it.
    # Group-limited routing sends a token's copies to at most topk_group nodes (plan/skew.py): fewer cross nodes.
    # (a trip's mean under parallel.fp8_comm: two of the four carry FP8 rows and their scales, plan/fp8.py)
    # Static dispatch (c.static_payload): every rank sends and receives its padded buffers, whatever the routing.
    a2a_bytes = ((c.static_payload or f) * c.T / lay.tp * c.shape.top_k * c.shape.d_model * c.prec.act * (ep - 1) / ep
                 * fp8_plan.ep_wire_ratio(cfg, c.shape.d_model, c.prec.act))
    # (Static buffers go to every peer whatever the groups: no fewer crossings.)
    cross = 1.0 if c.static_payload else group_node_crossings(
        cfg, lay, c.shape, c.opts.link_node_size or math.ceil(lay.dp * pp * ep / c.nodes))
    a2a_one = max(a2a_bytes * (1 - ep_off) / hw.intra.a2a_bw, cross * a2a_bytes * ep_off / hw.inter.a2a_bw)
    # 4 payload all-to-alls per MoE layer (dispatch/combine, fwd/bwd) + 1 count exchange, each a call.
    lat = (ep - 1) * ep_link.latency_s
    a2a_link = st.n_moe * (4 * a2a_one + 5 * lat) if ep > 1 else 0.0
    calls = 5
    e_local = c.shape.num_experts // ep
    n_ch = min(cfg.parallel.ep_chunks, e_local) if cfg.parallel.ep_overlap and ep > 1 else 1
    if n_ch > 1 and st.n_moe:  # parallel.ep_overlap: only the exposed part of the chunked trips
        t_x = f * c.T * st.f_expert / (c.peak_expert * c.eff_expert) / st.n_moe  # one layer's expert forward
        deferred = lay.schedule == "zb1" and pp > 1 and s > 0  # zb1's B: weight GEMMs wait for W
        a2a_link = st.n_moe * (lat + ep_overlap_exposed(a2a_one, lat, n_ch, t_x)
                               + ep_overlap_exposed(a2a_one, lat, n_ch, (1 if deferred else 2) * t_x,
                                                    0.0 if deferred else t_x / n_ch))
        calls = 1 + 4 * n_ch
    if c.lanes and st.n_moe:
        # two lanes: a forward's trips hidden behind another microbatch's backward and the reverse. The
        # forward's share of the link time: its dispatch and combine plus the count exchange (3 calls of 5).
        # Where the link is a CPU's own work (gloo without an emulator), nothing hides behind compute.
        w_f = a2a_link * (2 * a2a_one + 3 * lat) / (4 * a2a_one + 5 * lat)
        if c.opts.links_idle or not hw.cores_per_node:
            # the warmup's forwards (in whole-stage units) run alone: 0 (pp = 1, 1F1B's last stage) is F(0) and
            # B(M-1); gpipe's M: no forward beside a backward, only the fill hides the backwards' trips
            unpaired = pp_facts.warmup(lay.schedule, pp, s, M, c.n_virt) / c.n_virt
            # what runs while a backward's own trips travel: its weight-gradient GEMMs, about one forward's; on
            # zb1's split stages the W due after it (none for the first s backwards), as much again
            split = lay.schedule == "zb1" and pp > 1 and s > 0
            c_w = t_f * max(M - s, 0) / M if split else t_f
            a2a_link = ep_lanes_time(t_f, t_b, w_f, a2a_link - w_f, M, unpaired, c_w,
                                     LANES_SHARED_SKEW if hw.cores_per_node else 0.0) / M - (t_f + t_b)
    return a2a_link, calls


def _dp_sync(c: Context, t_fwd: list[float], t_bwd: list[float],
             block_by_stage: list[float]) -> tuple[float, float, list[float], list[float]]:
    """(exposed DP sync seconds, optimizer seconds of the slowest stage, DP sync seconds per stage, optimizer
    seconds per stage).

    DP gradient sync (zero 0: all-reduce; zero >= 1: reduce-scatter) overlaps the last microbatch's backward
    (dp_overlap of it), and stage s finishes that backward s stage-backwards before stage 0 does, so it has
    that much idle slack too. Zero 1/2 then all-gather the updated params, waited at the end of the step
    (exposed); zero 3 all-gathers each module's params once at the step's first forward (prefetched: hidden
    behind dp_overlap of that forward), or with zero3_reshard "always" around each forward and backward."""
    lay, hw, prec, zero = c.layout, c.hw, c.prec, c.zero
    M, pp = lay.microbatches, lay.pp
    ne_group, ex_group = c.ne_group, c.ex_group
    ne_link, ex_link = c.links["non_expert_dp"][0], c.links["expert_dp"][0]
    exposed_dp, t_opt, t_ar_by_stage, t_opt_by_stage = 0.0, 0.0, [], []
    mean_bwd = sum(t_bwd) / pp
    red = 2 if c.cfg.parallel.reduce_dtype == "bf16" else prec.grad  # bytes per gradient on the DP wire
    # A reduce-scatter or all-gather is half a ring all-reduce: NCCL's own, and on gloo (a CPU profile) ZeRO's direct
    # send/recv exchanges (comm.reduce_scatter / all_gather on comm.SHARDED_BY_EXCHANGE), which move a ring's bytes.
    half = ring_half_s
    sync = half if zero else ring_allreduce_s
    gathered = tuple(r * prec.param for r in fp8_plan.gather_ratios(c.cfg, c.shape, prec.param, zero))
    for s, st in enumerate(c.stages):
        t_ar = (sync(st.n_ne * red, ne_group, ne_link.allreduce_bw, ne_link.latency_s)
                + sync(st.n_ex * red, ex_group, ex_link.allreduce_bw, ex_link.latency_s))
        g_ne, g_ex = gathered  # bytes per param each all-gather moves (FP8 weights under fp8_comm at zero 3)
        t_ag = 0.0 if not zero else (half(st.n_ne * g_ne, ne_group, ne_link.allreduce_bw, ne_link.latency_s)
                                     + half(st.n_ex * g_ex, ex_group, ex_link.allreduce_bw, ex_link.latency_s))
        # "shard" (zero 2/3) reduce-scatters every microbatch, each behind its own backward; zero 3 "always"
        # all-gathers each module around every microbatch's forward and backward (2M), prefetched behind them,
        # but a block kept gathered after its forward (fsdp.kept_gathered: without PP the last) only before its
        # forward (M)
        n_rs = M if zero >= 2 and c.z_shard else 1
        n_ag = 2 * M if zero == 3 and c.z_reshard else 1
        kept = c.kept_blocks(st)
        if n_ag > 1 and kept:
            n_ag -= kept * M * block_by_stage[s] / max(st.n_ne + st.n_ex, 1)
        t_rs_each = t_ar
        ag_exposed = (max(0.0, n_ag * t_ag - hw.dp_overlap * (t_fwd[s] + (t_bwd[s] if n_ag > 1 else 0.0))
                          * (M if n_ag > 1 else 1)) if zero == 3 else t_ag)
        exposed_dp = max(exposed_dp, (n_rs - 1) * max(0.0, t_rs_each - hw.dp_overlap * t_bwd[s])
                         + max(0.0, t_rs_each - hw.dp_overlap * t_bwd[s] - s * mean_bwd) + ag_exposed)
        t_ar = n_rs * t_rs_each + n_ag * t_ag
        n_opt = (st.n_ne / ne_group + st.n_ex / ex_group) if zero else st.n_ne + st.n_ex
        # AdamW reads param, grad, master, moments and writes param, master, moments; Muon one buffer for two
        t_opt_by_stage.append((n_opt * (2 * prec.param + prec.grad + 2 * prec.master + 2 * prec.moments)
                               - c.muon_elements(st) * prec.moments) / hw.mem_bw + muon_time(c))
        t_opt = max(t_opt, t_opt_by_stage[-1])
        t_ar_by_stage.append(t_ar)
    return exposed_dp, t_opt, t_ar_by_stage, t_opt_by_stage
