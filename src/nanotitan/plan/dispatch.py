"""The EP dispatch in the cost model (docs/planner.md §3 "Static dispatch"): what parallel.ep_dispatch static
(parallel/ep.py `EPDispatcher._static`) sends, how often its buffers overflow, and what the host reads it removes
are worth.

Static sends every peer `static_slots` rows whatever the routing: the payload of every rank is the padded
capacity, `static_payload` times the mean, in place of dynamic's busiest rank's skewed load (plan/skew.py). A step
in which any MoE layer call has a peer owed more rows than its buffer holds is replayed whole with buffers no
routing overflows (capacity EP: `static_payload` EP), so a step costs step(capacity) + P(overflow) x step(EP).
Dynamic reads each MoE layer call's split sizes to the host (a stream stall on an accelerator, nothing on a CPU:
gloo already waits on the host); static reads once a step (the finiteness verdict, which carries the overflow flag).
"""

from __future__ import annotations

import math
from statistics import NormalDist

from ..config.config import Config
from ..parallel.ep import static_slots
from .shape import Layout, ModelShape
from .skew import PLACED_RESIDUAL, capacity_bound

# What one host read of a device value costs a step on an accelerator, when the host has run ahead of the GPU: the
# stream drains to the read, then the GPU idles until the host has issued the next kernels (eager PyTorch's launch
# path, a few to tens of microseconds a kernel). NOT MEASURED here (no GPU lent to this work): a placeholder of the
# right order, which the what-if names beside the break-even price it computes (`--host-sync-us` sets it). CPU
# profiles: 0 (gloo's all-to-all waits on the host anyway; its fixed cost per call is in Hardware.a2a_call_s).
HOST_SYNC_S = 50e-6


def routed_tokens(layout: Layout, shape: ModelShape) -> int:
    """Tokens one EP rank routes a microbatch: its positions (CP and TP ranks split a microbatch's tokens), what the
    static buffers are sized by."""
    return layout.micro_batch * shape.seq_len // (layout.cp * layout.tp)


def static_payload(cfg: Config, layout: Layout, shape: ModelShape, capacity: float | None = None) -> float:
    """parallel.ep_dispatch static: each rank's all-to-all payload over the mean (T*K/EP rows a peer), the same on
    every rank: its buffer of `static_slots` rows a peer (the runtime's rule, rounded up), at least 1. 0 under
    dynamic or without EP (the time model then prices the busiest rank's skewed load)."""
    P = layout.moe_ep
    if P == 1 or (capacity is None and cfg.parallel.ep_dispatch != "static"):
        return 0.0
    assignments = routed_tokens(layout, shape) * shape.top_k
    cap = cfg.parallel.ep_capacity if capacity is None else capacity
    return static_slots(assignments, P, cap) * P / assignments


def load_sd(cfg: Config, layout: Layout, shape: ModelShape, skew: float) -> float:
    """The standard deviation of a destination's share of one MoE layer call's assignments over the mean, as the
    time model's busiest rank reads it (skew.time_imbalance: L experts from EP sources; the placed residual under a
    balanced placement). Every source routes by the same router, so a source's rows to a peer move with the peer's
    whole load: a (source, destination) pair overflows about when its destination's load passes the capacity."""
    P = layout.moe_ep
    L = shape.num_experts // P
    sd = skew * math.sqrt((1 - 1 / P) / (L * P))
    return sd * (PLACED_RESIDUAL if cfg.parallel.expert_placement == "balanced" else 1.0)


def overflow_probability(cfg: Config, layout: Layout, shape: ModelShape, skew: float,
                         capacity: float | None = None) -> float:
    """The chance that a step overflows a static buffer, so is replayed: per MoE layer, the busiest of EP
    destinations (normal loads of sd `load_sd`) passing the padded payload; the model's MoE layers independent, and
    a layer's microbatches and DP replicas one draw (one router, whose hot experts persist through the step: the
    measured rates of docs/experiments/static_dispatch.md sit between the two counts, nearer this one). 0 where no
    routing can overflow: a buffer at `skew.capacity_bound` (a source sends a peer at most min(K, L) of each token's
    K assignments, and under model.capacity_factor at most its cap) or more; and under dynamic, without EP, or for a
    balanced router (skew 0)."""
    payload = static_payload(cfg, layout, shape, capacity)
    sd = load_sd(cfg, layout, shape, skew) if payload else 0.0
    if sd <= 0 or payload >= capacity_bound(cfg, layout, shape) - 1e-9:
        return 0.0
    fits = NormalDist().cdf((payload - 1) / sd) ** layout.moe_ep  # every destination of one call within its buffer
    layers = sum(shape.is_moe(i) for i in range(shape.n_layers))
    return 1 - fits ** layers


def host_reads(layout: Layout, moe_layers: float, activation_checkpointing: bool, dispatch: str) -> float:
    """Host reads a step on a rank of a stage with `moe_layers` MoE layers: dynamic reads each MoE layer call's split
    sizes (every microbatch's forward, and its recompute under activation checkpointing) and the step's verdict;
    static the verdict alone (docs/experiments/static_dispatch.md counts them per layout)."""
    if dispatch == "static" or layout.moe_ep == 1:
        return 1.0
    return 1.0 + moe_layers * layout.microbatches * (2 if activation_checkpointing else 1)
