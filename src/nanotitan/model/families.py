"""Which parameters Muon takes (train.optimizer=muon), the one rule every layout reads (docs/optim.md).

Muon orthogonalizes the update of a matrix that maps hidden activations to hidden activations (Keller Jordan,
"Muon: An optimizer for hidden layers", 2024; Moonlight, arXiv:2502.16982, §2; Kimi K2, arXiv:2507.20534):
    Muon    every 2-D hidden matrix: attention (q/k/v/o), MLA's projections (q_a, q_b, kv_a_proj_with_mqa, kv_b),
            dense SwiGLU FFNs, shared experts, MTP's eh_proj, and each routed expert's W_gate/W_val/W_out on its
            own (a [E, d, f] stack is E matrices, orthogonalized as one batch)
    AdamW   the token (and position) embeddings and the output head (Keller Jordan: "embedding and head should be
            optimized by AdamW", their rows are looked up / read out one by one, not a hidden map), every norm
            and bias (vectors), the router (Moonlight keeps it on AdamW: a tiny E x D gate whose rows compete in
            a softmax/sigmoid) and the aux-free selection bias (a buffer, moved by its own sign rule, never an
            optimizer's)
Floor 1 (model/): the gradient syncs (parallel/dp/) read the tag. A parameter is tagged once (`tag_params`, before the
gradient sync is built): ZeRO 1/2 buckets Muon's matrices apart (zero.py), FSDP2 keeps the tag on its DTensor shards
(fsdp.py), every flavour's `param_groups` splits by it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

MUON = "muon_matrix"  # the attribute a Muon-family parameter carries (True)
_ADAMW_PARTS = ("tok_emb", "pos_emb", "head", "router")  # name components that keep a matrix on AdamW


def is_muon_matrix(name: str, p: torch.Tensor) -> bool:
    """Whether `name` (a global parameter name) is a hidden matrix Muon takes: 2-D, or a [E, d, f] expert stack."""
    parts = name.split(".")
    if any(part in _ADAMW_PARTS for part in parts):
        return False
    return p.dim() == 2 or (p.dim() == 3 and ".experts." in name)


def tag_params(model: nn.Module) -> int:
    """Tag every Muon-family parameter of `model`; returns how many."""
    n = 0
    for name, p in model.named_parameters():
        if is_muon_matrix(name, p):
            setattr(p, MUON, True)
            n += 1
    return n


def is_muon(p: torch.Tensor) -> bool:
    return bool(getattr(p, MUON, False))


def keep_tag(old: torch.Tensor, new: torch.Tensor) -> None:
    """A parameter that replaces another (FSDP2's DTensor shard) keeps its family."""
    if is_muon(old):
        setattr(new, MUON, True)
