"""The token embedding shared by the first and the last pipeline stage (multi-token prediction, model/mtp.py).

The MTP modules sit on the last stage, with the head, and read the token embedding there. Under PP the last stage
holds a replica of stage 0's table, as Megatron ties its input and output embeddings across stages: the same global
name (`tok_emb.weight`), hence the same initial values (init by global identity, docs/design.md §4); every step each
copy's
gradient is first averaged over its own stage's data ranks by the usual gradient sync, then the two are summed over
the pair (stage 0, last stage) of the same (dp, ep, tp) coordinates. After clipping both copies hold the single
process's gradient, bitwise the same, and the same optimizer steps keep the weights and AdamW states bitwise
identical, so a checkpoint writes one of them (DCP dedups identical pieces) and any layout reads it back into both.

The table is counted once in the global norm: the replica's gradient is zero while the norm is taken and clipped,
then it receives stage 0's clipped gradient (`share_clipped`).
Sharded DP holds the same part of the table on both ranks of a pair, so each pair sums and broadcasts that part only
(`GradSync.local_grad`): the two stages' non-expert-DP groups are alike (the pair shares its (dp, ep, tp)
coordinates, hence its rank in them), and
- zero 1/2 (zero.py) give the table a bucket of its own on both stages (`apart_tied`): its flat shard is the same
  elements [r*S, (r+1)*S) of it on both, where the stage's other params would shift it differently;
- zero 3 (FSDP2, fsdp.py) shards every parameter on its own along dim 0: the same rows on both.
The optimizer then steps the same shard from the same gradient on both, and the all-gathers (zero 1/2) or the next
forward's gathers (zero 3) give both copies the same table. Under tensor parallel both copies are vocab-parallel
(parallel/tp.py slices every chunk's `tok_emb` alike): each pair holds the same rows [r*V/N, (r+1)*V/N) of tp rank
r, so the pairs sum and broadcast their slices as they would the whole table.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
import torch.nn as nn

from .comm import collectives as comm
from .dims import ParallelDims

NAME = "tok_emb.weight"


def apart_tied(named: list[tuple[str, nn.Parameter]], model: nn.Module, dims: ParallelDims) -> list[list]:
    """`named` split into [the rest, [the tied table]] when it holds the table two stages share (MTP under PP),
    else [named]; empty parts dropped. ZeRO-1/2 builds one reducer per part (zero.py)."""
    if dims.pp == 1 or not model.cfg.mtp_layers:
        return [named]
    parts = [[(n, q) for n, q in named if n != NAME], [(n, q) for n, q in named if n == NAME]]
    return [part for part in parts if part]


class TiedEmbedding:
    """This rank's side of the (stage 0, last stage) embedding pairs: `sum_grads` after the gradient sync,
    `share_clipped` after clipping."""

    def __init__(self, param: nn.Parameter | None, group, src: int, replica: bool):
        self.param, self.group, self.src, self.replica = param, group, src, replica

    @classmethod
    def build(cls, model: nn.Module, dims: ParallelDims, mtp_layers: int, timeout_s: float) -> "TiedEmbedding | None":
        """None without MTP or without PP (one stage holds both uses). Collective over the world when pp > 2
        (new_group on every rank, in the same order); with pp == 2 the pair is the PP group."""
        if not mtp_layers or dims.pp == 1:
            return None
        param = dict(model.named_parameters()).get(NAME)
        pairs = [[ranks[0], ranks[-1]] for ranks in dims.all_group_ranks("pp")]
        group = dims.group("pp") if dims.pp == 2 else None
        if dims.pp > 2 and dist.is_initialized():
            for ranks in pairs:
                pg = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
                if dims.rank in ranks:
                    group = pg
        src = dims.group_ranks("pp")[0] if dims.world_size > 1 else 0  # this rank's stage 0 (global rank)
        return cls(param, group, src, replica=dims.is_pp_last_stage)

    def sum_grads(self, sync) -> None:
        """After `sync.finish()` (sync: the rank's GradSync): stage 0's copy takes the sum of the two averaged
        gradients (this rank's part of them); the replica's is zeroed until `share_clipped`, so the global norm counts
        the table once (on stage 0) and scales nothing on the last stage twice."""
        if self.param is None or self.group is None:
            return  # a middle stage
        grad = sync.local_grad(self.param)
        if grad is None:  # a whole copy with no gradient this step (never with MTP on)
            self.param.grad = grad = self.param.detach().new_zeros(self.param.shape)
        comm.all_reduce(grad, group=self.group, axis="pp")
        if self.replica:
            grad.zero_()

    def share_clipped(self, sync) -> None:
        """After clipping: the replica's gradient becomes stage 0's, bitwise, so the two copies step alike."""
        if self.param is not None and self.group is not None:
            comm.broadcast(sync.local_grad(self.param), self.src, group=self.group, axis="pp")
