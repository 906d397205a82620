"""The layout's one rule that everyone prices: over how many ranks a stage's experts are sharded, and what it asks of
the config. A leaf (errors.py aside), so the config's rules, the model's shard spec, the runtime's dims and the planner
all call it."""

from __future__ import annotations

from .errors import check as _check


def expert_ranks(ep: int, cp: int, tp: int) -> int:
    """The ranks a stage's routed experts are sharded over: EP folded with the ranks that share its tokens (CP and
    TP, Megatron's parallel folding: docs/tp.md, docs/cp.md). Each of them holds num_experts / expert_ranks of every
    MoE layer, and the EP all-to-all runs over all of them (parallel/dims.py: `moe_ep`)."""
    return ep * cp * tp


def check_expert_fold(cfg) -> None:
    """Every rank of the fold holds as many experts of each MoE layer (config.validate calls it)."""
    m, p = cfg.model, cfg.parallel
    n = expert_ranks(p.ep, p.cp, p.tp)
    _check(m.num_experts % n == 0, f"model.num_experts={m.num_experts} must be divisible by parallel.ep*cp*tp = {n}: "
           "the experts fold over EP x CP x TP (--parallel.ep, --parallel.cp or --parallel.tp)")
