"""Start-of-training agreement between replicas: broadcast parameters, and a cheap check that they agree.

Params are initialised by global identity (docs/design.md §4), so replicas already agree; the broadcast from
the first rank of each DP group is the seed's belt and braces, and `check_replicas` (debug option
parallel.check_replicas) proves it, or catches a divergence later in training.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .comm import collectives as comm

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32}


@torch.no_grad()
def broadcast_params(named_params: list[tuple[str, nn.Parameter]], src_global_rank: int, group) -> None:
    """Overwrite every param with its value on global rank `src_global_rank` (a member of `group`).

    One flat broadcast per dtype instead of one per tensor (launch cost dominates small tensors).
    """
    if group is None:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for _, p in named_params:
        by_dtype.setdefault(p.dtype, []).append(p.data)
    for tensors in by_dtype.values():
        flat = _flatten_dense_tensors(tensors)
        comm.broadcast(flat, src=src_global_rank, group=group, axis="other")
        for t, v in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            t.copy_(v)


def _checksums(p: torch.Tensor) -> torch.Tensor:
    """Two exact, order-independent integer checksums of a tensor's bit pattern."""
    flat = p.detach().reshape(-1)
    bits = flat.view(_INT_VIEW[p.element_size()]) if p.element_size() in _INT_VIEW else flat.view(torch.int64)
    bits = bits.to(torch.int64)
    return torch.stack([bits.sum(), bits[1::2].sum()])


@torch.no_grad()
def check_replicas(named_params: list[tuple[str, nn.Parameter]], group) -> bool:
    """True iff every param is bitwise identical on all ranks of `group` (same answer on every rank).

    One all-reduce(MAX) of [checksums, -checksums]: max == -max(-x) = min only when all ranks agree.
    """
    if group is None or not named_params:
        return True
    sums = torch.cat([_checksums(p) for _, p in named_params])
    both = torch.cat([sums, -sums])
    comm.all_reduce(both, group=group, axis="other", op=dist.ReduceOp.MAX)
    n = sums.numel()
    return bool(torch.equal(both[:n], -both[n:]))
