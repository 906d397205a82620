"""Routing skew and routing limits in the time model (docs/planner.md §3 "Routing skew"): how much more than the mean
the busiest EP rank receives per microbatch and MoE layer, which its expert GEMMs and all-to-all wait for; the
routing skew a run measured (`metrics.jsonl`'s `ep_recv_max_mean`, observe/report.py); and the node crossings of
group-limited routing (model.n_group / topk_group).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from ..config.config import Config
from .memory import expected_max_normal
from .shape import Layout, ModelShape

# parallel.expert_placement=balanced (parallel/placement.py) places experts by each window's routing counts and cuts
# each microbatch's tokens of a replicated expert over its copies where the ranks even out, so the busiest EP rank
# keeps only what a placement cannot follow (an expert that turns hot without a copy) and the cut's residual: this
# share of the dropless excess (factor - 1). Measured by `nanotitan bench placement --trained 120` at the
# bandwidth-bound skew check, a settled router (docs/ep.md "Experts placed by load"): E 4, EP 4, R 2, windows of 3
# steps: busiest/mean 1.70 static -> 1.06 placed, 0.06 / 0.70 = 0.09. (A fresh router still collapsing, which moves
# its hot experts between windows, keeps more: 1.96 -> 1.50 on 5 Dec, 0.52; the planner prices a run's steady state.)
PLACED_RESIDUAL = 0.09


def capacity_bound(cfg: Config, layout: Layout, shape: ModelShape) -> float:
    """The most a rank can receive over the mean T*K assignments: every source token sending it min(K, L) of its K,
    and under model.capacity_factor at most E * ceil(cf*T*K/E) per microbatch (model/moe.py drops the rest)."""
    ep, E, K = layout.moe_ep, shape.num_experts, shape.top_k  # CP, TP: EP*CP*TP ranks route T/(CP*TP) tokens each
    L, T = E // ep, layout.micro_batch * shape.seq_len // (layout.cp * layout.tp)
    bound, cf = ep * min(K, L) / K, cfg.model.capacity_factor
    if cf:
        bound = min(bound, E * math.ceil(cf * T * K / E) / (T * K))
    return bound


def time_imbalance(cfg: Config, layout: Layout, shape: ModelShape, skew: float) -> float:
    """The busiest EP rank's received assignments over the mean, expected per microbatch and MoE layer: each layer's
    all-to-all makes every rank of the group wait for it, so the step pays this factor on the expert GEMMs and the
    all-to-all bytes. Dropless: an expert's share of one source microbatch's assignments has CV `skew` (the memory
    side's sigma, memory.expert_imbalance); a rank sums L = E/EP experts from EP sources, so its load deviates with
    sd skew*sqrt((1 - 1/EP)/(L*EP)), and the busiest of EP ranks sits at the expected max of EP normals. Capped by
    `capacity_bound`; 1 at EP 1 (one rank holds every expert) and for a balanced router (skew 0)."""
    ep = layout.moe_ep  # experts fold over EP x CP x TP (docs/tp.md, plan/cp.py): that many ranks share them
    if ep == 1:
        return 1.0
    bound = capacity_bound(cfg, layout, shape)
    if not skew:
        return min(1.0, bound)
    L = shape.num_experts // ep
    excess = skew * math.sqrt((1 - 1 / ep) / (L * ep)) * expected_max_normal(ep)
    if cfg.parallel.expert_placement == "balanced":  # the placed load, not the router's raw one
        excess *= PLACED_RESIDUAL
    return min(bound, 1.0 + excess)


def rebalance_bytes(cfg: Config, layout: Layout, shape: ModelShape) -> float:
    """What one rebalance sends per EP rank at most (parallel/rebalance.py): every slot of a rank, C = E/EP + R - 1
    of them, refilled from another rank in each MoE layer of its stage, each an expert's weights and AdamW's two
    moments (3*D*F elements, fp32: 12 bytes an element)."""
    ep = layout.moe_ep  # EP x CP x TP ranks share the experts
    if ep == 1:
        return 0.0
    slots = shape.num_experts // ep + max(cfg.parallel.expert_replicas, 1) - 1
    moe_layers = sum(shape.is_moe(i) for i in range(shape.n_layers)) / layout.pp
    return moe_layers * slots * 3 * shape.d_model * shape.ffn_dim * 12.0


def replica_sync_bytes(cfg: Config, layout: Layout, shape: ModelShape) -> float:
    """What the replicated experts' gradient sum sends per EP rank and step at most (parallel/rebalance.py): each of a
    rank's R - 1 spare slots per MoE layer of its stage holds a copy of an expert with r = R copies. Zero 0 (the
    fold): the copy sends (r - 1)/r of its gradient row (3*D*F elements, fp32) to the other copies in the reduce and
    again in the hand-back. Zero 1-3: the rows were reduce-scattered over DP with the rest, and the copy sends its
    1/DP piece to each of the r - 1 others."""
    R = max(cfg.parallel.expert_replicas, 1)
    if layout.moe_ep == 1 or R == 1:
        return 0.0
    moe_layers = sum(shape.is_moe(i) for i in range(shape.n_layers)) / layout.pp
    row = 3 * shape.d_model * shape.ffn_dim * 4.0
    per_copy = 2 * (R - 1) / R * row if layout.zero == 0 else (R - 1) * row / layout.dp
    return moe_layers * (R - 1) * per_copy


def skew_of_ratio(ratio: float, ep: int, num_experts: int) -> float:
    """The sigma at which `time_imbalance` (dropless) equals a measured busiest-over-mean `ratio` at this EP: the
    inverse of its formula, so a run's record gives sigma without a fit."""
    L = num_experts // ep
    scale = math.sqrt((1 - 1 / ep) / (L * ep)) * expected_max_normal(ep)
    return max(0.0, ratio - 1.0) / scale if scale > 0 else 0.0


def measured_skew(metrics: str | Path, num_experts: int, ep: int = 0, skip: int = 0) -> float:
    """Sigma from a run's `metrics.jsonl` (or a `bench layouts` row dict's path): the median over logged steps after
    `skip` of `ep_recv_max_mean` (the busiest EP rank's received assignments over the mean, per microbatch and MoE
    layer), inverted at the run's EP; a run without EP gives `expert_cv`, the CV itself."""
    recs = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r.get("step", 0) > skip and ("ep_recv_max_mean" in r or "expert_cv" in r)]
    if not recs:
        raise ValueError(f"{metrics}: no step records ep_recv_max_mean or expert_cv (a run before the skew record)")
    ep = ep or int(recs[-1].get("ep", 1))
    if ep > 1 and "ep_recv_max_mean" in recs[-1]:
        return skew_of_ratio(statistics.median(r["ep_recv_max_mean"] for r in recs), ep, num_experts)
    return statistics.median(r["expert_cv"] for r in recs)


def group_node_crossings(cfg: Config, layout: Layout, shape: ModelShape, per_node: int) -> float:
    """Of a token's K assignments, the copies that cross to other nodes per off-node destination, relative to K:
    group-limited routing (model.n_group groups of experts, each token routed into topk_group of them) sends a
    token to at most topk_group groups; where every group lies within one node of the EP group (n_group a multiple
    of the nodes it spans) that is at most min(K, topk_group) nodes, one copy each (a dispatcher that forwards
    within the node, DeepSeek's), not K. 1.0 without the limit or where groups straddle nodes."""
    K, G, tg = shape.top_k, cfg.model.n_group, cfg.model.topk_group
    nodes = math.ceil(layout.moe_ep / max(per_node, 1))
    if G <= 1 or tg >= G or nodes <= 1 or G % nodes:
        return 1.0
    return min(K, tg) / K
