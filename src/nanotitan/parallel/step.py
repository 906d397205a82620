"""One training step's mechanics on one rank, for any layout.

    forward_backward  M microbatches through this rank's stage, as its sync flavour runs them (a pipeline schedule,
                      pp/schedules.py: plain gradient accumulation when pp == 1; torch DDP's own loop), the gradient
                      sync launched during the final backward; the result carries each MoE layer's routing counts
                      per microbatch
    finish_grads      wait for the gradient sync: .grad (or the ZeRO shards) hold the averaged gradients (a
                      replicated expert's copies summed inside it: the sync's own finish)
    clip_grads        global-norm clipping over the whole model (PP stages and EP shards counted once)
    after_update      after the optimizer step: full params again (ZeRO-1/2), gradients zeroed
    StepEnd           after the update, from the step's routing counts: the router biases (aux-loss-free balancing),
                      the experts' placement window, QK-clip; on a record's step the losses (`reduce_losses`) and
                      the router's figures over the world: at most three small collectives (with agree_on_step's
                      stop flag, four: every small collective of a step is issued in this module)
    evaluate          forward-only pass of fixed batches through the pipeline, mean CE over the world

What depends on the DP flavour is a method of `shard.sync` (sync.py); the schedule is pp/schedules.py's. Loss
normalisation (docs/design.md §4): every rank backwards loss_mb / M; the gradient sync scales by 1/(DP*EP) and
sums over the parameter's group. The stage's P2P endpoints (`StageComms`, with their reusable receive
buffers) live on the ModelShard, one per activation shape, built here on first use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from ..config.config import ConfigError
from ..model.tokens import IGNORE, loss_targets
from ..model.transformer import is_moe_layer, take_routing
from .comm import collectives as comm
from .ep import lanes_of, take_received, worst_case_capacity
from .parallelize import ModelShard
from .pp.schedules import StepStats, pipeline_forward, pipeline_forward_backward
from .pp.comms import StageComms

MB_KEPT = 1024  # microbatch records per MoE layer a record's routing skew reads (the last ones; bounded, so a run that
#                 never logs holds no more)


def compute_dtype(dtype: str) -> torch.dtype:
    """The dtype of the forward's GEMMs, and of what travels between ranks (PP activations, EP payloads)."""
    return torch.bfloat16 if dtype == "bf16" else torch.float32


def autocast(device: torch.device, dtype: str):
    """bf16 autocast (CPU or CUDA) for a forward; a no-op for fp32. Enter it around forwards only: the AMP docs
    advise running the backward outside it (autograd already replays each op in its forward's dtype).
    Parameters, gradients and optimizer state stay fp32; the router and the cross-entropy opt out (fp32)."""
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def stage_comms(shard: ModelShard, xs: list[torch.Tensor], device: torch.device, dtype: str = "fp32") -> StageComms:
    """This stage's P2P endpoints for microbatches shaped like xs[0] (m, S): activations (m, S, D) and their
    gradients travel in the compute dtype (bf16 halves the bytes; each stage's residual stream stays fp32)."""
    m, S = xs[0].shape
    S = shard.tokens.stream_len(S)  # sequence parallel: a stage's residual stream may be a sequence shard
    act_shape, wire = (m, S, shard.model.cfg.d_model), compute_dtype(dtype)
    key = (act_shape, wire, str(device))
    if key not in shard.comms:
        shard.comms[key] = StageComms(shard.dims, act_shape, wire, device)
    return shard.comms[key]


def split_microbatches(x: torch.Tensor, y: torch.Tensor, m: int, device: torch.device,
                       docs: torch.Tensor | None = None):
    """This data rank's b rows -> M microbatches of m sequences, on the device; with `docs` (the rows' document
    starts, model/docs.py) also theirs: (xs, ys, ds), ds None per microbatch without."""
    x, y = x.to(device), y.to(device)
    xs, ys = list(x.split(m)), list(y.split(m))
    return xs, ys, list(docs.to(device).split(m)) if docs is not None else [None] * len(xs)


def forward_backward(shard: ModelShard, xs: list[torch.Tensor], ys: list[torch.Tensor], *, schedule: str,
                     aux_weight: float, device: torch.device, dtype: str = "fp32", docs: list | None = None,
                     masked: bool = False) -> StepStats:
    """Forwards and backwards of this rank's M microbatches, gradients accumulated into .grad and their
    sync launched during the final backward. ce_sum (last stage) and aux_sum are sums over microbatches.
    docs: each microbatch's document starts (model.attn_mask=doc) or None; masked: the targets may be masked
    (SFT's prompts: model/tokens.py MASKED), so each microbatch's CE is weighted by its share of the global batch's
    targets."""
    forward_ctx = functools.partial(autocast, device, dtype)  # around each microbatch's forward only
    weights = target_weights(shard.dims, ys) if masked else None

    def pipeline() -> StepStats:
        return pipeline_forward_backward(shard.model, shard.dims, xs, ys, comms=stage_comms(shard, xs, device, dtype),
                                         schedule=schedule, aux_weight=aux_weight, loss_scale=1.0 / len(xs),
                                         before_backward=shard.sync.prepare, autocast=forward_ctx,
                                         ep_lanes=lanes_of(shard.model) if shard.ep_lanes else None, docs=docs,
                                         weights=weights)
    stats = shard.sync.forward_backward(pipeline, xs, ys, aux_weight, forward_ctx, docs, weights)
    stats.routing = take_routing(shard.model)  # the training forwards' records, read once (never a recompute's)
    stats.routing.received = take_received(shard.model, stats.routing.keys)
    return stats


def target_weights(dims, ys: list[torch.Tensor]) -> list[float]:
    """Per microbatch i, the factor on its mean CE that makes the step's loss the sum of CE over the unmasked targets
    of the whole global batch over their count N: n_i * M * DW / N, n_i its targets (its CP ranks' together), DW the
    data ranks. Every rank backwards its microbatch's term / M and the sync averages over DW, so the step trains
    sum CE / N whatever the layout; the record's loss (`reduce_losses`) is that figure. Without masked targets every
    factor is exactly 1. The counts come from the global batch: one all-reduce over CP, one over the data ranks x
    CP (every pipeline stage and TP rank holds the same targets and counts alike)."""
    M = len(ys)
    # (M,) this rank's targets of each microbatch
    local = torch.stack([(loss_targets(y) != IGNORE).sum() for y in ys]).double()
    whole = local.clone()
    if dims.group("cp") is not None:  # None: this rank alone holds its sequences
        comm.all_reduce(whole, group=dims.group("cp"), axis="cp")
    total = local.sum().reshape(1)
    if dims.group("non_expert_dp") is not None:  # the data ranks (dp x ep) and their CP ranks
        comm.all_reduce(total, group=dims.group("non_expert_dp"), axis="dp")
    n = total.item()  # the same on every rank: all raise alike
    if n == 0:
        raise ConfigError("a global batch has no target token: every position's loss is masked (SFT responses "
                          "empty or truncated away?); lengthen --train.seq_len or check the data's responses")
    return (whole * (M * dims.data_world / n)).tolist()


def finish_grads(shard: ModelShard) -> None:
    """Wait for the gradient sync (DDP finished inside its last backward); then MTP's embedding replica and stage 0's
    copy sum their gradients (tied.py)."""
    shard.sync.finish()
    if shard.tied is not None:
        shard.tied.sum_grads(shard.sync)


def clip_grads(shard: ModelShard, max_norm: float) -> torch.Tensor:
    """Clip to the global norm of the whole model (0 = only measure); returns that norm on every rank. MTP's
    embedding replica then takes stage 0's clipped gradient (tied.py)."""
    norm = shard.sync.clip(max_norm)
    if shard.tied is not None:
        shard.tied.share_clipped(shard.sync)
    return norm


def after_update(shard: ModelShard) -> None:
    """After the optimizer step (or a skipped one): at zero 1/2 all-gather the updated shards, so every rank
    holds the full params again (next forward, eval, checkpoints); then zero the gradients, kept bound to
    their buffers (the Reducer's flat buckets, FSDP's sharded grads)."""
    shard.sync.after_step()
    shard.sync.zero_grad()


def agree_on_step(shard: ModelShard, grad_norm: torch.Tensor, stop_requested: bool, device: torch.device,
                  signals: bool) -> tuple[bool, bool]:
    """(non-finite, stop), the same on every rank, before the update.

    Non-finite needs no collective of its own: a NaN/inf loss anywhere makes its gradients non-finite, the
    gradient sync carries them to every replica and the pipeline's input gradients to every earlier stage,
    and clipping sums the norm over PP and EP, so the global grad norm is already the same verdict on every
    rank (an extra world all-reduce per step cost ~12% of the default 8-rank step here). The stop flag (a
    SIGTERM seen by one rank) does need one MAX all-reduce, paid only with `signals` (train.ckpt_on_signal)."""
    nonfinite = not bool(torch.isfinite(grad_norm.reshape(())))  # the step's one host sync
    if not signals:
        return nonfinite, False
    flag = torch.tensor([float(stop_requested)], device=device)  # NCCL needs a device tensor
    if dist.is_initialized() and shard.dims.world_size > 1:
        comm.all_reduce(flag, op=dist.ReduceOp.MAX, axis="other")
    return nonfinite, bool(flag.item())


def replay_on_overflow(run: Callable[[], "StepResult"], shard: ModelShard, static: bool, qk) -> "StepResult":
    """`run()`, the step; under parallel.ep_dispatch static a non-finite one again, once, with buffers no source can
    overflow (`ep.worst_case_capacity`). An overflowing rank's MoE output is NaN (`EPDispatcher._static`), so the
    step's one host read, the finiteness verdict, is also the overflow flag, agreed by every rank and costing no read
    of its own. The replay is exact: the same batch (the caller's), the same RNG state and the same weights and
    optimizer state (a non-finite step updates nothing; its gradients were zeroed, its routing records are replaced
    by the replay's, `qk`'s max logits dropped). A replay non-finite again was non-finite for another reason: the
    step is skipped as any other (train.on_nonfinite)."""
    if not static:
        return run()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    rng = torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None
    result = run()
    if not result.nonfinite:
        return result
    torch.set_rng_state(rng[0])
    if cuda:
        torch.cuda.set_rng_state(rng[1])
    qk.table()  # drops the first try's max logits (NaN past the overflowing layer)
    with worst_case_capacity(shard.model):
        return dataclasses.replace(run(), replayed=True)


class StepLosses(NamedTuple):
    """A step's losses, each the mean over all DP*EP*M microbatches (the record's ce_loss, aux_loss, mtp_loss)."""
    ce: float
    aux: float  # the balance (and z) losses, weighted: aux_weight * their sum
    mtp: float | None  # mtp_coef * the MTP loss; None without MTP (no mtp_loss field)


def reduce_losses(shard: ModelShard, stats: StepStats, aux_weight: float, M: int, mtp: bool = False) -> StepLosses:
    """The step's losses over the world: CE and the weighted MTP term come from the last stage, aux from every
    stage, and one all-reduce of [ce, aux, mtp] sums them (the same three slots in every run: a run without MTP
    sends a zero in the third). Costs a host sync."""
    zero = torch.zeros_like(stats.aux_sum)
    vals = torch.stack([stats.ce_sum if stats.ce_sum is not None else zero, stats.aux_sum,
                        stats.mtp_sum if stats.mtp_sum is not None else zero])
    if dist.is_initialized() and shard.dims.world_size > 1:
        comm.all_reduce(vals, axis="other")
    ce, aux, mtp_sum = vals.tolist()
    n = M * shard.dims.data_world * shard.dims.loss_copies  # every microbatch's loss, as often as ranks hold it
    n_aux = M * shard.dims.data_world * shard.dims.stat_copies  # the router losses: whole on every token rank
    return StepLosses(ce / n, aux_weight * aux / n_aux, mtp_sum / n if mtp else None)


@dataclass
class RouterFigures:
    """A record's router figures since the previous record, summed over the world (`StepEnd`): report.py formats
    them (observe/report.py `router_record`)."""
    rows: torch.Tensor  # (n_layers + mtp_layers, E + 5) float64, per global layer: tokens per expert | summed
    #                     MoE.last_router_stats [balance, z, dropped, assignments, forwards]
    skew: list[float]  # sums and counts: [expert CV, n, EP busiest/mean received, n, the same placed, n]
    biases: list[list[float]] | None  # every MoE layer's router bias after this step (model.bias_update_rate > 0)


@dataclass
class StepResult:
    """What one optimizer step (train.py's `train_step`) hands the loop."""
    stats: StepStats  # what this rank's forwards and backwards measured, its routing counts included
    grad_norm: torch.Tensor  # the global norm before clipping, the same on every rank
    lr: float
    nonfinite: bool  # agreed by every rank: the step made no update anywhere
    stop: bool  # agreed by every rank: a stop was asked (train.ckpt_on_signal)
    losses: StepLosses | None = None  # on the steps that write a record, else None (no collective)
    qk_max: float | None = None  # train.qk_clip: the step's largest attention logit, every head, every rank
    router: RouterFigures | None = None  # on the steps that write a record
    peak: int | None = None  # on a record's step after a metered one: the highest step peak of any rank (bytes)
    host_syncs: int | None = None  # likewise: the most host reads any rank's latest metered step made
    replayed: bool = False  # parallel.ep_dispatch static: the step overflowed a buffer and ran again


class StepEnd:
    """What follows a step's update on every rank, from the step's routing counts (`StepStats.routing`): the router
    biases (aux-loss-free balancing: `MoE.update_bias`), the experts' placement window (shard.rebalancer), QK-clip
    (`qk`: optim/qk_clip.py's QKClip, handed in); on a record's step (train.py's `logs`, or a non-finite one) the
    losses and the router's figures since the previous record over the world, and the interval's step peak.

    Every small collective of a step's figures, at most three (agree_on_step's stop flag aside), over the world: the
    losses' SUM (fp32, `reduce_losses`: a record's), one packed SUM in float64 (exact for counts: this step's counts
    for the biases, the window's at its
    end, a record's loads, router statistics and routing-skew sums) and one packed MAX (the QK-clip table, a record's
    biases after their update and its step peak). Each MoE layer's row is its global index, filled by the stage that
    holds it; counts are whole on every token rank (TP, CP: dims.stat_copies), which the sums divide out. Collective:
    every rank calls it after every step, and every rank packs the same parts."""

    def __init__(self, shard: ModelShard, cfg, aux_weight: float, qk):
        self.shard, self.aux_weight, self.qk = shard, aux_weight, qk
        self.M, self.mtp = cfg.parallel.microbatches, cfg.model.mtp_layers > 0
        self.rows, self.E = cfg.model.n_layers + cfg.model.mtp_layers, cfg.model.num_experts
        self.moe_rows = [i for i in range(self.rows) if is_moe_layer(cfg.model, i)]
        self.biased = cfg.model.bias_update_rate > 0 and bool(self.moe_rows)  # the same on every rank
        # this rank's routing since the previous record: tokens per expert and the router statistics per global layer
        # (summed forward by forward, in order), and per step each microbatch's counts and, under EP, its EP group's
        # received assignments per expert, (layers, microbatches, E)
        self.device = next(shard.model.parameters()).device  # NCCL: the figures stay on the GPU, no host sync
        self.loads = torch.zeros(self.rows, self.E, dtype=torch.long, device=self.device)
        self.stats = torch.zeros(self.rows, 5, device=self.device)
        self.counts: list[torch.Tensor] = []
        self.received: list[torch.Tensor] = []

    def __call__(self, step: int, result: StepResult, optimizer, record: bool,
                 peak_of: Callable[[], int | None], syncs_of: Callable[[], int | None] = lambda: None) -> StepResult:
        """`result` of step `step` (0-based) with its figures: on a record's step its losses, router figures and step
        peak (`peak_of()`: this rank's highest since the previous record, this step's so far included; None: no
        metered step) and host reads (`syncs_of()`: this rank's latest metered step's, observe/host_syncs.py), both
        maximised over the world, and with train.qk_clip the step's max logit."""
        routing, rebalancer, dims = result.stats.routing, self.shard.rebalancer, self.shard.dims
        at = [int(k) for k in routing.keys]
        step_E = routing.counts.sum(1)  # (layers, E) int64: this step's tokens per expert
        self._tally(routing, at)
        window = rebalancer.count(routing.keys, step_E, step)  # the window's counts when it closes, else None
        losses = reduce_losses(self.shard, result.stats, self.aux_weight, self.M, self.mtp) if record else None

        # one packed SUM: the step's counts (router biases), the window's (placement), a record's figures
        sums = _reduce(([self._rows(at, step_E)] if self.biased else [])
                       + ([self._rows([int(k) for k in rebalancer.keys], window)] if window is not None else [])
                       + (self._record_parts(routing.keys) if record else []), dist.ReduceOp.SUM, dims)
        if self.biased:
            counts = sums.pop(0).long() // dims.stat_copies  # every token rank held the whole microbatch's counts
            if not result.nonfinite:  # a skipped step moves no bias
                for key, i in zip(routing.keys, at):
                    self.shard.model.layers[key].moe.update_bias(counts[i])
        if window is not None:  # the window's end: the next placements, and a move if any layer changed
            counts = sums.pop(0).long() // dims.stat_copies
            rebalancer.close_window(step, counts[[int(k) for k in rebalancer.keys]], optimizer)
        router = RouterFigures(sums[0], sums[1].tolist(), None) if record else None

        # one packed MAX: QK-clip's table (every step), a record's biases after their update and its step peak
        table = self.qk.table()  # this rank's heads' max logits of the step per global layer (None: no QK-clip)
        peak = peak_of() if record else None  # the step's move included (QK-clip's rescale, after it, holds little)
        syncs = syncs_of() if record else None
        maxima = _reduce(([table.double()] if table is not None else [])
                         + ([self._biases()] if record and self.biased else [])
                         + ([torch.tensor([float(peak)], dtype=torch.float64, device=self.device)]
                            if record and peak is not None else [])
                         + ([torch.tensor([float(syncs)], dtype=torch.float64, device=self.device)]
                            if record and syncs is not None else []), dist.ReduceOp.MAX, dims)
        qk_max = None
        if table is not None:  # the heads over tau scaled back (not on a skipped step)
            table = maxima.pop(0).float()
            self.qk.rescale(table, apply=not result.nonfinite)
            qk_max = float(table.max())
        if record and self.biased:
            router.biases = maxima.pop(0)[self.moe_rows].tolist()
        peak = int(maxima.pop(0).item()) if record and peak is not None else None
        syncs = int(maxima.pop(0).item()) if record and syncs is not None else None
        return dataclasses.replace(result, losses=losses, qk_max=qk_max, router=router, peak=peak, host_syncs=syncs)

    def _tally(self, routing, at: list[int]) -> None:
        """This step's routing joins the record's interval (no collective)."""
        if not at:
            return
        self.loads[at] += routing.counts.sum(1)
        for i in range(routing.stats.shape[1]):  # forward by forward: the sums a record has always held
            self.stats[at] = self.stats[at] + routing.stats[:, i]
        self.counts = _last(self.counts + [routing.counts])
        if routing.received is not None:
            self.received = _last(self.received + [routing.received])

    def _rows(self, at: list[int], values: torch.Tensor) -> torch.Tensor:
        """(rows, E) float64: `values`' rows at the global layers `at`, zeros elsewhere."""
        out = torch.zeros(self.rows, self.E, dtype=torch.float64, device=self.device)
        out[at] = values.to(self.device, torch.float64)
        return out

    def _record_parts(self, keys: list[str]) -> list[torch.Tensor]:
        """A record's parts of the SUM, this rank's since the previous record (then reset): per global layer its tokens
        per expert and summed router statistics (rows, E + 5); and the routing skew's sums over this rank's MoE
        layers and microbatches (the last MB_KEPT of each): [expert CV (over experts, of this rank's counts), n, EP
        group's busiest rank over the mean (received assignments, expert e on EP rank e // (E/EP): what the planner
        prices, plan/skew.py), n, the same under the placement in force (`Rebalancer.placed_skew`), n]."""
        rows = torch.cat([self.loads.double(), self.stats.double()], 1)
        skew = torch.zeros(6, dtype=torch.float64, device=self.device)
        if self.counts:  # every rank of an EP group holds the same layers and microbatches
            c = torch.cat(self.counts, 1)[:, -MB_KEPT:].double()  # (layers, microbatches, E)
            mean = c.mean(-1).clamp_min(1e-9)
            skew[0], skew[1] = (c.std(-1, unbiased=False) / mean).sum(), mean.numel()
        if self.received and self.shard.dims.ep > 1:
            g = torch.cat(self.received, 1)[:, -MB_KEPT:].double()
            recv = g.view(*g.shape[:2], self.shard.dims.ep, -1).sum(-1)  # (layers, microbatches, EP rank)
            skew[2], skew[3] = (recv.max(-1).values / recv.mean(-1).clamp_min(1e-9)).sum(), recv.shape[0] * g.shape[1]
            skew[4], skew[5] = self.shard.rebalancer.placed_skew(keys, g)
        self.loads.zero_()
        self.stats.zero_()
        self.counts, self.received = [], []
        return [rows, skew]

    def _biases(self) -> torch.Tensor:
        """(rows, E) float64: this stage's router biases at their layers' rows, -inf elsewhere (the MAX picks the
        holder's: every replica of a layer holds the same bias)."""
        out = torch.full((self.rows, self.E), -float("inf"), dtype=torch.float64, device=self.device)
        for key, block in self.shard.model.layers.items():
            if block.is_moe:
                out[int(key)] = block.moe.router_bias.double()
        return out


def _last(records: list[torch.Tensor]) -> list[torch.Tensor]:
    """(layers, microbatches, E) records, joined along the microbatches once they hold twice MB_KEPT, the last MB_KEPT
    of them kept (a run that never logs holds no more)."""
    if sum(r.shape[1] for r in records) < 2 * MB_KEPT:
        return records
    return [torch.cat(records, 1)[:, -MB_KEPT:]]


def _reduce(parts: list[torch.Tensor], op, dims) -> list[torch.Tensor]:
    """`parts` (float64) reduced over the world with `op` in ONE all-reduce, packed flat and unpacked in their
    shapes; nothing to reduce: no collective."""
    if not parts:
        return []
    flat = torch.cat([t.reshape(-1) for t in parts])
    if dist.is_initialized() and dims.world_size > 1:
        comm.all_reduce(flat, op=op, axis="other")
    return [t.view(p.shape) for t, p in zip(flat.split([p.numel() for p in parts]), parts)]


@torch.no_grad()
def evaluate(shard: ModelShard, batches, m: int, device: torch.device, dtype: str = "fp32") -> float:
    """Mean CE over this data rank's `batches` ((x, y) or (x, y, document starts) of b rows each) and over every
    data rank: a forward-only pass through the pipeline (no balance loss). Eval forwards leave no routing record
    (model/transformer.py)."""
    model, dims = shard.model, shard.dims
    model.eval()
    total, n = torch.zeros((), device=device), 0
    # static EP dispatch: buffers no routing overflows (an eval has no replay; it reads the host anyway)
    with autocast(device, dtype), worst_case_capacity(model):
        for xb, yb, *db in batches:
            xs, ys, ds = split_microbatches(xb, yb, m, device, *db)
            ce_sum, _ = pipeline_forward(model, dims, xs, ys, comms=stage_comms(shard, xs, device, dtype), docs=ds)
            if ce_sum is not None:  # last stage
                total += ce_sum
            n += len(xs)
    model.train()
    if dist.is_initialized() and dims.world_size > 1:
        comm.all_reduce(total, axis="other")  # only last-stage ranks contribute
    return total.item() / (n * dims.data_world * dims.loss_copies)
