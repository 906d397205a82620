"""The trainer's optimizer over a ModelShard: AdamW, or Muon with AdamW for the rest (train.optimizer)."""

from __future__ import annotations

import torch

from ..config.config import Config
from .adamw import AdamW, decay_groups
from .geometry import shard_geometry
from .muon import Muon, shard_pieces


def build_optimizer(shard, cfg: Config) -> torch.optim.Optimizer:
    """AdamW over what this rank updates (its params, or its 1/N shards at parallel.zero >= 1), the sync's groups
    by family tag; decay on matrices only. Fused: ~3x faster than the default on CPU (the baselines, docs/design.md).
    train.optimizer=muon: Muon on the hidden matrices (tagged by `parallelize`, model/families.py), AdamW on the
    rest (muon.py). The trainer and the dry run use it."""
    t = cfg.train
    groups = decay_groups(shard.sync.param_groups(), t.weight_decay)
    if t.optimizer == "muon":
        return Muon(groups, t.lr, (t.beta1, t.beta2), t.muon_lr, t.muon_momentum, t.muon_ns_steps,
                    shard_pieces(shard), shard.dims.group("stage"),
                    torch.bfloat16 if t.muon_ns_dtype == "bf16" else torch.float32, t.muon_adamw_lr,
                    shard_geometry(shard))
    return AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=True)
