"""How a parameter's gradient lies over the ranks that shard the tokens (TP, CP), and over the copies of a replicated
expert: the one reading that the gradient syncs (sync.py, zero.py, fsdp.py), clipping (clip.py) and the checkpoint's
keys (state/keys.py) all make.

parallel/tp.py tags each parameter of a TP chunk when it slices it (`set_layout`); an untagged parameter is ALONE.
Context parallel adds no kind: a parameter replicated over CP is reduced with the DP groups CP joins, as over DP
(each CP rank's gradient is its own tokens' part: parallel/cp.py). An EP layer's expert tensors carry their expert
shard (`copies`, tagged by rebalance.py's `CopyFold`): the rows that are extra copies of a replicated expert hold, after
the sync, the same gradient as the first copy, and count once among the copies, as a WHOLE gradient does among the
token ranks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

LAYOUT = "grad_layout"  # the attribute a parameter's GradLayout rides on (kept across FSDP2's re-wrap: keep_layout)


class Grad(enum.Enum):
    ALONE = "alone"  # no token shard shares it: one device, or an expert shard (EP's, folded over TP)
    WHOLE = "whole"  # whole and the same on every rank of the token shard: counted once among them
    SHARDED = "sharded"  # this rank's slice of the whole (`part`): the ranks' slices add up to it
    PARTIAL = "partial"  # whole, each rank's gradient a partial sum over the token shard: summed over the stage


@dataclass(frozen=True)
class GradLayout:
    kind: Grad
    part: tuple[int, int, int] | None = None  # SHARDED: (dim, rank, n), p is rank's 1/n of the whole along dim
    # an expert tensor's shard (placement.EPShard): its `extra_rows()` (dim 0) are copies whose gradient the first copy
    # also holds, counted once among the copies (by the first: clip.py)
    copies: object | None = None

    @property
    def dim(self) -> int | None:
        return None if self.part is None else self.part[0]

    def at(self, rank: int) -> "GradLayout":
        """This layout on the token shard's rank `rank`: a SHARDED part is that rank's slice (a peer's, where.py)."""
        return self if self.part is None else GradLayout(self.kind, (self.part[0], rank, self.part[2]))


_ALONE = GradLayout(Grad.ALONE)


def grad_layout(p: torch.Tensor) -> GradLayout:
    """How p's gradient lies over the token shard's ranks."""
    return getattr(p, LAYOUT, _ALONE)


def set_layout(p: torch.Tensor, layout: GradLayout) -> None:
    setattr(p, LAYOUT, layout)


def keep_layout(old: torch.Tensor, new: torch.Tensor) -> None:
    """A parameter that replaces another (a build's allocation, FSDP2's DTensor shard) lies as the old one did."""
    if hasattr(old, LAYOUT):
        set_layout(new, getattr(old, LAYOUT))


def token_ranks(dims) -> int:
    """Ranks that split one stage's weights on the same tokens, fastest in every group they join (TP). CP's ranks
    are not among them: after the gradient sync their replicated gradients are the same, as DP's are."""
    return dims.tp

