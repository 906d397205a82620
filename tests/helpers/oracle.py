"""The naive data-parallel oracle the bucketed Reducer is checked against (picotron's DataParallelNaive).

It lives with the tests: the product never runs it, and nothing in it may be borrowed from the code it judges.
"""

import torch
import torch.distributed as dist
import torch.nn as nn


class DataParallelNaive:
    """After the whole backward, one blocking all-reduce per parameter; then `.grad = scale * SUM over group`."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], group, scale: float):
        self.params = [p for _, p in named_params if p.requires_grad]
        self.group, self.scale = group, scale

    @torch.no_grad()
    def finish(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.group is not None:
                dist.all_reduce(p.grad, group=self.group)
            p.grad.mul_(self.scale)
