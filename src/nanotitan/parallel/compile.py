"""train.compile: torch.compile each transformer block in place (torchtitan's per-block compile).

Each Block is compiled with `nn.Module.compile`, which keeps the module and its parameter names (checkpoints, the
DP Reducer's buckets, FSDP2 and the report see the same model); parallelize.py calls `compile_blocks` after EP is
applied and before the gradient sync is attached, so FSDP2's fully_shard wraps compiled blocks (as torchtitan).

What is in the graph: the attention half (norm, q/k/v, RoPE, SDPA, o_proj, residual), the FFN norm and residual,
and a dense block's SwiGLU. What is not: the MoE layer (`MoE.forward`: router, dispatch, experts, combine) runs
eagerly, one graph break per MoE block, on purpose:
- the dispatch has data-dependent shapes: the host split sizes per expert (`counts.tolist()`, the EP all-to-all's
  split sizes), which would recompile or need unbacked symbols for every new routing;
- the EP dispatcher runs gloo all-to-alls inside custom autograd Functions, and the EP lanes pick a group by
  `in_backward()`; the router leaves per-lane records for Transformer.forward (side effects on dicts);
- FSDP2 shards the experts as their own unit under zero 3 (its hooks run eagerly anyway).
So an MoE block is two graphs (before and after the MoE call); activation checkpointing wraps the compiled block
from outside (torch.utils.checkpoint recomputes by calling it again: the same graph), and zb1's deferred weight
gradients (model/wgrad.py, custom autograd Functions with side effects in backward) run with their Linear calls
dynamo-disabled while a store is attached, so a deferred GEMM lands exactly as eagerly.

Whole blocks (`whole_blocks`: parallel.ep_dispatch static, and none of the options that read `in_backward()` or act in
a backward): each block's forward compiles `fullgraph=True`, router, dispatch, grouped experts and combine included.
The two all-to-alls have equal splits known before the step, so they are torch's functional collectives in the graph
(forward and backward); the counts stay on the device; the grouped GEMM is an op the trace holds in any dtype
(model/grouped_mm.py). The block's hooks (ZeRO's wait for its gathered parameters) stay eager, outside the graph. The
compiled trips are not in the comm meters (the graph runs them; `bench compile --static-ep` times the step).
train.cuda_graphs: the graphs in inductor's mode "reduce-overhead" (CUDA graph trees; `graphs_step_begins`).

Shapes are static (`dynamic=False`): a block sees one shape in training and one in eval, so each compiles once or
twice; identical blocks and ranks reuse inductor's on-disk FX graph cache. `compile_seconds` reads what dynamo
and inductor spent so far: the trainer puts it in the run's first record (`compile_s`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

_RECOMPILE_LIMIT = 64  # per code object: every block instance, train/eval, checkpoint recompute and grad mode


def _eager(fn):
    """fn, never traced by dynamo (a graph break around each call)."""
    return torch.compiler.disable(fn, recursive=True)


def whole_blocks(cfg) -> bool:
    """Does train.compile compile each block whole (`fullgraph`, its MoE inside)? Where every EP size is static
    (parallel.ep_dispatch static) and nothing around the MoE needs the host or a side effect in a backward: no
    recompute (activation checkpointing: a recompute must not record the routing twice, and only in_backward(), which
    dynamo cannot read, tells it), no deferred weight gradients (zb1's store), no second EP lane (its group is picked
    by in_backward()), no FSDP2 unit inside the block (zero 3), no token shard (tp, cp: the router's collectives
    are autograd Functions of their own). Elsewhere the MoE runs eagerly between two graphs, as before."""
    p, t = cfg.parallel, cfg.train
    return (t.compile and p.ep_dispatch == "static" and not t.activation_checkpointing and p.schedule != "zb1"
            and not p.ep_overlap_microbatches and p.zero < 3 and p.tp == 1 and p.cp == 1)


def compile_blocks(model: nn.Module, whole: bool = False, backend: str = "inductor", graphs: bool = False) -> int:
    """Compile every transformer block of `model` (a Transformer or StageChunks) in place; returns how many.
    whole (`whole_blocks`): each block one graph, `fullgraph=True` (a break is an error), the MoE's dispatch through
    functional collectives (parallel/ep.py); else the MoE layer runs eagerly. backend: torch.compile's (tests trace
    with aot_eager: the same graphs, forward and backward, without inductor's code generation). graphs
    (train.cuda_graphs): inductor's mode "reduce-overhead", each graph's forward and backward recorded once as a CUDA
    graph and replayed (`graphs_step_begins` marks each step)."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, _RECOMPILE_LIMIT)
    dynamo_config.accumulated_cache_size_limit = max(dynamo_config.accumulated_cache_size_limit, 4 * _RECOMPILE_LIMIT)
    blocks = list(model.layers.values())
    for block in blocks:
        if getattr(block, "is_moe", False) and not whole:
            block.moe.forward = _eager(block.moe.forward)  # an instance attribute: the class stays untouched
        for m in block.modules():  # zb1's deferred weight gradients: their autograd Functions run eagerly
            if hasattr(m, "wgrad_store") and m is not block and not getattr(m, "_nt_wgrad_eager", False):
                m.forward, m._nt_wgrad_eager = _wgrad_eager(m), True
        mode = "reduce-overhead" if graphs else None
        if whole:  # the forward alone: the block's hooks (ZeRO's wait for its gathered parameters) stay eager, outside
            block.forward = torch.compile(block.forward, dynamic=False, fullgraph=True, backend=backend, mode=mode)
        else:
            block.compile(dynamic=False, backend=backend, mode=mode)
    return len(blocks)


def graphs_step_begins(cfg) -> None:
    """train.cuda_graphs: a new training step begins (before its first forward). Inductor's CUDA graph trees keep each
    graph's outputs in the graph's own memory; from here the previous step's are dead, so its replays may reuse it.
    Microbatches of one step whose outputs are still alive get graphs of their own (the trees check liveness)."""
    if cfg.train.cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()


def _wgrad_eager(m: nn.Module):
    """m.forward, traced while no WeightGradStore is attached, eager while one is (the store's closures)."""
    plain, eager = m.forward, _eager(m.forward)

    def forward(*args, **kwargs):
        return plain(*args, **kwargs) if m.wgrad_store is None else eager(*args, **kwargs)
    return forward


def compile_seconds() -> float:
    """Seconds dynamo and inductor have spent compiling in this process so far (0.0 when nothing compiled)."""
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))


def first_compile_s(cfg, first_record: bool) -> float | None:
    """The first record's `compile_s` under train.compile (this rank's compile time so far), else None (no key)."""
    return compile_seconds() if cfg.train.compile and first_record else None
