"""ExpertShard: what an MoE layer needs from the ranks that share its routed experts, handed in whole at build.

The model never asks which ranks hold which experts. Each MoE layer is handed an expert shard (as it is handed a token
shard, model/tokens.py) that says which global expert each slot of its stacked weights holds: its ExpertFFN is built
with that many slots, each slot initialised by its expert's global identity (an empty slot, -1, with zeros), and the
checkpoint keys each slot by its expert. parallel/placement.py's `EPShard` is the one a parallel build hands in (the
identity placement when static, one rank included; a balanced placement's table after a move), and it routes the
dispatch; `LocalExperts` below is the model's own, when nothing is handed in (a model built alone).
"""

from __future__ import annotations

from typing import Protocol


class ExpertShard(Protocol):
    """One MoE layer's routed experts over the ranks that share them (parallel/placement.py: `EPShard`)."""
    rank: int  # this rank's place among them

    def experts_at(self, rank: int) -> tuple[int, ...]:
        """The global expert each slot of `rank` holds, in slot order (-1: an empty slot)."""
        ...


class LocalExperts:
    """Experts [start, end) in slots 0, 1, ... of the one rank that holds them: a model built alone."""
    rank = 0

    def __init__(self, start: int, end: int):
        self.slots = tuple(range(start, end))

    def experts_at(self, rank: int) -> tuple[int, ...]:
        assert rank == 0, f"a model built alone holds its experts on one rank, not rank {rank}"
        return self.slots
