"""What one prediction is made from: the planner's options, and the facts of one layout on one hardware profile
that the memory model (memory.py) and the time model (steptime.py) both read.

The runtime's own rules are asked, never restated: which blocks zero 3 keeps gathered (`fsdp.kept_gathered`),
the zero 2/3 memory choices (`sync.zero_memory_choices`), the virtual stages (`pp.virtual_stages`), ...
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from ..config.config import Config
from ..config.hardware import Hardware, Link
from ..parallel.dp import fsdp
from ..parallel.dims import ParallelDims
from .shape import Layout, ModelShape, Precision, StageSummary


@dataclass
class PlanOptions:
    precision: str = ""  # "" = from train.dtype (fp32 or bf16-autocast)
    zero: int | None = None  # parallel.zero level(s) to plan: None = every level the layout allows (0..3)
    zero1: bool = False  # old alias of zero=1 (`nanotitan plan --zero1`)
    tp: int = 0  # parallel.tp degree to plan: 0 = every degree a node divides (plan/tp.py)
    cp: int = 0  # parallel.cp degree to plan: 0 = every degree that splits the sequence (plan/cp.py)
    activation_checkpointing: bool | None = None  # None = from train.activation_checkpointing
    global_batch: int = 0  # 0 = cfg.layout_batch
    micro_batch: int = 0  # fix m (0 = free): the MoE balance loss is per microbatch, so equal m = equal maths
    nodes: int = 0  # 0 = ceil(world / hardware.devices_per_node)
    ep_overlap: float = 0.0  # fraction of all-to-all time hidden behind compute (ours: 0; DeepSeek's DualPipe: ~1)
    # An emulated network (parallel/comm/emulate.py, docs/emulate.md): groups cross nodes of this many ranks (0 = the
    # hardware's nodes), and link time is waiting (a held call), not CPU work that time-shared cores must do
    link_node_size: int = 0
    links_idle: bool = False
    shape_extra: dict = field(default_factory=dict)  # ModelShape fields our config cannot express
    # routing skew behind the busiest EP rank's load (expert_imbalance): the CV of an expert's share of one
    # microbatch's assignments; None = EXPERT_SKEW, 0 = a perfectly balanced router (what the dry run routes)
    expert_skew: float | None = None
    # a measured load instead of the skew model: the busiest EP (or CP-folded) rank's received assignments over
    # the mean at the peak (a run whose router collapsed, far beyond the fitted skew: docs/cp.md "Long context")
    expert_load: float | None = None
    # packed documents (plan/docs.py): their mean length, or a prepared data directory to read them from; either
    # prices document-masked attention (model.attn_mask=doc alone, without them: the window's causal attention)
    doc_len_mean: float = 0.0
    doc_data: str = ""
    # what one host read costs a step, where the what-if sets static EP dispatch against dynamic (plan/dispatch.py);
    # None = HOST_SYNC_S on an accelerator profile, 0 on a CPU one
    host_sync_s: float | None = None


def zero_level(layout: Layout, opts: PlanOptions) -> int:
    """The layout's zero level; a zero-0 layout under PlanOptions(zero=Z) or the old zero1=True predicts at Z."""
    return layout.zero or (opts.zero if opts.zero is not None else (1 if opts.zero1 else 0))


@functools.lru_cache(maxsize=4096)  # pure, and called for every prediction of a calibration fit
def placement(layout: Layout, kind: str, per_node: int) -> tuple[bool, float]:
    """(crosses nodes, fraction of a member's peers on other nodes) for the worst group of `kind`
    at stage 0 of replica 0 and of the last replica/stage (ranks fill nodes in order)."""
    return worst_crossing(lambda r: ParallelDims(layout.dp, layout.pp, layout.ep, r),
                          layout.dp * layout.pp * layout.ep, kind, per_node)


def worst_crossing(dims_of, world: int, kind: str, per_node: int) -> tuple[bool, float]:
    """`placement`'s rule over the ranks `dims_of(rank)` (a ParallelDims) places: the first and the last rank's
    groups of `kind`, nodes of `per_node` ranks filled in rank order."""
    worst = (False, 0.0)
    for rank in (0, world - 1):
        ranks = dims_of(rank).group_ranks(kind)
        if len(ranks) < 2:
            continue
        nodes = [r // per_node for r in ranks]
        off = max(sum(n != me for n in nodes) / (len(ranks) - 1) for me in set(nodes))
        worst = max(worst, (len(set(nodes)) > 1, off))
    return worst


@dataclass
class Context:
    """One layout on one profile, as counts: built once per prediction by `cost.build_context`."""
    cfg: Config
    layout: Layout
    hw: Hardware
    opts: PlanOptions
    shape: ModelShape
    prec: Precision
    ac: bool  # activation checkpointing
    nodes: int
    ranks_on_node: int
    T: int  # tokens of one microbatch on one rank (m * S / cp)
    peak: float  # the hardware's peak FLOP/s at this precision for a rank sharing a node with ranks_on_node
    # the rates of the dense and the routed-expert GEMMs: `peak`, or under train.fp8 plan/fp8.py's mixes
    peak_dense: float
    peak_expert: float
    eff_dense: float  # GEMM efficiency of the dense and the expert GEMMs (expert rows grow with EP)
    eff_expert: float
    links: dict[str, tuple[Link, float]]  # group kind: (the link its worst group crosses, fraction of peers off-node)
    n_virt: int  # model chunks per pipeline rank
    lanes: bool  # parallel.ep_overlap_microbatches in effect
    stages: list[StageSummary]
    unckpt: list[StageSummary] | None  # zb1 under AC: the stages without checkpointing (deferred W's inputs)
    zero: int
    z_shard: bool  # zero_accumulate "shard"
    z_reshard: bool  # zero3_reshard "always"
    skew: float  # routing skew (expert_imbalance)
    # train.optimizer = muon: optim/cost.py's muon_costs at this layout (Newton-Schulz FLOPs, owner traffic, the
    # Muon matrices' elements); None under AdamW
    muon: dict | None = None
    # parallel.ep_dispatch static: every rank's all-to-all payload over the mean, its padded buffers
    # (dispatch.static_payload); 0 = dynamic, the busiest rank's skewed load
    static_payload: float = 0.0
    # what the time model computes once and the same layout at other zero levels reuses (cost.predict_zero_levels
    # copies the Context, this dict with it): the stages' per-microbatch times, which no zero level changes
    shared: dict = field(default_factory=dict)

    @property
    def ne_group(self) -> int:
        """Ranks of the non-expert-DP group: replicated params shard over it (its CP ranks too)."""
        return self.layout.dp * self.layout.ep * self.layout.cp

    @property
    def ex_group(self) -> int:
        """Ranks of the expert-DP group: expert shards shard over it."""
        return self.layout.dp

    def muon_elements(self, st: StageSummary) -> float:
        """Elements of stage `st`'s Muon matrices one rank keeps state for (sharded at zero >= 1): its experts, and
        the Muon share of its blocks' non-expert params (the model's hidden matrices over everything but the
        embedding, head and final norm, which stay AdamW's)."""
        if self.muon is None:
            return 0.0
        V, D = self.shape.vocab, self.shape.d_model
        root = (V * D + self.shape.pos_table * D if st.first else 0) + (V * D + D if st.last else 0)
        m = self.muon
        whole_root = 2 * m["V"] * m["D"] + m["pos"] * m["D"] + m["D"]
        blk = m["dense_elems"] / max(1, m["dense_elems"] + m["adam_elems"] - whole_root)
        ne, ex = blk * max(0, st.n_ne - root), st.n_ex * m["expert_elems"] / max(1, m["expert_elems"])
        return ne / self.ne_group + ex / self.ex_group if self.zero >= 1 else ne + ex

    def kept_blocks(self, st: StageSummary) -> int:
        """Blocks of stage `st` that zero3_reshard "always" keeps gathered from their forward to their backward:
        the runtime's rule (`fsdp.kept_gathered`), a half block counted as a block."""
        return len(fsdp.kept_gathered(math.ceil(st.n_layers), self.layout.pp))
