"""Multi-token prediction (MTP, DeepSeek-V3 §2.2; model.mtp_layers, model.mtp_coef).

Module k = 1..D predicts token t+k+1 at position t. It reads the previous depth's hidden state h (depth 0: the main
model's last hidden state, before the final norm) and the embedding of token t+k:

    h' = Block_k(eh_proj([enorm(emb(t+k)); hnorm(h)]))        logits_k = head(shared_head.norm(h'))

The embedding table and the output head are the main model's (shared, not copied). Names follow DeepSeek's
checkpoint, where MTP module k is decoder layer n_layers + k - 1 with extra parts: here the block is
`layers.{n_layers + k - 1}` (a plain Block: MoE or dense by the model's rule, so EP, FSDP units, router-bias
updates and stall labels see it as one more layer) and enorm, hnorm, eh_proj and shared_head.norm are
`mtp.{n_layers + k - 1}.*` (keys are global layer indices, as the blocks'; interop/hf.py maps them to
`model.layers.{n_layers + k - 1}.*`). The order of the concatenation,
embedding first, is DeepSeek's checkpoint's (its eh_proj columns).

Targets give the future tokens: target[t] = token t+1, so depth k reads emb(target[t+k-1]) and predicts target[t+k]
at positions t < S - k. Each depth runs on those S - k positions only (attention is causal, so dropping the tail
changes nothing before it). Loss: each depth's mean CE over its positions, averaged over the depths, times
mtp_coef, added to the objective; the trainer logs it apart as `mtp_loss`. A block's MoE router losses join the
shard's aux sum like any layer's.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config.config import ModelConfig
from .norm import RMSNorm
from .wgrad import Linear


def mtp_layer_ids(cfg: ModelConfig, mtp_layers: int) -> range:
    """Global layer indices of the MTP blocks (DeepSeek's numbering: after the last decoder layer)."""
    return range(cfg.n_layers, cfg.n_layers + mtp_layers)


class SharedHead(nn.Module):
    """DeepSeek's `shared_head`: its own norm; the head itself is the main model's (not held here)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)


class MTPModule(nn.Module):
    """The parts of one MTP depth besides its block and the shared embedding/head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D = cfg.d_model
        self.enorm = RMSNorm(D, cfg.norm_eps)
        self.hnorm = RMSNorm(D, cfg.norm_eps)
        self.eh_proj = Linear(2 * D, D, bias=False)
        self.shared_head = SharedHead(cfg)

    def project(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))


class MTP(nn.ModuleDict):
    """The D MTP modules of a model (its last pipeline stage), keyed by their blocks' global layer indices."""

    def __init__(self, cfg: ModelConfig, mtp_layers: int):
        super().__init__({str(i): MTPModule(cfg) for i in mtp_layer_ids(cfg, mtp_layers)})

    def forward(self, h: torch.Tensor, future: torch.Tensor, run_block: Callable) -> tuple[list, torch.Tensor]:
        """(each depth's normed last hidden state, (B, S - k, D) for depth k; the sum of the MTP blocks' router
        losses). h (B, S, D) is the main model's last hidden state, future (B, S - 1, D) the embeddings of
        target[:, :S - 1]; run_block(key, x) -> (x, aux) runs block `layers[key]` as the trunk runs its blocks
        (activation checkpointing, router records)."""
        S = h.shape[1]
        outs, aux = [], h.new_zeros((), dtype=torch.float32)
        for k, (key, module) in enumerate(self.items(), start=1):
            x = module.project(h[:, :S - k], future[:, k - 1:])
            h, a = run_block(key, x)
            aux = aux + a
            outs.append(module.shared_head.norm(h))
        return outs, aux

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean over depths of each depth's mean CE. logits (B, sum_k (S - k), V) float32: the head's output on
        every depth's positions, concatenated along the sequence in depth order."""
        S, losses, start = targets.shape[1], [], 0
        for k in range(1, len(self) + 1):
            n = S - k
            losses.append(F.cross_entropy(logits[:, start:start + n].reshape(-1, logits.shape[-1]),
                                          targets[:, k:].reshape(-1)))
            start += n
        return torch.stack(losses).mean()


def take_loss_sum(model: nn.Module) -> torch.Tensor | None:
    """The MTP losses (unweighted, detached) summed over the training forwards since the last call, or None on a
    shard without MTP; resets the sum. `model` is a Transformer or pp/chunks.py's StageChunks."""
    total = None
    for chunk in getattr(model, "chunks", [model]):
        s, chunk.mtp_loss_sum = getattr(chunk, "mtp_loss_sum", None), None
        if s is not None:
            total = s if total is None else total + s
    return total
