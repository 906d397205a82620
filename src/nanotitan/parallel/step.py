"""One training step's mechanics on one rank, for any layout.

    forward_backward  M microbatches through this rank's stage, as its sync flavour runs them (a pipeline schedule,
                      pp/schedules.py: plain gradient accumulation when pp == 1; torch DDP's own loop), the gradient
                      sync launched during the final backward
    finish_grads      wait for the gradient sync: .grad (or the ZeRO shards) hold the averaged gradients
    clip_grads        global-norm clipping over the whole model (PP stages and EP shards counted once)
    after_update      after the optimizer step: full params again (ZeRO-1/2), gradients zeroed
    evaluate          forward-only pass of fixed batches through the pipeline, mean CE over the world
    reduce_losses     the step's CE, balance and multi-token-prediction (model/mtp.py) losses, averaged over all
                      DP*EP*M microbatches in one all-reduce (on the steps that write a record)
    update_router_bias  aux-loss-free balancing after the optimizer step, from the step's global expert counts

What depends on the DP flavour is a method of `shard.sync` (sync.py); the schedule is pp/schedules.py's. Loss
normalisation (DESIGN §4): every rank backwards loss_mb / M; the gradient sync scales by 1/(DP*EP) and
sums over the parameter's group. The stage's P2P endpoints (`StageComms`, with their reusable receive
buffers) live on the ModelShard, one per activation shape, built here on first use.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from .comm import collectives as comm
from .ep import lanes_of
from .parallelize import ModelShard
from .pp.schedules import StepStats, pipeline_forward, pipeline_forward_backward
from .pp.comms import StageComms


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


def split_microbatches(x: torch.Tensor, y: torch.Tensor, m: int, device: torch.device):
    """This data rank's b rows -> M microbatches of m sequences, on the device."""
    x, y = x.to(device), y.to(device)
    return list(x.split(m)), list(y.split(m))


def forward_backward(shard: ModelShard, xs: list[torch.Tensor], ys: list[torch.Tensor], *, schedule: str,
                     aux_weight: float, device: torch.device, dtype: str = "fp32") -> StepStats:
    """Forwards and backwards of this rank's M microbatches, gradients accumulated into .grad and their
    sync launched during the final backward. ce_sum (last stage) and aux_sum are sums over microbatches."""
    forward_ctx = functools.partial(autocast, device, dtype)  # around each microbatch's forward only

    def pipeline() -> StepStats:
        return pipeline_forward_backward(shard.model, shard.dims, xs, ys, comms=stage_comms(shard, xs, device, dtype),
                                         schedule=schedule, aux_weight=aux_weight, loss_scale=1.0 / len(xs),
                                         before_backward=shard.sync.prepare, autocast=forward_ctx,
                                         ep_lanes=lanes_of(shard.model) if shard.ep_lanes else None)
    return shard.sync.forward_backward(pipeline, xs, ys, aux_weight, forward_ctx)


def finish_grads(shard: ModelShard) -> None:
    """Wait for the gradient sync (DDP finished inside its last backward); then MTP's embedding replica and stage 0's
    copy sum their gradients (tied.py). Replicated experts (parallel/rebalance.py): their fold's DP traffic is
    posted first, behind the buckets still on the wire."""
    if shard.rebalancer is not None:
        shard.rebalancer.start_replica_sum()
    shard.sync.finish()
    if shard.tied is not None:
        shard.tied.sum_grads(shard.sync)


def clip_grads(shard: ModelShard, max_norm: float, sq_offset: torch.Tensor | None = None) -> torch.Tensor:
    """Clip to the global norm of the whole model (0 = only measure); returns that norm on every rank. MTP's
    embedding replica then takes stage 0's clipped gradient (tied.py). sq_offset: this rank's part of what leaves
    the squared norm (replicated experts' extra copies, parallel/rebalance.py; clip.py sums it over the ranks)."""
    norm = shard.sync.clip(max_norm) if sq_offset is None else shard.sync.clip(max_norm, sq_offset)
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


def update_router_bias(shard: ModelShard, apply: bool = True) -> None:
    """Once per optimizer step (after it): every MoE layer with a router bias moves it by gamma * sign(mean load -
    load), load = its tokens per expert over the whole step. Summed over the non-expert-DP group (the dp x ep ranks
    of this stage: every data rank of its layers, all M microbatches each), so every replica applies the same
    update, and every layout the single process's. Activation-checkpoint recomputes are not counted (the model
    counts in its outer forward). A stage without such layers does nothing (nor do its group peers).
    apply=False (a skipped step, agreed by every rank) only drops the step's counts."""
    model = shard.model
    keys = [k for k, b in model.layers.items() if b.is_moe and b.moe.router_bias is not None]
    if not keys:
        return
    counts = torch.stack([model.step_load.pop(k) for k in keys])  # (MoE layers of this stage, E), int64: exact
    if not apply:
        return
    if dist.is_initialized() and shard.dims.data_world > 1:
        comm.all_reduce(counts, group=shard.dims.group("non_expert_dp"), axis="other")
        counts = counts // shard.dims.cp  # its CP ranks each held the whole microbatch's counts (model/moe.py)
    for k, counts_E in zip(keys, counts):
        model.layers[k].moe.update_bias(counts_E)


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
class StepResult:
    """What one optimizer step (train.py's `train_step`) hands the loop."""
    stats: StepStats  # what this rank's forwards and backwards measured
    grad_norm: torch.Tensor  # the global norm before clipping, the same on every rank
    lr: float
    nonfinite: bool  # agreed by every rank: the step made no update anywhere
    stop: bool  # agreed by every rank: a stop was asked (train.ckpt_on_signal)
    losses: StepLosses | None  # on the steps that write a record, else None (no collective)
    qk_max: float | None = None  # train.qk_clip: the step's largest attention logit, every head, every rank


@torch.no_grad()
def evaluate(shard: ModelShard, batches, m: int, device: torch.device, dtype: str = "fp32") -> float:
    """Mean CE over this data rank's `batches` ((x, y) of b rows each) and over every data rank: a forward-only
    pass through the pipeline (no balance loss). The MoE load statistics of training are left untouched."""
    model, dims = shard.model, shard.dims
    saved_load = dict(model.expert_load)
    model.eval()
    total, n = torch.zeros((), device=device), 0
    with autocast(device, dtype):
        for xb, yb in batches:
            xs, ys = split_microbatches(xb, yb, m, device)
            ce_sum, _ = pipeline_forward(model, dims, xs, ys, comms=stage_comms(shard, xs, device, dtype))
            if ce_sum is not None:  # last stage
                total += ce_sum
            n += len(xs)
    model.train()
    model.expert_load.clear()
    model.expert_load.update(saved_load)
    if dist.is_initialized() and dims.world_size > 1:
        comm.all_reduce(total, axis="other")  # only last-stage ranks contribute
    return total.item() / (n * dims.data_world * dims.loss_copies)
