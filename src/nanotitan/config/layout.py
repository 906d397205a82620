"""The layout's one rule that everyone prices: over how many ranks a stage's experts are sharded. A leaf (it imports
nothing), so the config's rules, the model's shard spec, the runtime's dims and the planner all call it."""

from __future__ import annotations


def expert_ranks(ep: int, cp: int, tp: int) -> int:
    """The ranks a stage's routed experts are sharded over: EP folded with the ranks that share its tokens (CP and
    TP, Megatron's parallel folding: docs/tp.md, docs/cp.md). Each of them holds num_experts / expert_ranks of every
    MoE layer, and the EP all-to-all runs over all of them (parallel/dims.py: `moe_ep`)."""
    return ep * cp * tp
