"""Global-norm gradient clipping across the PP and EP axes, each parameter counted exactly once.

torch.nn.utils.clip_grad_norm_ sees only this rank's shard; here the norm is that of the whole
model (docs/design.md §4):
- replicated params: every PP stage owns different ones -> squared norms summed over PP;
  within a stage they are identical on every EP/DP rank after the Reducer, so counted once;
- expert shards: disjoint over EP and over PP -> summed over EP and PP; the extra copies of a replicated expert
  (expert placement: every copy holds the same gradient) count once, by their gradient layout (shard.py);
- never summed over DP: replicas hold identical gradients after the all-reduce.
Sharded DP (parallel.zero >= 1) leaves each rank a slice instead: the shard grads of ZeRO-1/2 and the
local shards of FSDP2's DTensor grads are disjoint over the non-expert-DP group (replicated params are
sharded over it; expert shards over expert-DP, and they differ over EP anyway), so their squared norms
are summed over that group, then over PP.
Call it after `Reducer.finish()`. Every rank ends with the same norm and scales by the same factor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import collectives as comm
from .shard import Grad, grad_layout


def _sq_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of all `grads` in fp32, with foreach kernels (no per-tensor host sync)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads, 2)
    return torch.linalg.vector_norm(torch.stack(norms).float()).pow(2)


def _local(g: torch.Tensor) -> torch.Tensor:
    """A DTensor grad's local shard (FSDP2; scaling it in place scales the DTensor), else the tensor."""
    return g.to_local() if hasattr(g, "to_local") else g


@torch.no_grad()
def clip_grad_norm_(expert_params, replicated_params, max_norm: float, pp_group, ep_group,
                    shard_params=(), shard_group=None, token_ranks: int = 1, shard_once=(),
                    counted_elsewhere=()) -> torch.Tensor:
    """Clip in place to global norm `max_norm` (0 = only measure); returns the global norm (0-dim tensor).

    expert_params / replicated_params: full grads as the Reducer leaves them (summed over EP, counted
    once). shard_params: sharded grads, disjoint over `shard_group` (the non-expert-DP group).
    A token shard (`token_ranks` > 1: TP, parallel/tp.py): the EP group spans its ranks, fastest (experts fold over
    EP x TP); a replicated param's slices (`Grad.SHARDED`, parallel/shard.py) add up over them, one whole on each
    counts once, and so do `shard_once`, shards that are identical over them (the caller passes `shard_group` =
    the stage group). `counted_elsewhere`: views of rows of those gradients that another rank holds too and counts
    (a replicated expert's extra copies, whose `grad_layout` names them: shard.py): their squares leave this rank's
    part, in the all-reduce that sums its expert grads (the shards' over `shard_group`, else the EP one): no
    collective of its own."""
    exp_grads = [p.grad for p in expert_params if p.grad is not None]
    split = [grad_layout(p).kind is Grad.SHARDED for p in replicated_params]
    rep_grads = [p.grad for p, s in zip(replicated_params, split) if p.grad is not None and not s]
    split_grads = [p.grad for p, s in zip(replicated_params, split) if p.grad is not None and s]
    shard_grads = [_local(p.grad) for p in shard_params if p.grad is not None]
    once_grads = [_local(p.grad) for p in shard_once if p.grad is not None]
    device = next((g.device for g in rep_grads + exp_grads + shard_grads), torch.device("cpu"))  # NCCL: GPU
    rep_sq, exp_sq, split_sq = _sq_norm(rep_grads, device), _sq_norm(exp_grads, device), _sq_norm(split_grads, device)
    if ep_group is not None:
        # One scalar all-reduce over EP: every EP rank holds the same replicated grads, so only
        # ep rank 0 contributes them (x + 0 + ... = x exactly); expert shards all add up. (Under TP the group
        # is EP x TP, the token ranks fastest: the ranks of ep rank 0 are its first token_ranks.)
        if dist.get_rank(ep_group) != 0:
            rep_sq = torch.zeros_like(rep_sq)
        if dist.get_rank(ep_group) >= token_ranks:
            split_sq = torch.zeros_like(split_sq)
    total_sq = (rep_sq + split_sq + exp_sq).reshape(1)
    sharded = bool(shard_params) or shard_group is not None
    once = torch.zeros(1, dtype=torch.float32, device=device)  # what the extra copies add, taken out again
    for v in counted_elsewhere:
        once = once + v.float().square().sum()
    if counted_elsewhere and not sharded:
        total_sq = total_sq - once
    if ep_group is not None:
        comm.all_reduce(total_sq, group=ep_group, axis="other")
    if sharded:  # every rank of the group enters the all-reduce
        shard_sq = _sq_norm(shard_grads, device).reshape(1)
        if counted_elsewhere:
            shard_sq = shard_sq - once
        if once_grads and (shard_group is None or dist.get_rank(shard_group) % token_ranks == 0):  # fastest
            shard_sq = shard_sq + _sq_norm(once_grads, device).reshape(1)
        if shard_group is not None:
            comm.all_reduce(shard_sq, group=shard_group, axis="other")
        total_sq = total_sq + shard_sq
    if pp_group is not None:
        comm.all_reduce(total_sq, group=pp_group, axis="other")
    if counted_elsewhere:  # a rounding below zero, never more
        total_sq = total_sq.clamp_min(0)
    total_norm = total_sq.sqrt().reshape(())
    if max_norm > 0:
        # Always multiply (by 1.0 when under the limit) instead of branching on a host-synced value.
        coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
        grads = rep_grads + split_grads + exp_grads + shard_grads + once_grads
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total_norm
