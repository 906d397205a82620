"""A stage's backward in two halves (zero-bubble pipelines, Qi et al. 2023, "Zero Bubble Pipeline Parallelism"):

    B  backward_input():  the gradient of the stage's input, which the previous stage is waiting for;
    W  backward_weight(): the gradients of the stage's weights, which nobody waits for, so a schedule can
                          run it later, in time the stage would otherwise spend idle.

How, after torch.distributed.pipelining's `stage_backward_input` / `stage_backward_weight` (_backward.py):
the autograd graph of one microbatch is walked once. A node *reaches the input* when some path from it
leads to the stage input's node; those nodes are the input path that B must run. A node on the input path
with a child that does NOT reach the input but reaches parameters (a Linear's MmBackward: its weight
branch `t(W)` -> AccumulateGrad) is an *intermediate*. B runs `autograd.grad(outputs, inputs,
retain_graph=True)`: the engine computes only what the input needs (an MmBackward computes grad x, not
grad W), and a pre-hook on every intermediate keeps the gradient that flowed into it. W then starts one
backward per parameter group at the intermediates' edges with those gradients: the engine re-enters each
intermediate computing only its weight outputs, and accumulates into `.grad` through the parameters'
AccumulateGrad nodes -- so the DP Reducer's post-accumulate-grad hooks fire in W, exactly once per
parameter. (torch sums into .grad by hand instead, which our Reducer would not see.)

Exactness: every gradient is computed by the same node functions as in one backward; a parameter whose
gradient has several terms (an expert weight tensor unbound per expert) has all its intermediates in one
group, so the terms meet in one AccumulateGrad, as in a single backward.

On the first stage the inputs are the embedding outputs (the tokens have no gradient): B runs the whole
backward down to them -- every EP all-to-all included -- and the embedding tables get theirs in W. Without
activation checkpointing no EP all-to-all ever runs in W: `_AllToAll` nodes carry no parameter, so they are
never an intermediate nor on a weight branch. With checkpointing, W's first touch of a checkpointed block
recomputes that block's forward (its saved tensors were dropped after B's own recompute): all of one
W's groups share one `GraphExecGroup`, so each block is recomputed once per W, not once per group, and the
recompute's dispatch/combine all-to-alls run inside W -- they pair up because W's position in the schedule
is the same pure function on every rank of an EP group.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

# One recompute of a checkpointed region per W (torch >= 2.9); older torch recomputes per group call.
_EXEC_GROUP = getattr(torch.utils.checkpoint, "GraphExecGroup", None)


@dataclass
class _Group:
    """Parameters whose weight gradients come from the same intermediates, in the stage's parameter order."""
    params: list[nn.Parameter]
    nodes: list[Node] = field(default_factory=list)
    grads: list[tuple | None] = field(default_factory=list)  # each node's incoming gradients, captured in B


@dataclass
class PendingWeights:
    """What W needs: the groups with their captured gradients. Holds the graph (the activations) until W."""
    groups: list[_Group]
    checkpointed: bool
    buffers: list = field(default_factory=list)  # P2P buffers the graph may still read (pp.py frees them after W)


def _walk(roots: list[Node], input_nodes: set[Node]) -> tuple[list[Node], dict[Node, bool]]:
    """Every node reachable from roots (children before parents), and whether each reaches an input node."""
    order, reaches, stack = [], {}, [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            reaches[node] = node in input_nodes or any(
                c is not None and reaches[c] for c, _ in node.next_functions)
            order.append(node)
        elif node not in reaches:
            reaches[node] = False  # placeholder: visited
            stack.append((node, True))
            stack.extend((c, False) for c, _ in node.next_functions if c is not None and c not in reaches)
    return order, reaches


def _params_below(node: Node, acc_to_param: dict[Node, int], memo: dict[Node, frozenset]) -> frozenset:
    """Indices of the parameters whose AccumulateGrad lies under `node` (a weight-only branch)."""
    if node in memo:
        return memo[node]
    found = {acc_to_param[node]} if node in acc_to_param else set()
    for c, _ in node.next_functions:
        if c is not None:
            found |= _params_below(c, acc_to_param, memo)
    memo[node] = frozenset(found)
    return memo[node]


def backward_input(outputs: list[torch.Tensor], grad_outputs: list[torch.Tensor | None],
                   inputs: list[torch.Tensor], params: list[nn.Parameter],
                   checkpointed: bool = False) -> tuple[list[torch.Tensor | None], PendingWeights]:
    """B: gradients of `inputs` (tensors that require grad: the received activation, or the embedding outputs)
    given `grad_outputs` for `outputs` (None for a scalar loss term). No parameter's .grad changes.
    Returns the input gradients and what `backward_weight` needs."""
    outputs_, grads_ = zip(*[(o, g) for o, g in zip(outputs, grad_outputs) if o.grad_fn is not None])
    input_edges = [get_gradient_edge(t) for t in inputs]
    input_nodes = {e.node for e in input_edges}
    acc_to_param = {get_gradient_edge(p).node: i for i, p in enumerate(params) if p.requires_grad}
    roots = [o.grad_fn for o in outputs_]
    order, reaches = _walk(roots, input_nodes)

    # Intermediates: input-path nodes with a weight-only child; roots that never reach the input are
    # intermediates too (their gradient is the one given). Parameters met under several intermediates
    # merge their groups (union-find over parameter indices).
    memo: dict[Node, frozenset] = {}
    node_params: dict[Node, frozenset] = {}
    for node in order:
        if reaches[node]:
            found = frozenset().union(*[_params_below(c, acc_to_param, memo) for c, _ in node.next_functions
                                        if c is not None and not reaches[c]])
        elif node in roots:
            found = _params_below(node, acc_to_param, memo)
        else:
            continue
        if found:
            node_params[node] = found
    parent = list(range(len(params)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for found in node_params.values():
        first, *rest = sorted(found)
        for j in rest:
            parent[find(j)] = find(first)
    by_root: dict[int, _Group] = {}
    for i in sorted({i for found in node_params.values() for i in found}):
        by_root.setdefault(find(i), _Group(params=[])).params.append(params[i])
    group_of = {i: by_root[find(i)] for found in node_params.values() for i in found}
    captured: dict[Node, tuple] = {}
    handles = []
    for node, found in node_params.items():  # `order` is deterministic, so is each group's node list
        group_of[min(found)].nodes.append(node)
        if node not in input_nodes and reaches[node]:
            handles.append(node.register_prehook(lambda g, node=node: captured.__setitem__(node, g)))

    try:
        grads_in = torch.autograd.grad(outputs_, inputs, grads_, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()

    # What each intermediate received: B's capture, an input's own gradient, or a root's given gradient.
    given = {o.grad_fn: g if g is not None else torch.ones_like(o) for o, g in zip(outputs_, grads_)}
    for e, g in zip(input_edges, grads_in):
        if e.node in node_params:
            slots = [None] * (e.output_nr + 1)
            slots[e.output_nr] = g
            captured[e.node] = tuple(slots)
    groups = list(by_root.values())
    for grp in groups:
        for node in grp.nodes:
            grp.grads.append(captured.get(node, (given[node],) if node in given else None))
    return list(grads_in), PendingWeights(groups, checkpointed)


def backward_weight(pending: PendingWeights) -> None:
    """W: accumulate every parameter's gradient into .grad (AccumulateGrad: the Reducer's hooks fire), one
    backward per group, in parameter order. Frees the microbatch's graph as it goes."""
    ctx = _EXEC_GROUP() if pending.checkpointed and _EXEC_GROUP is not None else contextlib.nullcontext()
    with ctx:
        for grp in pending.groups:
            edges, grads = [], []
            for node, gs in zip(grp.nodes, grp.grads):
                for i, g in enumerate(gs or ()):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            if not edges:
                continue
            # With several intermediates one may lie below another on the input path: pin each one's
            # incoming gradient to its captured value so nothing flowing between them is counted twice.
            pins = [node.register_prehook(lambda _g, gs=gs: gs) for node, gs in zip(grp.nodes, grp.grads)
                    if gs is not None] if len(grp.nodes) > 1 else []
            try:
                torch.autograd.backward(edges, grads, inputs=grp.params)
            finally:
                for h in pins:
                    h.remove()
    pending.groups.clear()
