"""This rank's trainable shard: shard spec -> Transformer -> EP -> broadcasts -> gradient sync.

    spec      which embeddings, layers and experts this (pp_rank, ep_rank) owns (model/spec.py)
    model     the Transformer built from that spec, initialised by global identity (DESIGN §4)
    EP        an all-to-all dispatcher on every MoE layer when ep > 1 (ep.py)
    replicas  replicated params broadcast over the non-expert-DP group, expert shards over expert-DP (init.py)
    grad sync the one place that chooses the DP implementation: our bucketed Reducer (dp.py, default),
              torch DDP (a baseline for pure DP), or sharded DP: parallel.zero 1/2 (ShardedReducer, dp.py),
              3 (FSDP2, fsdp.py) — same averages, each rank updating 1/N of them

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
from ..model.spec import ModelShardSpec, build_chunk_specs
from ..model.transformer import Transformer, is_expert_param
from .dims import ParallelDims
from . import fsdp
from .dp import (Reducer, ShardedReducer, full_optim_state_to_sharded, sharded_optim_state_to_full, state_bytes,
                 wrap_ddp)
from .ep import apply_ep
from .pp_chunks import StageChunks
from .init import broadcast_params, check_replicas

NamedParams = list[tuple[str, nn.Parameter]]


@dataclass
class ModelShard:
    """What a rank trains: its model shard, how its parameters split by gradient group, and their sync."""
    model: Transformer | StageChunks  # the shard itself (never the DDP wrapper: checkpoints and stats read it)
    spec: ModelShardSpec
    dims: ParallelDims
    expert_params: NamedParams  # disjoint over EP (and PP); synced over the expert-DP group
    replicated_params: NamedParams  # identical on every DP/EP rank of a stage; synced over non-expert-DP
    reducers: list[Reducer] = field(default_factory=list)
    ddp: nn.Module | None = None  # torch DDP wrapper (dp_impl=torch_ddp); then `reducers` is empty
    zero: int = 0  # parallel.zero: reducers are ShardedReducers (1, 2) or an FSDPSync (3)
    unsharded: NamedParams = field(default_factory=list)  # zero 3: experts with no expert-DP group to shard over
    comms: dict = field(default_factory=dict)  # the stage's P2P endpoints per activation shape (step.py)

    @property
    def forward_module(self) -> nn.Module:
        return self.ddp if self.ddp is not None else self.model

    def num_params(self) -> int:
        return sum(p.numel() for _, p in self.expert_params + self.replicated_params)

    def param_groups(self, weight_decay: float) -> list[dict]:
        """The optimizer's AdamW groups, decay on matrices only: the model's params (zero 0), the shard
        params of the ShardedReducers (1, 2), or FSDP's DTensors, one group per mesh (3)."""
        if self.zero in (1, 2):
            groups = [r.param_groups(weight_decay) for r in self.reducers]
            return [{"params": [q for g in groups for q in g[i]["params"]], "weight_decay": groups[0][i]["weight_decay"]}
                    for i in range(2)]
        if self.zero == 3:
            return fsdp.param_groups(self.model, weight_decay)
        return [{"params": [q for q in self.model.parameters() if q.dim() >= 2], "weight_decay": weight_decay},
                {"params": [q for q in self.model.parameters() if q.dim() < 2], "weight_decay": 0.0}]

    def shard_params(self) -> list[nn.Parameter]:
        """Params whose .grad is this rank's slice of a sharded gradient (disjoint over non-expert-DP)."""
        return [q for r in self.reducers for q in getattr(r, "shard_params", [])]

    def state_bytes(self, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        """Live param_bytes, grad_bytes, optim_bytes on this rank (dp.state_bytes)."""
        return state_bytes(self.model, optimizer, self.reducers)

    def full_state(self, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
        """({param name: tensor}, {param name: {state key: tensor}}) in the replicated, per-parameter form
        whatever the zero level, for checkpoints. Zero 0: the live tensors; zero 1/2: the live params and
        the optimizer state all-gathered (fresh tensors); zero 3: all-gathered params and state.
        Collective at zero >= 1. At zero >= 1 an optimizer that has not stepped gets its zero state first;
        at zero 0 the caller creates it (checkpoint._ensure_adam_state)."""
        if self.zero == 3:
            return fsdp.full_state(self.model, optimizer)
        model_state = dict(self.model.named_parameters())
        if optimizer is None:
            return model_state, {}
        if self.zero in (1, 2):
            return model_state, sharded_optim_state_to_full(self.reducers, optimizer)
        name_of = {id(q): n for n, q in self.model.named_parameters()}
        return model_state, {name_of[id(q)]: optimizer.state[q] for g in optimizer.param_groups for q in g["params"]}

    def load_full_state(self, optimizer: torch.optim.Optimizer | None, model_state: dict, optim_state: dict) -> None:
        """Inverse of `full_state`: after a checkpoint was read into the tensors `full_state` returned,
        give every rank its part (zero 0 and the params of zero 1/2: already in place)."""
        if self.zero == 3:
            fsdp.load_full_state(self.model, optimizer, model_state, optim_state if optimizer is not None else None)
        elif self.zero in (1, 2) and optimizer is not None:
            full_optim_state_to_sharded(self.reducers, optimizer, optim_state)

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
    # One model chunk per virtual pipeline stage (V > 1 only under the interleaved schedule): V chunks are
    # joined in a StageChunks whose parameters keep their global names (pp_chunks.py).
    specs = build_chunk_specs(cfg, dims.pp_rank, dims.ep_rank)
    chunks = [Transformer(cfg.model, s, seed=cfg.train.seed).to(device) for s in specs]
    if cfg.init.from_hf:  # imported weights: each chunk reads only its own slice (hf.py); a resume overwrites them
        from ..hf import load_into_shard

        for chunk in chunks:
            load_into_shard(chunk, cfg.init.from_hf)
    spec, model = specs[0], chunks[0] if len(chunks) == 1 else StageChunks(chunks)
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
    scale = 1.0 / dims.data_world
    reduce_dtype = torch.bfloat16 if p.reduce_dtype == "bf16" else None  # None: reduce in the gradients' fp32
    by_group = [(params, kind) for params, kind in ((shard.replicated_params, "non_expert_dp"),
                                                    (shard.expert_params, "expert_dp")) if params]
    shard.zero = p.zero
    if p.dp_impl == "torch_ddp" and distributed:
        shard.ddp = wrap_ddp(model, dims.group("non_expert_dp"), p.bucket_mb)
    elif p.zero == 3:
        # FSDP2 on the non-expert-DP and expert-DP meshes; experts with no expert-DP group (dp == 1) stay
        # whole and are scaled by a Reducer, as at zero 0.
        left = {id(q) for q in fsdp.apply_fsdp(model, dims)}
        shard.unsharded = [(n, q) for n, q in shard.expert_params if id(q) in left]
        shard.reducers = [fsdp.FSDPSync(model)]
        if shard.unsharded:
            shard.reducers.append(Reducer(shard.unsharded, None, p.bucket_mb, scale))
    elif p.zero:
        shard.reducers = [ShardedReducer(params, dims.group(kind), p.bucket_mb, scale, p.zero, reduce_dtype)
                          for params, kind in by_group]
    else:
        shard.reducers = [Reducer(params, dims.group(kind), p.bucket_mb, scale, reduce_dtype)
                          for params, kind in by_group]
    return shard
