"""Layout planner: predict memory and step time of every DP x PP x EP layout, rank them, pick one.

`nanotitan plan --config FILE --gpus N` enumerates every layout (dp, pp, ep, schedule, M, m) of
world N that keeps the config's global batch B = dp*ep*M*m and passes `config.validate`, predicts
per-rank memory and step time with the analytic model below, and prints a ranked table with a
recommendation. `recommend()` is what `nanotitan train --parallel.auto true` calls.
`nanotitan plan --calibrate LAYOUTS_JSON --hardware PROFILE --out NEW` fits a profile's free constants to
what `nanotitan bench layouts` measured (`fit_profile`); `calibrate` reports prediction errors.
The method, every formula and its assumptions are written up in docs/planner.md.

Shapes: V vocab, D d_model, F expert hidden, Fd dense FFN hidden, E experts, K top_k, S seq_len,
T = m*S tokens of one microbatch on one rank.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .config import Config, ConfigError, load_config, validate
from .hardware import GiB, Hardware, detect_hardware, get_hardware, save_hardware
from .model.spec import layer_bounds


# --- the model as the planner sees it ------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """Parameter and FLOP counts by formula (checked against real `Transformer` shards in tests).
    The last three fields describe models our Transformer cannot build (DeepSeek-V3): they are
    0 for every nanoTitan config."""

    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn_dim: int  # expert hidden size (and the dense FFN's, unless dense_ffn_dim)
    num_experts: int
    top_k: int
    moe_every: int
    seq_len: int
    pos_table: int = 0  # rows of a learned position table on stage 0 (0 with rope)
    dense_ffn_dim: int = 0  # hidden size of the dense FFN layers (0 = ffn_dim)
    first_dense: int = 0  # the first k layers are dense (DeepSeek-V3: 3)
    n_shared_experts: int = 0  # always-on experts per MoE layer, replicated like non-expert params

    @staticmethod
    def from_config(cfg: Config, **extra) -> "ModelShape":
        m = cfg.model
        return ModelShape(vocab=m.vocab_size or cfg.data.vocab_size, d_model=m.d_model, n_layers=m.n_layers,
                          n_heads=m.n_heads, ffn_dim=m.ffn_dim, num_experts=m.num_experts, top_k=m.top_k,
                          moe_every=m.moe_every, seq_len=cfg.train.seq_len,
                          pos_table=m.max_seq_len if m.pos_emb == "learned" else 0, **extra)

    def is_moe(self, i: int) -> bool:
        return i >= self.first_dense and i % self.moe_every == 0

    @property
    def dense_hidden(self) -> int:
        return self.dense_ffn_dim or self.ffn_dim

    def layer_params(self, i: int) -> tuple[int, int]:
        """(non-expert params, params of ONE routed expert) of layer i."""
        D, F = self.d_model, self.ffn_dim
        common = 4 * D * D + 2 * D  # q,k,v,o + two RMSNorm weights
        if self.is_moe(i):
            return common + D * self.num_experts + self.n_shared_experts * 3 * D * F, 3 * D * F
        return common + 3 * D * self.dense_hidden, 0

    def layer_fwd_flops(self, i: int) -> tuple[float, float]:
        """Forward FLOPs per token of layer i: (dense part, routed-expert part).
        Matches model.transformer.flops_per_token: attention scores count 4*S*D (not halved for causal)."""
        D, F, S = self.d_model, self.ffn_dim, self.seq_len
        dense = 8 * D * D + 4 * S * D
        if self.is_moe(i):
            return dense + 2 * D * self.num_experts + 6 * D * F * self.n_shared_experts, 6 * D * F * self.top_k
        return dense + 6 * D * self.dense_hidden, 0.0

    def layer_act_elems(self, i: int) -> float:
        """Elements autograd keeps per token for layer i's backward (listed in docs/planner.md;
        4-byte units, int64 indices count 2)."""
        D, F, K, E = self.d_model, self.ffn_dim, self.top_k, self.num_experts
        norm = 3 * D + 1  # RMSNorm keeps its input, 1/rms and the unweighted normalised x; the next linear its output
        attn = norm + 4 * D + self.n_heads  # q, k (after RoPE), v, SDPA output (o_proj reads it as a view) + logsumexp
        if self.is_moe(i):
            # router probs, top-k weights/ids and the expert-major order; per assignment: gathered x,
            # 4 SwiGLU F-vectors, expert output and weighted output in combine
            return attn + norm + E + 8 * K + K * (3 * D + 4 * F) + self.n_shared_experts * 4 * F
        return attn + norm + 4 * self.dense_hidden

    def layer_bwd_elems(self, i: int) -> float:
        """Extra elements per token alive while layer i runs backward (gradients of its intermediates)."""
        D, K = self.d_model, self.top_k
        return (3 * K * D + 2 * D) if self.is_moe(i) else (2 * self.dense_hidden + 2 * D)

    def total_params(self) -> int:
        n = self.vocab * self.d_model * 2 + self.d_model + self.pos_table * self.d_model
        for i in range(self.n_layers):
            ne, ex = self.layer_params(i)
            n += ne + ex * self.num_experts
        return n


@dataclass(frozen=True)
class Layout:
    dp: int
    pp: int
    ep: int
    schedule: str
    microbatches: int  # M
    micro_batch: int  # m

    def short(self) -> str:
        return (f"dp{self.dp} pp{self.pp} ep{self.ep} {self.schedule if self.pp > 1 else '-'} "
                f"M{self.microbatches} m{self.micro_batch}")

    def as_tuple(self) -> tuple[int, int, int, str, int, int]:
        return self.dp, self.pp, self.ep, self.schedule, self.microbatches, self.micro_batch


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each training state, and per activation element."""

    param: int
    grad: int
    master: int  # fp32 master copy when params are kept in bf16 (0 = params are the master)
    moments: int  # AdamW's two moments together
    act: int


PRECISIONS = {
    "fp32": Precision(4, 4, 0, 8, 4),  # our trainer, train.dtype=fp32
    "bf16-autocast": Precision(4, 4, 0, 8, 2),  # our trainer, train.dtype=bf16: fp32 states, bf16 activations
    "bf16-master": Precision(2, 4, 4, 8, 2),  # Megatron-style: bf16 params, fp32 grads/master/moments
    # DeepSeek-V3 report sec. 3.3.3: bf16 moments, fp32 master weights and gradients.
    "bf16-master-bf16-moments": Precision(2, 4, 4, 4, 2),
}


@dataclass
class PlanOptions:
    precision: str = ""  # "" = from train.dtype (fp32 or bf16-autocast)
    zero1: bool = False  # shard master+moments over each param's DP group (the trainer does not implement it yet)
    activation_checkpointing: bool | None = None  # None = from train.activation_checkpointing
    global_batch: int = 0  # 0 = cfg.global_batch
    micro_batch: int = 0  # fix m (0 = free): the MoE balance loss is per microbatch, so equal m = equal maths
    nodes: int = 0  # 0 = ceil(world / hardware.devices_per_node)
    ep_overlap: float = 0.0  # fraction of all-to-all time hidden behind compute (ours: 0; DeepSeek's DualPipe: ~1)
    shape_extra: dict = field(default_factory=dict)  # ModelShape fields our config cannot express


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


# --- enumeration ---------------------------------------------------------------------------------
def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_config(cfg: Config, layout: Layout) -> Config:
    """A copy of cfg running `layout` (pp_layers kept only when it still matches pp)."""
    c = copy.deepcopy(cfg)
    p = c.parallel
    p.dp, p.pp, p.ep, p.schedule, p.microbatches = layout.dp, layout.pp, layout.ep, layout.schedule, layout.microbatches
    c.train.micro_batch = layout.micro_batch
    if len(p.pp_layers) != layout.pp:
        p.pp_layers = []
    p.auto = False
    return c


def enumerate_layouts(cfg: Config, world: int, global_batch: int = 0) -> list[Layout]:
    """Every layout of `world` ranks with dp*ep*M*m = B that config.validate accepts; both schedules when pp > 1."""
    B = global_batch or cfg.global_batch
    out = []
    for pp in divisors(world):
        for ep in divisors(world // pp):
            dp = world // (pp * ep)
            if B % (dp * ep):
                continue
            b = B // (dp * ep)
            for M in divisors(b):
                for schedule in (("gpipe", "1f1b") if pp > 1 else (cfg.parallel.schedule,)):
                    layout = Layout(dp, pp, ep, schedule, M, b // M)
                    try:
                        validate(layout_config(cfg, layout), world_size=world)
                    except ConfigError:
                        continue  # ep does not divide the experts, pp > layers, torch_ddp with pp/ep...
                    out.append(layout)
    return out


# --- where groups sit ----------------------------------------------------------------------------
def _group_ranks(layout: Layout, kind: str, dp: int = 0, pp: int = 0, ep: int = 0) -> list[int]:
    P, E = layout.pp, layout.ep
    rank = lambda d, p, e: (d * P + p) * E + e  # DESIGN §3
    if kind == "ep":
        return [rank(dp, pp, e) for e in range(E)]
    if kind == "pp":
        return [rank(dp, p, ep) for p in range(P)]
    if kind == "expert_dp":
        return [rank(d, pp, ep) for d in range(layout.dp)]
    return [rank(d, pp, e) for d in range(layout.dp) for e in range(E)]  # non_expert_dp


def _placement(layout: Layout, kind: str, per_node: int) -> tuple[bool, float]:
    """(crosses nodes, fraction of a member's peers on other nodes) for the worst group of `kind`
    at stage 0 of replica 0 and of the last replica/stage (ranks fill nodes in order)."""
    worst = (False, 0.0)
    for d, p, e in ((0, 0, 0), (layout.dp - 1, layout.pp - 1, layout.ep - 1)):
        ranks = _group_ranks(layout, kind, d, p, e)
        if len(ranks) < 2:
            continue
        nodes = [r // per_node for r in ranks]
        off = max(sum(n != me for n in nodes) / (len(ranks) - 1) for me in set(nodes))
        worst = max(worst, (len(set(nodes)) > 1, off))
    return worst


# --- cost model ----------------------------------------------------------------------------------
def _ring_allreduce_s(nbytes: float, g: int, bw: float, lat: float) -> float:
    """Ring all-reduce: 2(g-1)/g of the buffer crosses each link, 2(g-1) latency steps."""
    return 0.0 if g < 2 or nbytes == 0 else 2 * (g - 1) / g * nbytes / bw + 2 * (g - 1) * lat


def _gemm_eff(hw: Hardware, rows: float) -> float:
    return hw.compute_efficiency * rows / (rows + hw.gemm_half_rows)


@dataclass(frozen=True)
class StageSummary:
    """What one rank of pipeline stage s owns and does per token (elements / FLOPs)."""

    n_ne: int  # non-expert params (replicated over the non-expert-DP group)
    n_ex: int  # this rank's expert params (E/EP experts of each MoE layer)
    f_dense: float  # forward FLOPs per token outside routed experts
    f_expert: float  # forward FLOPs per token in routed experts
    act: float  # activation elements kept per token of one microbatch
    act_layer_max: float  # extra elements per token while the largest layer runs backward
    head_act: float  # part of `act` that belongs to the head (freed before the layers' backward)
    n_moe: int
    n_layers: int
    first: bool
    last: bool


def stage_summaries(shape: ModelShape, layout: Layout, pp_layers: list[int] | None = None,
                    activation_checkpointing: bool = False) -> list[StageSummary]:
    """Per-stage parameter, FLOP and activation counts; layers split as `model.spec.layer_bounds` does."""
    pp, D, V = layout.pp, shape.d_model, shape.vocab
    e_local = shape.num_experts // layout.ep
    out = []
    for s in range(pp):
        lo, hi = layer_bounds(shape.n_layers, pp, s, pp_layers if pp_layers and len(pp_layers) == pp else None)
        first, last = s == 0, s == pp - 1
        n_ne = (V * D + shape.pos_table * D if first else 0) + (V * D + D if last else 0)
        n_ex, f_dense, f_expert, act, act_layer_max, n_moe = 0, 0.0, 0.0, 0.0, 0.0, 0
        for i in range(lo, hi):
            ne, one_expert = shape.layer_params(i)
            n_ne, n_ex = n_ne + ne, n_ex + one_expert * e_local
            fd, fe = shape.layer_fwd_flops(i)
            f_dense, f_expert = f_dense + fd, f_expert + fe
            a = shape.layer_act_elems(i)
            act += D if activation_checkpointing else a  # checkpointing keeps only each block's input
            # backward of one layer: its gradients' working set, plus its recomputed activations under AC
            act_layer_max = max(act_layer_max, shape.layer_bwd_elems(i) + (a if activation_checkpointing else 0.0))
            n_moe += shape.is_moe(i)
        head_act = 3 * D + 1 + V if last else 0  # final norm (as in a layer), log-softmax output
        if last:
            f_dense += 2 * D * V
            act += head_act
        out.append(StageSummary(n_ne, n_ex, f_dense, f_expert, act, act_layer_max, head_act, n_moe, hi - lo,
                                first, last))
    return out


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
        crosses, off = _placement(layout, kind, per_node)
        return (hw.inter if crosses else hw.intra), off

    ep_link, ep_off = link("ep")
    pp_link, _ = link("pp")
    ne_link, _ = link("non_expert_dp")
    ex_link, _ = link("expert_dp")

    stages = stage_summaries(shape, layout, cfg.parallel.pp_layers, ac)

    # Memory of a rank of each stage.
    ne_group, ex_group = dp * ep, dp
    mem_by_stage, parts_by_stage = [], []
    for s, st in enumerate(stages):
        n_local = st.n_ne + st.n_ex
        opt_params = (st.n_ne / ne_group + st.n_ex / ex_group) if opts.zero1 else n_local
        in_flight = 1 if pp == 1 else (M if layout.schedule == "gpipe" else min(M, pp - s))
        transient = [2 * T * V * 4 if st.last else 0.0,  # gradients of log-softmax and logits (fp32 CE)
                     # one block's backward (and its recompute under AC); the head's activations are freed by then
                     T * (st.act_layer_max - st.head_act) * prec.act,
                     2 * T * K * D * prec.act if ep > 1 and st.n_moe else 0.0,  # all-to-all send + recv
                     2 * T * D * prec.act if pp > 1 else 0.0]  # P2P gradient buffers
        parts = {"params": n_local * prec.param, "grads": n_local * prec.grad,
                 "optimizer": opt_params * (prec.master + prec.moments),
                 "activations": in_flight * T * st.act * prec.act, "buffers": max(transient),
                 "reserved": hw.mem_reserved_bytes}
        mem_by_stage.append(sum(parts.values()))
        parts_by_stage.append(parts)

    # Time of one microbatch (forward + backward) on each stage, on a rank that has its cores to itself.
    t_stage, t_bwd = [], []
    for s, st in enumerate(stages):
        t_f = T * (st.f_dense / (peak * eff_dense) + st.f_expert / (peak * eff_expert))
        t_b = 2 * t_f + (t_f if ac else 0.0)  # backward = 2x forward, plus the recompute
        # What one rank sends per all-to-all: its T*K assignments minus those staying local, split
        # between peers on its node and peers elsewhere; the slower of the two paths bounds it.
        a2a_bytes = T * K * D * prec.act * (ep - 1) / ep
        a2a_one = max(a2a_bytes * (1 - ep_off) / hw.intra.a2a_bw, a2a_bytes * ep_off / hw.inter.a2a_bw)
        # 4 payload all-to-alls per MoE layer (dispatch/combine, fwd/bwd) + 1 count exchange, each a call.
        a2a = st.n_moe * (4 * a2a_one + 5 * ((ep - 1) * ep_link.latency_s + hw.a2a_call_s)) if ep > 1 else 0.0
        sends = (0 if st.last else 1) + (0 if st.first else 1)
        p2p = sends * (T * D * prec.act / pp_link.p2p_bw + pp_link.latency_s + 2 * hw.p2p_call_s)  # send + its recv
        over = st.n_layers * hw.layer_overhead_s
        a2a -= min(opts.ep_overlap * a2a, t_f + t_b)  # what an overlapping schedule hides, at most the compute
        t_stage.append(dict(compute=t_f + t_b, ep_a2a=a2a, pp_p2p=p2p, overhead=over))
        t_bwd.append(t_b)
    totals = [sum(x.values()) for x in t_stage]
    slow = max(range(pp), key=totals.__getitem__)
    t_pipe = (M - 1) * totals[slow] + sum(totals)  # fill + drain through every stage, M-1 more at the slowest

    # DP all-reduce: overlaps the last microbatch's backward (dp_overlap of it), and stage s finishes
    # that backward s stage-backwards before stage 0 does, so it has that much idle slack too.
    exposed_dp, t_opt, t_ar_by_stage, t_opt_by_stage = 0.0, 0.0, [], []
    mean_bwd = sum(t_bwd) / pp
    for s, st in enumerate(stages):
        t_ar = (_ring_allreduce_s(st.n_ne * prec.grad, ne_group, ne_link.allreduce_bw, ne_link.latency_s)
                + _ring_allreduce_s(st.n_ex * prec.grad, ex_group, ex_link.allreduce_bw, ex_link.latency_s))
        exposed_dp = max(exposed_dp, max(0.0, t_ar - hw.dp_overlap * t_bwd[s] - s * mean_bwd))
        n_opt = (st.n_ne / ne_group + st.n_ex / ex_group) if opts.zero1 else st.n_ne + st.n_ex
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

    if hw.shares_cores(ranks_on_node):
        # More ranks than cores: a rank idling in the bubble or waiting on a peer lends its core to another
        # rank, so the step is bounded below by the node's CPU work / its cores; communication on gloo is
        # CPU work too (copies, the host sync). The critical path above stays a bound as well.
        work = {k: 0.0 for k in ("compute", "ep_a2a", "pp_p2p", "overhead", "dp_allreduce", "optimizer")}
        for s in range(pp):  # dp*ep ranks run each stage; every rank does its M microbatches and its step
            for k, v in t_stage[s].items():
                work[k] += dp * ep * M * v
            work["overhead"] += dp * ep * hw.step_overhead_s
            work["dp_allreduce"] += dp * ep * t_ar_by_stage[s]
            work["optimizer"] += dp * ep * t_opt_by_stage[s]
        cpus = nodes * hw.cores_per_node
        if sum(work.values()) / cpus > step:
            costs = {k: v / cpus for k, v in work.items()} | {"bubble": 0.0}
            step = sum(costs.values())
    B = dp * ep * M * m
    limit = hw.mem_per_rank(ranks_on_node)
    return Prediction(layout, step, B * S / step, mem_by_stage, limit, max(mem_by_stage) <= limit, costs,
                      parts_by_stage)


def plan(cfg: Config, world: int, hardware: str | Hardware | None = None,
         opts: PlanOptions | None = None) -> list[Prediction]:
    """Every valid layout of `world`, best first: fitting ones by tokens/s, then less memory."""
    opts = opts or PlanOptions()
    hw = get_hardware(hardware) if hardware else detect_hardware()
    if opts.nodes and world % opts.nodes:
        raise ConfigError(f"--gpus {world} must be a multiple of --nodes {opts.nodes}")
    shape = ModelShape.from_config(cfg, **opts.shape_extra)
    layouts = [lay for lay in enumerate_layouts(cfg, world, opts.global_batch)
               if not opts.micro_batch or lay.micro_batch == opts.micro_batch]
    preds = [predict(cfg, lay, hw, opts, shape) for lay in layouts]
    preds.sort(key=lambda p: (not p.fits, -p.tokens_per_sec, p.peak_mem))
    return preds


def recommend(cfg: Config, world: int, hardware: str | Hardware | None = None,
              opts: PlanOptions | None = None) -> tuple[int, int, int, str, int, int]:
    """(dp, pp, ep, schedule, microbatches, micro_batch) of the fastest layout that fits memory."""
    preds = plan(cfg, world, hardware, opts)
    if not preds:
        B = (opts and opts.global_batch) or cfg.global_batch
        raise ConfigError(f"no layout of {world} ranks keeps global batch {B} with "
                          f"{cfg.model.num_experts} experts and {cfg.model.n_layers} layers "
                          f"(change --parallel.microbatches/--train.micro_batch or the world size)")
    if not preds[0].fits:
        p = min(preds, key=lambda q: q.peak_mem)
        raise ConfigError(f"no layout of {world} ranks fits memory: the smallest needs {p.peak_mem / GiB:.1f} GiB "
                          f"per rank > {p.mem_limit / GiB:.1f} GiB ({p.layout.short()}); use more ranks, "
                          f"--train.activation_checkpointing true or a smaller --train.micro_batch")
    return preds[0].layout.as_tuple()


def reason(preds: list[Prediction]) -> str:
    """One line: why the first prediction is the recommendation."""
    best = preds[0]
    if not best.fits:
        return "nothing fits memory; the table is ranked by speed anyway"
    line = (f"fastest layout that fits: {best.tokens_per_sec:,.0f} tok/s, {best.peak_mem / GiB:.2f} of "
            f"{best.mem_limit / GiB:.1f} GiB per rank, dominant cost {best.dominant}")
    faster_oom = [p for p in preds if not p.fits and p.tokens_per_sec > best.tokens_per_sec]
    same = lambda a, b: dataclasses.replace(a, schedule="") == dataclasses.replace(b, schedule="")
    nxt = next((p for p in preds[1:] if p.fits and not same(p.layout, best.layout)), None)  # not its other schedule
    if nxt:
        line += f"; next {nxt.layout.short()} is {100 * (1 - nxt.tokens_per_sec / best.tokens_per_sec):.0f}% slower ({nxt.dominant})"
    if faster_oom:
        line += f"; {faster_oom[0].layout.short()} would be faster but needs {faster_oom[0].peak_mem / GiB:.1f} GiB"
    return line


# --- calibration against measured layouts ----------------------------------------------------------
def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / den if den else float("nan")


def calibrate(measured_rows: list[dict], cfg: Config, hardware: str | Hardware | None = None,
              opts: PlanOptions | None = None) -> dict:
    """Predicted vs measured step time and peak memory for each measured layout.

    A row has dp, pp, ep, schedule, M (or microbatches), m (or micro_batch), step_time_s and
    peak_mem_bytes (one number = the max over ranks, or a list indexed by global rank).
    Returns {"rows": [...], "median_abs_err_step", "median_abs_err_mem", "spearman_rho",
    "median_time_ratio"}; the last (measured / predicted step time) is the factor to fold into the
    profile's compute_efficiency when the machine runs uniformly slower or faster than its profile.
    """
    hw = get_hardware(hardware) if hardware else detect_hardware()
    opts = opts or PlanOptions()
    rows = []
    for r in measured_rows:
        lay = _layout_of(r, cfg)
        pred = predict(layout_config(cfg, lay), lay, hw, opts)
        mem = r["peak_mem_bytes"]
        if isinstance(mem, (list, tuple)):  # per global rank: compare each with its stage's prediction
            pred_mem = [pred.mem_by_stage[(g // lay.ep) % lay.pp] for g in range(len(mem))]
            mem_err = statistics.median(abs(p / x - 1) for p, x in zip(pred_mem, mem))
            meas_mem, pred_peak = max(mem), max(pred_mem)
        else:
            meas_mem, pred_peak = float(mem), pred.peak_mem
            mem_err = abs(pred_peak / meas_mem - 1)
        rows.append(dict(layout=lay.short(), pred_step_s=pred.step_time_s, meas_step_s=float(r["step_time_s"]),
                         step_err=pred.step_time_s / float(r["step_time_s"]) - 1, pred_mem=pred_peak,
                         meas_mem=meas_mem, mem_err=mem_err, dominant=pred.dominant))
    return dict(rows=rows,
                median_abs_err_step=statistics.median(abs(x["step_err"]) for x in rows) if rows else float("nan"),
                median_abs_err_mem=statistics.median(abs(x["mem_err"]) for x in rows) if rows else float("nan"),
                spearman_rho=spearman([x["pred_step_s"] for x in rows], [x["meas_step_s"] for x in rows])
                if len(rows) > 1 else float("nan"),
                median_time_ratio=statistics.median(x["meas_step_s"] / x["pred_step_s"] for x in rows)
                if rows else float("nan"))


def _layout_of(r: dict, cfg: Config) -> Layout:
    sched = r.get("schedule", cfg.parallel.schedule)
    return Layout(int(r["dp"]), int(r["pp"]), int(r["ep"]), cfg.parallel.schedule if sched in ("-", "") else sched,
                  int(r.get("M", r.get("microbatches", 1))), int(r.get("m", r.get("micro_batch", 1))))


def _nelder_mead(f, x0: list[float], step: float = 0.5, iters: int = 400) -> list[float]:
    """Minimise f over R^n (deterministic Nelder-Mead; n is small: the profile's free time constants)."""
    n = len(x0)
    pts = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    vals = [f(x) for x in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < 1e-12:
            break
        c = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        towards = lambda a: [cj + a * (w - cj) for cj, w in zip(c, pts[-1])]
        r = towards(-1.0)
        fr = f(r)
        if fr < vals[0]:
            e = towards(-2.0)
            fe = f(e)
            pts[-1], vals[-1] = (e, fe) if fe < fr else (r, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = r, fr
        else:
            k = towards(0.5)
            fk = f(k)
            if fk < vals[-1]:
                pts[-1], vals[-1] = k, fk
            else:  # shrink towards the best point
                pts = [pts[0]] + [[a + 0.5 * (b - a) for a, b in zip(pts[0], q)] for q in pts[1:]]
                vals = [vals[0]] + [f(q) for q in pts[1:]]
    return pts[min(range(n + 1), key=vals.__getitem__)]


# The time model's free constants on a CPU+gloo machine, and where a fit starts when the profile has 0.
FIT_TIME_FIELDS = {"compute_efficiency": 0.5, "a2a_call_s": 1e-4, "p2p_call_s": 1e-4, "step_overhead_s": 1e-3}


def fit_profile(measured_rows: list[dict], cfg: Config, hardware: str | Hardware,
                opts: PlanOptions | None = None, fields: dict[str, float] | None = None) -> Hardware:
    """The profile with its free time constants fitted to measured step times, and its per-rank memory
    reserve fitted to measured peak memory (rows as `calibrate` takes them).

    Time: minimise the sum over rows of log(predicted / measured)^2 over the log of each constant in
    `fields` (all positive), so every row weighs by its relative error. Memory: the reserve becomes the
    median over ranks of (measured peak - predicted tensor bytes): what a process holds besides the model's
    tensors (interpreter, torch, gloo, checkpoint imports, data, allocator slack)."""
    hw = get_hardware(hardware)
    opts = opts or PlanOptions()
    fields = FIT_TIME_FIELDS if fields is None else fields
    lays = [_layout_of(r, cfg) for r in measured_rows]
    cfgs = [layout_config(cfg, lay) for lay in lays]
    shape = ModelShape.from_config(cfg, **opts.shape_extra)
    meas = [float(r["step_time_s"]) for r in measured_rows]
    x0 = [math.log(getattr(hw, k) or v) for k, v in fields.items()]

    def with_x(x):
        return dataclasses.replace(hw, **{k: math.exp(v) for k, v in zip(fields, x)})

    def loss(x):
        h = with_x(x)
        return sum(math.log(predict(c, lay, h, opts, shape).step_time_s / y) ** 2
                   for c, lay, y in zip(cfgs, lays, meas))

    hw = with_x(_nelder_mead(loss, x0)) if fields else hw
    extra = []
    for r, c, lay in zip(measured_rows, cfgs, lays):
        pred = predict(c, lay, hw, opts, shape)
        mem = r["peak_mem_bytes"]
        if isinstance(mem, (list, tuple)):  # per global rank: its stage's prediction
            pairs = [(x, pred.mem_by_stage[(g // lay.ep) % lay.pp]) for g, x in enumerate(mem)]
        else:  # the max over ranks: the heaviest stage
            pairs = [(mem, pred.peak_mem)]
        extra += [float(x) - (t - hw.mem_reserved_bytes) for x, t in pairs]
    fitted = ", ".join(f"{k} {getattr(hw, k):.3g}" for k in fields)
    return dataclasses.replace(hw, mem_reserved_bytes=statistics.median(extra), name=f"{hw.name}-calibrated",
                               source=f"{hw.source}; calibrated on {len(measured_rows)} measured layouts "
                                      f"({fitted}, reserve {statistics.median(extra) / 2**20:.0f} MiB)")


def calibration_rows(path: str) -> list[dict]:
    """The rows of a `nanotitan bench layouts` JSON, with peak memory per global rank as `calibrate` takes it."""
    data = json.loads(Path(path).read_text())
    return [dict(r, peak_mem_bytes=r.get("peak_mem_per_rank", r.get("peak_mem_bytes", r.get("peak_mem_max"))))
            for r in data["rows"]]


def format_calibration(result: dict) -> str:
    lines = ["| layout | predicted step (ms) | measured step (ms) | error | predicted mem (MiB) | "
             "measured mem (MiB) | mem error | predicted dominant |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['layout']} | {1e3 * r['pred_step_s']:.1f} | {1e3 * r['meas_step_s']:.1f} | "
                     f"{100 * r['step_err']:+.0f}% | {r['pred_mem'] / 2**20:.0f} | {r['meas_mem'] / 2**20:.0f} | "
                     f"{100 * r['mem_err']:.0f}% | {r['dominant']} |")
    lines.append(f"\nmedian |error|: step {100 * result['median_abs_err_step']:.1f}%, memory "
                 f"{100 * result['median_abs_err_mem']:.1f}%; Spearman rho (step time) {result['spearman_rho']:.2f}; "
                 f"measured/predicted step time {result['median_time_ratio']:.2f}")
    return "\n".join(lines)


# --- CLI -------------------------------------------------------------------------------------------
def format_table(preds: list[Prediction], top: int) -> str:
    lines = ["| # | dp | pp | ep | schedule | M | m | tokens/s | step (ms) | mem/rank (GiB) | fits | dominant cost |",
             "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for i, p in enumerate(preds[:top], 1):
        L = p.layout
        lines.append(f"| {i} | {L.dp} | {L.pp} | {L.ep} | {L.schedule if L.pp > 1 else '-'} | {L.microbatches} | "
                     f"{L.micro_batch} | {p.tokens_per_sec:,.0f} | {1e3 * p.step_time_s:,.1f} | "
                     f"{p.peak_mem / GiB:.2f} | {'yes' if p.fits else 'NO'} | {p.dominant} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="nanotitan plan", description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="TOML config (model, train.seq_len, global batch = dp*ep*M*m)")
    ap.add_argument("--gpus", type=int, help="world size N to plan for (ranks on CPU)")
    ap.add_argument("--nodes", type=int, default=0, help="nodes the N ranks fill in order (default: by the profile)")
    ap.add_argument("--hardware", default="auto", help="built-in profile name or a JSON profile file (auto: detect)")
    ap.add_argument("--measure", action="store_true", help="measure this machine and write a profile to --out")
    ap.add_argument("--calibrate", default="", metavar="LAYOUTS_JSON",
                    help="fit --hardware's time constants and memory reserve to `nanotitan bench layouts` output "
                         "(with its --config) and write the calibrated profile to --out")
    ap.add_argument("--out", default="", help="with --measure/--calibrate: profile JSON path; else: also write the table there")
    ap.add_argument("--top", type=int, default=15, help="rows of the ranked table to print")
    ap.add_argument("--global-batch", type=int, default=0, help="sequences per step (default: the config's dp*ep*M*m)")
    ap.add_argument("--micro-batch", type=int, default=0, help="keep m fixed (default: free)")
    ap.add_argument("--precision", default="", choices=["", *PRECISIONS], help="state/activation bytes (default: train.dtype)")
    ap.add_argument("--zero1", action="store_true", help="shard master weights + moments over DP (not in the trainer yet)")
    ap.add_argument("--activation-checkpointing", choices=["config", "true", "false"], default="config")
    ap.add_argument("--ep-overlap", type=float, default=0.0, help="fraction of all-to-all hidden by compute (0: ours)")
    ap.add_argument("--first-dense", type=int, default=0, help="first k layers dense (models beyond our Transformer)")
    ap.add_argument("--dense-ffn", type=int, default=0, help="hidden size of dense FFN layers (default model.ffn_dim)")
    ap.add_argument("--shared-experts", type=int, default=0, help="always-on experts per MoE layer")
    args, overrides = ap.parse_known_args(argv)
    try:
        if args.measure:
            from .plan_measure import measure_hardware  # spawns processes: imported only when asked

            out = args.out or "hardware.json"
            hw = measure_hardware(out)
            print(f"wrote {out}: {hw.name}, GEMM {hw.gemm_flops_by_threads}, all-reduce {hw.intra.allreduce_bw / 1e9:.2f} "
                  f"GB/s, reserve {hw.mem_reserved_bytes / 2**20:.0f} MiB")
            return 0
        if args.calibrate:
            if args.hardware == "auto" or not args.out:
                raise ConfigError("--calibrate needs --hardware PROFILE (the profile to fit) and --out NEW_PROFILE")
            cfg = load_config(args.config, overrides)  # the config `bench layouts` ran
            rows = calibration_rows(args.calibrate)
            hw = fit_profile(rows, cfg, args.hardware)
            save_hardware(hw, args.out)
            res = calibrate(rows, cfg, hw)
            print(f"wrote {args.out}: {hw.source}\n\n{format_calibration(res)}")
            return 0
        if not args.gpus:
            raise ConfigError("nanotitan plan needs --gpus N (the world size to plan for)")
        cfg = load_config(args.config, overrides)
        hw = detect_hardware() if args.hardware == "auto" else get_hardware(args.hardware)
        extra = {k: v for k, v in (("first_dense", args.first_dense), ("dense_ffn_dim", args.dense_ffn),
                                   ("n_shared_experts", args.shared_experts)) if v}
        ac = None if args.activation_checkpointing == "config" else args.activation_checkpointing == "true"
        opts = PlanOptions(precision=args.precision, zero1=args.zero1, activation_checkpointing=ac,
                           global_batch=args.global_batch, micro_batch=args.micro_batch, nodes=args.nodes,
                           ep_overlap=args.ep_overlap, shape_extra=extra)
        preds = plan(cfg, args.gpus, hw, opts)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not preds:
        print(f"error: no valid layout of {args.gpus} ranks for this config and global batch", file=sys.stderr)
        return 2
    shape = ModelShape.from_config(cfg, **extra)
    B = opts.global_batch or cfg.global_batch
    head = (f"{shape.total_params() / 1e9:.3g}B params, {B} x {shape.seq_len} tokens/step on {args.gpus} x {hw.name} "
            f"({len(preds)} layouts, {sum(p.fits for p in preds)} fit)")
    best = preds[0].layout
    rec = (f"Recommended: {best.short()} — {reason(preds)}\n  --parallel.dp {best.dp} --parallel.pp {best.pp} "
           f"--parallel.ep {best.ep} --parallel.schedule {best.schedule} --parallel.microbatches {best.microbatches} "
           f"--train.micro_batch {best.micro_batch}")
    text = f"{head}\n\n{format_table(preds, args.top)}\n\n{rec}\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
