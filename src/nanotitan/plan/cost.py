"""The cost model: predicted peak memory of a rank of every pipeline stage and the step time of one layout.

`predict` builds the layout's Context (context.py) once, then asks the memory model (memory.py: per-rank peak
bytes by cause) and the time model (steptime.py: step time by cause). Every formula and its assumptions are
written up in docs/planner.md (§2 memory, §3 time). The names other modules import from here stay here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..config.config import Config
from ..config.hardware import Hardware
from ..parallel.pp import facts as pp_facts
from ..parallel.dp.sync import zero_memory_choices
from . import cp as cp_plan, dispatch as dispatch_plan, docs as docs_plan, tp as tp_plan
from .context import Context, PlanOptions, placement, zero_level
from .memory import EXPERT_SKEW, expected_max_normal, expert_imbalance, stage_memory
from ..optim.cost import muon_costs
from .fp8 import gemm_rates
from .shape import PRECISIONS, Layout, ModelShape, layout_config, stage_summaries
from .steptime import (LANES_SHARED_SKEW, ZB1_SPLIT_COST, balanced_layer_counts, ep_lanes_time, ep_overlap_exposed,
                       gemm_eff, imbalance, step_time)

__all__ = ["EXPERT_SKEW", "LANES_SHARED_SKEW", "ZB1_SPLIT_COST", "PlanOptions", "Prediction",
           "balanced_layer_counts", "build_context", "ep_lanes_time", "ep_overlap_exposed", "expected_max_normal",
           "expert_imbalance", "placement", "predict", "zero_level"]


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
    # group kind -> "intra" | "inter": the link its worst group crosses
    links: dict[str, str] = field(default_factory=dict)
    expert_time_factor: float = 1.0  # the busiest EP rank's received assignments over the mean (plan/skew.py)

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


def build_context(cfg: Config, layout: Layout, hw: Hardware, opts: PlanOptions | None = None,
                  shape: ModelShape | None = None) -> Context:
    """The facts of `layout` on `hw` that both models read: precision, tokens, links, stages, the zero choices."""
    opts = opts or PlanOptions()
    shape = shape or ModelShape.from_config(cfg, **opts.shape_extra)
    if opts.doc_len_mean or opts.doc_data:  # document-masked attention, on the slowest CP rank (plan/docs.py)
        shape = dataclasses.replace(shape, attn_span=docs_plan.attention_span(
            shape.seq_len, layout.cp, cfg.parallel.cp_split, opts.doc_len_mean, opts.doc_data, layout.micro_batch))
    prec = PRECISIONS[opts.precision or ("bf16-autocast" if cfg.train.dtype == "bf16" else "fp32")]
    ac = cfg.train.activation_checkpointing if opts.activation_checkpointing is None else opts.activation_checkpointing
    pp, ep, M = layout.pp, layout.ep, layout.microbatches
    world = layout.world
    nodes = opts.nodes or math.ceil(world / hw.devices_per_node)
    per_node = math.ceil(world / nodes)
    ranks_on_node = min(world, per_node)
    T = layout.micro_batch * shape.seq_len // layout.cp  # tokens of one microbatch on one rank (CP: its chunks)
    e_local = shape.num_experts // (ep * layout.cp)
    links = {}
    grid = Layout(layout.dp, pp, ep, "1f1b", 1, 1)  # placement depends on the grid alone: one cache entry per grid
    for kind in ("ep", "pp", "non_expert_dp", "expert_dp") + (("cp",) if layout.cp > 1 else ()):
        if layout.cp > 1:  # the CP identity's own groups (plan/cp.py), on the real nodes
            crosses, off = cp_plan.placement(Layout(layout.dp, pp, ep, "1f1b", 1, 1, tp=layout.tp, cp=layout.cp),
                                             kind, opts.link_node_size or per_node)
        else:
            crosses, off = placement(grid, kind, tp_plan.node_size(opts.link_node_size or per_node, layout.tp))
        links[kind] = (hw.inter if crosses else hw.intra), off
    n_virt = pp_facts.virtual_stages(layout.schedule, pp, cfg.parallel.virtual_stages)
    counts = cfg.parallel.pp_layers
    if counts == "auto":
        counts = balanced_layer_counts(cfg, pp * n_virt, hw, ac)
    # parallel.ep_overlap runs the experts in groups (_ExpertTrip), with their own weight-gradient landing
    trips = bool(cfg.parallel.ep_overlap) and ep > 1 and min(cfg.parallel.ep_chunks, e_local) > 1
    # what one rank of a CP x TP group holds and does: the experts folded over EP x CP (x TP in shard_stages)
    folded = dataclasses.replace(layout, ep=ep * layout.cp)
    stages = tp_plan.shard_stages(shape, layout, stage_summaries(shape, folded, counts, ac, n_virt, prec, trips),
                                  cfg.parallel.sp, ac)
    peak = hw.peak_flops("bf16" if prec.act == 2 else "fp32", ranks_on_node)
    t_expert = T * shape.top_k / max(e_local, 1)  # an expert's rows a microbatch
    eff_dense, eff_expert = gemm_eff(hw, T), gemm_eff(hw, t_expert)
    peak_dense, peak_expert = gemm_rates(cfg, shape, hw, peak, T, t_expert, ranks_on_node, eff_dense, eff_expert)
    return Context(
        cfg=cfg, layout=layout, hw=hw, opts=opts, shape=tp_plan.sharded_shape(shape, layout.tp), prec=prec, ac=ac,
        nodes=nodes, ranks_on_node=ranks_on_node, T=T, peak=peak, peak_dense=peak_dense, peak_expert=peak_expert,
        eff_dense=eff_dense, eff_expert=eff_expert, links=links,
        n_virt=n_virt,
        lanes=bool(cfg.parallel.ep_overlap_microbatches and ep > 1 and M > 1),  # two lanes (parallel/lanes.py)
        stages=stages,
        # zb1 under AC: what a microbatch between its B and its W keeps (memory.py)
        unckpt=(tp_plan.shard_stages(shape, layout, stage_summaries(shape, folded, counts, False, n_virt, prec),
                                     cfg.parallel.sp, False) if ac and layout.schedule == "zb1" else None),
        skew=EXPERT_SKEW if opts.expert_skew is None else opts.expert_skew,
        static_payload=dispatch_plan.static_payload(cfg, layout, shape),
        **_zero_fields(cfg, layout, opts, shape))


def _zero_fields(cfg: Config, layout: Layout, opts: PlanOptions, shape: ModelShape) -> dict:
    """The Context's fields that depend on the layout's zero level (the rest does not)."""
    zero = zero_level(layout, opts)
    z_accumulate, z_reshard = zero_memory_choices(zero, layout.pp, layout.schedule, cfg.parallel.zero_accumulate,
                                                  cfg.parallel.zero3_reshard)
    return dict(zero=zero, z_shard=z_accumulate == "shard", z_reshard=z_reshard == "always",
                muon=_muon(cfg, layout, zero, shape) if cfg.train.optimizer == "muon" else None)


def _muon(cfg: Config, layout: Layout, zero: int, shape: ModelShape) -> dict:
    """optim/cost.py's Muon figures at `layout` and zero level `zero`, with the whole model's V, D and position
    table (Context.muon_elements splits the stages by them)."""
    c = layout_config(cfg, layout)
    c.parallel.zero = zero
    c.model.vocab_size = shape.vocab  # an unresolved config's 0 (= data.vocab_size), as ModelShape read it
    return {**muon_costs(c), "V": shape.vocab, "D": shape.d_model, "pos": shape.pos_table}


def predict(cfg: Config, layout: Layout, hw: Hardware, opts: PlanOptions | None = None,
            shape: ModelShape | None = None) -> Prediction:
    """Predict per-rank peak memory of every stage and the step time of `layout` (docs/planner.md)."""
    return _predict(build_context(cfg, layout, hw, opts, shape))


def predict_zero_levels(cfg: Config, layouts: list[Layout], hw: Hardware, opts: PlanOptions | None = None,
                        shape: ModelShape | None = None) -> list[Prediction]:
    """`predict` of each of `layouts`, which differ only in their zero level: their Context is built once and the
    stages' per-microbatch times computed once (neither depends on the level; a search's zero levels are a third of
    its predictions' time)."""
    opts = opts or PlanOptions()
    shape = shape or ModelShape.from_config(cfg, **opts.shape_extra)
    c = build_context(cfg, layouts[0], hw, opts, shape)
    return [_predict(c if i == 0 else dataclasses.replace(c, layout=lay, **_zero_fields(cfg, lay, opts, shape)))
            for i, lay in enumerate(layouts)]


def _predict(c: Context) -> Prediction:
    layout, hw = c.layout, c.hw
    mem = [stage_memory(c, s, st) for s, st in enumerate(c.stages)]
    step, costs = step_time(c, [m.block for m in mem])
    if c.static_payload:  # static EP dispatch: an overflowing step runs again with buffers that cannot overflow
        p = dispatch_plan.overflow_probability(c.cfg, layout, c.shape, c.skew)
        replay = dataclasses.replace(c, static_payload=float(layout.moe_ep), shared={})
        costs["ep_replay"] = p * step_time(replay, [m.block for m in mem])[0] if p else 0.0
        step += costs["ep_replay"]
    mem_by_stage = [m.peak for m in mem]
    limit = hw.mem_per_rank(c.ranks_on_node)
    tokens = layout.dp * layout.ep * layout.microbatches * layout.micro_batch * c.shape.seq_len
    links = {k: "inter" if link is hw.inter and hw.inter is not hw.intra else "intra"
             for k, (link, _) in c.links.items()}
    return Prediction(layout, step, tokens / step, mem_by_stage, limit, max(mem_by_stage) <= limit, costs,
                      [m.parts for m in mem], [m.ckpt for m in mem], links, imbalance(c))
