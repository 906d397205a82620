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
Floor 1 (model/): every parameter carries a family tag (`tag_params`, before the gradient sync is built), a plain
string the gradient syncs (parallel/dp/) group and bucket by without knowing what it means: ZeRO 1/2 keep one tag
per flat bucket (zero.py), FSDP2 keeps the tag on its DTensor shards (fsdp.py), every flavour's `param_groups` hands
out one group per tag. What a tag means is optim/'s: which optimizer takes it, and whether it decays.
"""

from __future__ import annotations

import torch
import torch.nn as nn

TAG = "family"  # the attribute a parameter's family tag rides on (kept across FSDP2's re-wrap: keep_tag)
VECTOR, MATRIX, HIDDEN = "vector", "matrix", "hidden"  # norms and biases; other matrices; Muon's hidden matrices
_ADAMW_PARTS = ("tok_emb", "pos_emb", "head", "router")  # name components that keep a matrix on AdamW


def is_muon_matrix(name: str, p: torch.Tensor) -> bool:
    """Whether `name` (a global parameter name) is a hidden matrix Muon takes: 2-D, or a [E, d, f] expert stack."""
    parts = name.split(".")
    if any(part in _ADAMW_PARTS for part in parts):
        return False
    return p.dim() == 2 or (p.dim() == 3 and ".experts." in name)


def family(name: str, p: torch.Tensor, optimizer: str) -> str:
    """p's tag under train.optimizer: HIDDEN for a matrix Muon takes (only under muon, so that AdamW's ZeRO buckets
    stay the two families they always were), else MATRIX or VECTOR by rank."""
    if optimizer == "muon" and is_muon_matrix(name, p):
        return HIDDEN
    return MATRIX if p.dim() >= 2 else VECTOR


def tag_params(model: nn.Module, optimizer: str) -> None:
    """Tag every parameter of `model` with its family under train.optimizer."""
    for name, p in model.named_parameters():
        setattr(p, TAG, family(name, p, optimizer))


def tag_of(p: torch.Tensor) -> str:
    """p's family tag; an untagged parameter (a test's sync built without `parallelize`) is a MATRIX or a VECTOR."""
    return getattr(p, TAG, None) or (MATRIX if p.dim() >= 2 else VECTOR)


def keep_tag(old: torch.Tensor, new: torch.Tensor) -> None:
    """A parameter that replaces another (FSDP2's DTensor shard) keeps its family."""
    if hasattr(old, TAG):
        setattr(new, TAG, getattr(old, TAG))
