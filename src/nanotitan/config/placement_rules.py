"""The config rules of expert placement (parallel.expert_placement, parallel/placement.py, docs/ep.md "Experts placed
by load"). A leaf like config.py, which calls it from `validate`."""

from __future__ import annotations

from .errors import check as _check
from .layout import expert_ranks


def check_placement(cfg) -> None:
    """parallel.expert_placement and its window and replicas (parallel/placement.py)."""
    p = cfg.parallel
    moe_ep = expert_ranks(p.ep, p.cp, p.tp)  # the ranks the experts are placed over: EP folded with CP and TP
    _check(p.expert_placement in ("static", "balanced"),
           f"parallel.expert_placement={p.expert_placement!r} must be static or balanced (--parallel.expert_placement)")
    _check(p.rebalance_every >= 1, f"parallel.rebalance_every={p.rebalance_every} must be >= 1: the steps whose "
                                   f"routing counts a placement reads (--parallel.rebalance_every 10)")
    _check(p.expert_replicas >= 1, f"parallel.expert_replicas={p.expert_replicas} must be >= 1 "
                                   f"(--parallel.expert_replicas 1)")
    if p.expert_placement == "static":
        _check(p.expert_replicas == 1, f"parallel.expert_replicas={p.expert_replicas} replicates experts by load: it "
                                       f"needs --parallel.expert_placement balanced (or --parallel.expert_replicas 1)")
        return
    _check(p.auto or moe_ep > 1, "parallel.expert_placement=balanced places experts over the EP ranks, and "
                                 "parallel.ep*cp*tp=1 has one (--parallel.ep 2, or --parallel.expert_placement static)")
    _check(p.auto or p.expert_replicas <= moe_ep,
           f"parallel.expert_replicas={p.expert_replicas} exceeds the {moe_ep} EP ranks (parallel.ep*cp*tp) an "
           f"expert can be replicated on (--parallel.expert_replicas {moe_ep})")
