"""One training step's mechanics on one rank, for any layout: the only place that branches on PP or DDP.

    forward_backward  M microbatches through this rank's stage (pipeline schedule; plain gradient
                      accumulation when pp == 1), the gradient sync launched during the final backward
    finish_grads      wait for the gradient sync: .grad holds the averaged gradients
    clip_grads        global-norm clipping over the whole model (PP stages and EP shards counted once)
    zero_grads        ready for the next step
    evaluate          forward-only pass of fixed batches through the pipeline, mean CE over the world
    reduce_losses     the step's CE and balance loss, averaged over all DP*EP*M microbatches

Loss normalisation (DESIGN §4): every rank backwards loss_mb / M; the gradient sync scales by 1/(DP*EP) and
sums over the parameter's group. The stage's P2P endpoints (`StageComms`, with their reusable receive
buffers) live on the ModelShard, one per activation shape, built here on first use.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from . import comm
from .clip import clip_grad_norm_
from .parallelize import ModelShard
from .pp import StepStats, pipeline_forward, pipeline_forward_backward
from .pp_comms import StageComms


def autocast(device: torch.device, dtype: str):
    """bf16 autocast for the forward on CUDA; fp32 otherwise."""
    if dtype == "bf16" and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def stage_comms(shard: ModelShard, xs: list[torch.Tensor], device: torch.device) -> StageComms:
    """This stage's P2P endpoints for microbatches shaped like xs[0] (m, S): activations (m, S, D) in fp32."""
    m, S = xs[0].shape
    act_shape = (m, S, shard.model.cfg.d_model)
    key = (act_shape, torch.float32, str(device))
    if key not in shard.comms:
        shard.comms[key] = StageComms(shard.dims, act_shape, torch.float32, device)
    return shard.comms[key]


def split_microbatches(x: torch.Tensor, y: torch.Tensor, m: int, device: torch.device):
    """This data rank's b rows -> M microbatches of m sequences, on the device."""
    x, y = x.to(device), y.to(device)
    return list(x.split(m)), list(y.split(m))


def forward_backward(shard: ModelShard, xs: list[torch.Tensor], ys: list[torch.Tensor], *, schedule: str,
                     aux_weight: float, device: torch.device, dtype: str = "fp32") -> StepStats:
    """Forwards and backwards of this rank's M microbatches, gradients accumulated into .grad and their
    sync launched during the final backward. ce_sum (last stage) and aux_sum are sums over microbatches."""
    M = len(xs)
    with autocast(device, dtype):
        if shard.ddp is not None:
            return _ddp_forward_backward(shard, xs, ys, aux_weight)

        def before_backward(is_last: bool):
            for r in shard.reducers:
                r.prepare(sync=is_last)

        return pipeline_forward_backward(shard.model, shard.dims, xs, ys, comms=stage_comms(shard, xs, device),
                                         schedule=schedule, aux_weight=aux_weight, loss_scale=1.0 / M,
                                         before_backward=before_backward)


def _ddp_forward_backward(shard: ModelShard, xs, ys, aux_weight: float) -> StepStats:
    """torch DDP baseline (pure DP): no_sync on all but the last microbatch."""
    t0, M = time.perf_counter(), len(xs)
    ce_sum = aux_sum = None
    for i, (x, y) in enumerate(zip(xs, ys)):
        with contextlib.nullcontext() if i == M - 1 else shard.ddp.no_sync():
            ce, aux = shard.ddp(x, y)
            ((ce + aux_weight * aux) / M).backward()
        ce_sum = ce.detach() if ce_sum is None else ce_sum + ce.detach()
        aux_sum = aux.detach() if aux_sum is None else aux_sum + aux.detach()
    wall = time.perf_counter() - t0
    return StepStats(ce_sum=ce_sum, aux_sum=aux_sum, wall_s=wall, p2p_wait_s=0.0, compute_s=wall, max_in_flight=1)


def finish_grads(shard: ModelShard) -> None:
    """Wait for the gradient sync (DDP finished inside its last backward)."""
    for r in shard.reducers:
        r.finish()


def clip_grads(shard: ModelShard, max_norm: float) -> torch.Tensor:
    """Clip to the global norm of the whole model (0 = only measure); returns that norm on every rank."""
    dims = shard.dims
    return clip_grad_norm_([p for _, p in shard.expert_params], [p for _, p in shard.replicated_params],
                           max_norm, dims.group("pp"), dims.group("ep"))


def zero_grads(shard: ModelShard, optimizer: torch.optim.Optimizer) -> None:
    """Zero the gradients for the next step (the Reducer keeps .grad bound to its flat buckets)."""
    if shard.reducers:
        for r in shard.reducers:
            r.zero_grad()
    else:
        optimizer.zero_grad(set_to_none=False)


def reduce_losses(shard: ModelShard, stats: StepStats, aux_weight: float, M: int) -> tuple[float, float]:
    """(CE, weighted balance loss) of the step: means over all DP*EP*M microbatches. CE comes from the last
    stage, aux from every stage: one all-reduce over the world sums both. Costs a host sync."""
    vals = torch.stack([stats.ce_sum if stats.ce_sum is not None else torch.zeros_like(stats.aux_sum),
                        stats.aux_sum])
    if dist.is_initialized() and shard.dims.world_size > 1:
        comm.all_reduce(vals, axis="other")
    ce, aux = vals.tolist()
    n_mb = M * shard.dims.data_world
    return ce / n_mb, aux_weight * aux / n_mb


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
            ce_sum, _ = pipeline_forward(model, dims, xs, ys, comms=stage_comms(shard, xs, device))
            if ce_sum is not None:  # last stage
                total += ce_sum
            n += len(xs)
    model.train()
    model.expert_load.clear()
    model.expert_load.update(saved_load)
    if dist.is_initialized() and dims.world_size > 1:
        comm.all_reduce(total, axis="other")  # only last-stage ranks contribute
    return total.item() / (n * dims.data_world)
