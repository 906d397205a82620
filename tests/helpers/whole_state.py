"""Whole tensors for the tests' comparisons: a rank's params and AdamW state as one replicated run holds them, put
together from every rank's `GradSync.sharded_state` pieces (what checkpoints write). The product never gathers
them; only tests compare whole tensors."""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanotitan.model.transformer import is_expert_param
from nanotitan.state.keys import keyed_state


def whole_tensors(pieces: dict, group, tag: int = 0, own_tag_only=lambda key: False) -> dict:
    """{key: whole tensor} of {key: Pieces} (the same keys on every rank of `group`), each whole tensor put together
    from every rank's boxes; `own_tag_only(key)`: only from the ranks that passed this rank's `tag`. Collective over
    `group` (None: this rank alone). Asserts the boxes cover every element."""
    sent = (tag, {key: (tuple(p.size), [(off, t.detach().clone()) for off, t in p.boxes]) for key, p in pieces.items()})
    every = [sent]
    if group is not None:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, sent, group=group)
    out = {}
    for key in pieces:
        whole = covered = None
        for their_tag, theirs in every:
            if own_tag_only(key) and their_tag != tag:
                continue
            size, boxes = theirs[key]
            for off, t in boxes:
                if whole is None:
                    whole, covered = t.new_zeros(size), torch.zeros(size, dtype=torch.bool)
                region = tuple(slice(o, o + z) for o, z in zip(off, t.shape))
                whole[region] = t
                covered[region] = True
        assert whole is not None and bool(covered.all()), f"{key}: the ranks' pieces do not cover the whole tensor"
        out[key] = whole
    return out


def whole_state(sync, optimizer: torch.optim.Optimizer | None = None) -> tuple[dict, dict]:
    """({param name: tensor}, {param name: {state key: tensor}}) of this rank's params, whole at any zero level:
    collective over the non-expert-DP group (every rank of it calls it). An expert param is this rank's experts
    (E/(EP*CP*TP) of them), put together from the ranks holding the same experts only (dims.moe_ep_rank)."""
    model_state, optim_state = sync.sharded_state(optimizer)
    pieces = {("model", n, ""): p for n, p in model_state.items()}
    pieces.update({("optim", n, k): p for n, st in optim_state.items() for k, p in st.items()})
    dims = sync.dims
    whole = whole_tensors(pieces, dims.group("non_expert_dp"), dims.moe_ep_rank, lambda key: is_expert_param(key[1]))
    model = {n: whole[("model", n, "")] for n in model_state}
    optim = {n: {k: whole[("optim", n, k)] for k in st} for n, st in optim_state.items()}
    return model, optim


def keyed_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                  shard=None) -> dict[str, torch.Tensor]:
    """{global key: tensor view} for everything this rank holds whole (params, then optimizer state): at zero 0
    every key (the live tensors themselves; expert tensors split into per-expert views `t[l]` keyed by global
    id expert_start + l). A key this rank holds only part of (zero >= 1) maps to its `Chunks`."""
    return {k: next(iter(c.boxes.values())) if len(c.boxes) == 1 and not any(next(iter(c.boxes))) and
            next(iter(c.boxes.values())).shape == c.shape else c for k, c in keyed_state(model, optimizer, shard).items()}
