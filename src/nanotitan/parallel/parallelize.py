"""This rank's trainable shard: shard spec -> Transformer -> EP -> broadcasts -> gradient sync.

    spec      which embeddings, layers and experts this (pp_rank, ep_rank) owns (model/spec.py)
    model     the Transformer built from that spec, initialised by global identity (DESIGN §4)
    EP        an all-to-all dispatcher on every MoE layer when ep > 1 (ep.py)
    replicas  replicated params broadcast over the non-expert-DP group, expert shards over expert-DP (init.py)
    grad sync the one place that chooses the DP implementation: our bucketed Reducer (dp.py, default) or
              torch DDP (a baseline for pure DP)

Both gradient syncs leave `scale * SUM over the group` in .grad with scale = 1/(DP*EP): replicated params
are averaged over the non-expert-DP group, expert shards over the expert-DP group (an average over DP and
the seed's division by EP). torch DDP divides by its group size, which is the same only when ep == 1
(config validation refuses it otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import Config, ConfigError
from ..model.spec import ModelShardSpec, build_shard_spec
from ..model.transformer import Transformer, is_expert_param
from .dims import ParallelDims
from .dp import Reducer, wrap_ddp
from .ep import apply_ep
from .init import broadcast_params, check_replicas

NamedParams = list[tuple[str, nn.Parameter]]


@dataclass
class ModelShard:
    """What a rank trains: its model shard, how its parameters split by gradient group, and their sync."""
    model: Transformer  # the shard itself (never the DDP wrapper: checkpoints and stats read it)
    spec: ModelShardSpec
    dims: ParallelDims
    expert_params: NamedParams  # disjoint over EP (and PP); synced over the expert-DP group
    replicated_params: NamedParams  # identical on every DP/EP rank of a stage; synced over non-expert-DP
    reducers: list[Reducer] = field(default_factory=list)
    ddp: nn.Module | None = None  # torch DDP wrapper (dp_impl=torch_ddp); then `reducers` is empty
    comms: dict = field(default_factory=dict)  # the stage's P2P endpoints per activation shape (step.py)

    @property
    def forward_module(self) -> nn.Module:
        return self.ddp if self.ddp is not None else self.model

    def num_params(self) -> int:
        return sum(p.numel() for _, p in self.expert_params + self.replicated_params)

    def check_replicas(self) -> bool:
        """True iff every replica of every parameter is bitwise identical (debug: parallel.check_replicas)."""
        return (check_replicas(self.replicated_params, self.dims.group("non_expert_dp"))
                and check_replicas(self.expert_params, self.dims.group("expert_dp")))

    def close(self) -> None:
        # DDP must go before the process group (BASELINES: SIGABRT at exit otherwise).
        self.ddp = None


def pick_device(cfg: Config, local_rank: int) -> torch.device:
    want = cfg.train.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible (--train.device cpu)")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def parallelize(cfg: Config, dims: ParallelDims, device: torch.device) -> ModelShard:
    """Build this rank's shard of the model, make its replicas identical and attach its gradient sync.
    `dims` must have its groups built when the world has more than one rank."""
    spec = build_shard_spec(cfg, dims.pp_rank, dims.ep_rank)
    model = Transformer(cfg.model, spec, seed=cfg.train.seed).to(device)
    model.activation_checkpointing = cfg.train.activation_checkpointing
    apply_ep(model, dims)
    named = list(model.named_parameters())
    shard = ModelShard(model, spec, dims,
                       expert_params=[(n, p) for n, p in named if is_expert_param(n)],
                       replicated_params=[(n, p) for n, p in named if not is_expert_param(n)])

    # Init by global identity already agrees; the broadcast from each group's first rank is the seed's
    # belt and braces (and what makes a replica that diverged by a bug visible to check_replicas).
    distributed = dist.is_initialized() and dims.world_size > 1
    if distributed:
        broadcast_params(shard.replicated_params, dims.group_ranks("non_expert_dp")[0], dims.group("non_expert_dp"))
        broadcast_params(shard.expert_params, dims.group_ranks("expert_dp")[0], dims.group("expert_dp"))

    p = cfg.parallel
    if p.dp_impl == "torch_ddp" and distributed:
        shard.ddp = wrap_ddp(model, dims.group("non_expert_dp"), p.bucket_mb)
    else:
        scale = 1.0 / dims.data_world
        shard.reducers = [Reducer(params, dims.group(kind), p.bucket_mb, scale)
                          for params, kind in ((shard.replicated_params, "non_expert_dp"),
                                               (shard.expert_params, "expert_dp")) if params]
    return shard
