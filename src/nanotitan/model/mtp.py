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

Targets give the future tokens: target[t] = token t+1, so depth k reads emb(target[t+k-1]) and predicts target[t+k] at
positions t < S - k. Both are read from the whole sequence's targets at this rank's positions (`whole_targets`: under
context parallel a rank holds two chunks, and position t's target t+k may lie in another rank's), the untargeted tail
marked IGNORE, which the cross-entropy leaves out. A masked target (data.format=sft's prompts: model/tokens.py MASKED)
gives its token to the depths' inputs and nothing to their losses. Each depth runs on all S positions, its last k
padded (`future_ids`), so that every depth's tensors keep the trunk's shape: under tensor parallel with SP each rank
holds an even shard of the S positions, and the embedding, the head and the loss each run once over the main rows and
every depth's, stacked along the batch. What the padding cannot reach is left out as if the depth ran on S - k
positions: attention is causal and the rest works per token, so no kept position reads the tail; the MoE of depth k's
block routes none of its last k positions and counts none in its statistics (`MoE.seq_tail`, `mark_tails`); the loss
reads positions t < S - k. Loss: each depth's mean CE over its positions (its unmasked targets: per microbatch, unlike
the main CE's global normalisation), averaged over the depths, times mtp_coef: a loss term of its own, which the
shard's forward returns beside the router losses and the pipeline runner adds to the objective and sums over the
microbatches as it sums those (parallel/pp/schedules.py); the trainer logs it apart as `mtp_loss`. A block's MoE
router losses join the shard's aux sum like any layer's.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from ..config.config import ModelConfig
from .norm import RMSNorm
from .tokens import IGNORE, TokenShard, at_runs
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
        """(each depth's normed last hidden state, (B, S, D) each; the sum of the MTP blocks' router losses). h
        (B, S, D) is the main model's last hidden state, future (D*B, S, D) the embeddings of `future_ids`, depth
        k's in rows [(k-1)*B, k*B) (under SP both are sequence shards); run_block(key, x) -> (x, aux) runs block
        `layers[key]` as the trunk runs its blocks (activation checkpointing, router records)."""
        outs, aux = [], h.new_zeros((), dtype=torch.float32)
        for key, module, emb in zip(self.keys(), self.values(), future.chunk(len(self))):
            h, a = run_block(key, module.project(h, emb))
            aux = aux + a
            outs.append(module.shared_head.norm(h))
        return outs, aux

    def loss(self, logits: torch.Tensor, whole: torch.Tensor, runs: list, ce: Callable) -> torch.Tensor:
        """Mean over depths of each depth's mean CE. logits (D*B, S, V): the head's output on every depth's
        positions, depth k's in rows [(k-1)*B, k*B); whole, runs: `whole_targets`; `ce(logits, targets)` is the
        model's cross-entropy (its token shard's: plain on one device, model/tokens.py)."""
        losses = []
        for k, rows in enumerate(logits.chunk(len(self)), start=1):
            losses.append(ce(rows, shifted(whole, runs, k, IGNORE)))
        return torch.stack(losses).mean()


def whole_targets(targets: torch.Tensor, tokens: TokenShard) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """(the whole sequences' targets (B, S_whole), the global runs of this rank's S positions): the token shard's
    (model/tokens.py: seq_gather, seq_runs; targets itself on one device)."""
    return tokens.seq_gather(targets, 1), tokens.seq_runs(targets.shape[1])


def shifted(whole: torch.Tensor, runs: list, k: int, fill: int) -> torch.Tensor:
    """(B, S): whole[:, t + k] at this rank's positions t, `fill` where t + k is past the end."""
    padded = torch.cat([whole[:, k:], whole.new_full((whole.shape[0], k), fill)], 1)
    return at_runs(padded, runs, 1)


def future_ids(whole: torch.Tensor, runs: list, depths: int) -> torch.Tensor:
    """(depths*B, S): depth k's tokens target[t+k-1] at this rank's positions t, the k-1 past the end padded with
    token 0 (read only by positions the loss leaves out)."""
    return torch.cat([shifted(whole, runs, k - 1, 0) for k in range(1, depths + 1)])


def mark_tails(layers: nn.ModuleDict, cfg: ModelConfig, mtp_layers: int) -> None:
    """Depth k's MoE routes none of its block's last k positions (they have no target: module docstring)."""
    for k, i in enumerate(mtp_layer_ids(cfg, mtp_layers), start=1):
        if layers[str(i)].is_moe:
            layers[str(i)].moe.seq_tail = k

