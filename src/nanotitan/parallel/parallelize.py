"""This rank's trainable shard: shard spec -> Transformer (TP-sliced) -> EP -> broadcasts -> gradient sync.

    spec      which embeddings, layers and experts this (pp_rank, ep_rank) owns (model/spec.py); PP chunks them
              per stage or virtual stage (pp/chunks.py)
    model     the Transformer built from that spec (TP-sliced on the meta device, then filled: build.py),
              initialised by global identity (docs/design.md §4) or read from init.from_hf
    compile   each block under torch.compile when train.compile is set (compile.py)
    experts   each MoE layer built with its expert shard (placement.py `EPShard`: the identity placement over
              dims.moe_ep ranks, spare slots under a balanced one), and when moe_ep > 1 an all-to-all dispatcher that
              routes by it (ep.py); the placement's window and moves (rebalance.py `Rebalancer`: static, none)
    tied      under PP with MTP, the token embedding shared by the first and last stage (tied.py)
    replicas  replicated params broadcast over the non-expert-DP group, expert shards over expert-DP (init.py)
    grad sync the one place that chooses the DP flavour, a GradSync (sync.py): our bucketed Reducer
              (dp.py, default), torch DDP (a baseline for pure DP), or sharded DP: parallel.zero 1/2
              (ZeroSync, zero.py), 3 (FSDPSync, fsdp.py) — same averages, each rank updating 1/N of them

Every flavour leaves `scale * SUM over the group` in .grad with scale = 1/(DP*EP): replicated params
are averaged over the non-expert-DP group, expert shards over the expert-DP group (an average over DP and
the seed's division by EP). torch DDP divides by its group size, which is the same only when ep == 1
(config validation refuses it otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config.config import Config, ConfigError
from ..config.errors import TrainingError
from ..model.spec import ModelShardSpec, build_chunk_specs
from ..model.tokens import LOCAL, TokenShard
from ..model.transformer import Attention, Transformer, is_expert_param
from ..model import qk_max
from ..model.families import tag_params
from ..model.mla import MLA
from .build import build_stage
from .compile import compile_blocks, whole_blocks
from .dims import ParallelDims
from .ep import apply_ep
from .dp.fsdp import FSDPSync
from .pp.chunks import StageChunks
from .init import broadcast_params, check_replicas
from .rebalance import Rebalancer
from .dp.sync import GradSync, ReplicatedSync, TorchDDPSync
from .tied import TiedEmbedding
from .dp.zero import ZeroSync

NamedParams = list[tuple[str, nn.Parameter]]


@dataclass
class ModelShard:
    """What a rank trains: its model shard, how its parameters split by gradient group, and their sync."""
    model: Transformer | StageChunks  # the shard itself (never a DDP wrapper: checkpoints and stats read it)
    spec: ModelShardSpec
    dims: ParallelDims
    expert_params: NamedParams  # disjoint over EP (and PP); synced over the expert-DP group
    replicated_params: NamedParams  # identical on every DP/EP rank of a stage; synced over non-expert-DP
    sync: GradSync | None = None  # the DP flavour (sync.py): prepare/finish, optimizer groups, clip, checkpoint form
    comms: dict = field(default_factory=dict)  # the stage's P2P endpoints per activation shape (step.py)
    ep_lanes: bool = False  # parallel.ep_overlap_microbatches: a forward beside a backward, two lanes (lanes.py)
    tied: TiedEmbedding | None = None  # MTP under PP: the embedding shared by the first and last stage (tied.py)
    tokens: TokenShard = LOCAL  # the ranks sharing this shard's tokens (model/tokens.py), its stream's length
    rebalancer: Rebalancer | None = None  # the experts' placements, their window and moves (parallelize sets one)

    def num_params(self) -> int:
        return sum(p.numel() for _, p in self.expert_params + self.replicated_params)

    def check_replicas(self) -> None:
        """Every replica of every parameter bitwise identical, else a TrainingError on every rank alike (debug:
        parallel.check_replicas; collective)."""
        same = (check_replicas(self.replicated_params, self.dims.group("non_expert_dp"))
                and check_replicas(self.expert_params, self.dims.group("expert_dp")))
        if not same:
            raise TrainingError("parallel.check_replicas: replicas differ after the initial broadcast")

    def checkpoint_extra(self) -> dict:
        """What a checkpoint keeps of this shard beside its tensors: the placement's last window (collective)."""
        return self.rebalancer.record()

    def resumed(self, extra: dict, optimizer) -> None:
        """After a checkpoint was loaded (any layout): its placement window placed afresh over this layout's EP
        ranks, before the first step (collective over the stage)."""
        self.rebalancer.restore(extra.get("placement_load"), optimizer)

    def close(self) -> None:
        self.sync.close()


def pick_device(device: str, local_rank: int) -> torch.device:
    """This rank's device for train.device as resolve.py made it concrete ("cpu" or "cuda")."""
    assert device in ("cpu", "cuda"), f"train.device={device!r} is made concrete by resolve.py"
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible (--train.device cpu)")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def parallelize(cfg: Config, dims: ParallelDims, device: torch.device,
                load_weights: Callable[[nn.Module], object] | None = None) -> ModelShard:
    """Build this rank's shard of the model, make its replicas identical and attach its gradient sync.
    `dims` must have its groups built when the world has more than one rank."""
    # One model chunk per virtual pipeline stage (V > 1 only under the interleaved schedule): V chunks are
    # joined in a StageChunks whose parameters keep their global names (pp/chunks.py).
    # Built on the meta device, TP-sliced there, then each parameter filled at its slice's size (build.py): from
    # init.from_hf (interop/hf.py's shard_loader: each chunk reads only its slice) or by global identity.
    specs = build_chunk_specs(cfg, dims.pp_rank, dims.moe_ep_rank)
    spec, model = specs[0], build_stage(cfg, specs, dims, device, load_weights)
    model.activation_checkpointing = cfg.train.activation_checkpointing
    lanes = cfg.parallel.ep_overlap_microbatches and dims.ep > 1
    if lanes and dist.is_initialized():  # collective over the world: every rank builds them, in the same order
        dims.build_backward_ep_groups(cfg.parallel.timeout_s)
    apply_ep(model, dims, cfg.parallel.ep_chunks if cfg.parallel.ep_overlap else 1, lanes=lanes,
             capacity=cfg.parallel.ep_capacity if cfg.parallel.ep_dispatch == "static" else None)
    if cfg.train.compile:  # per block, in place, before the gradient sync (FSDP2 wraps compiled blocks)
        compile_blocks(model, whole_blocks(cfg), graphs=cfg.train.cuda_graphs)
    tag_params(model, cfg.train.optimizer)  # each param's family, before the sync: its buckets and groups read it
    if cfg.train.qk_clip:  # each attention module keeps its heads' max logit of the step (model/qk_max.py)
        qk_max.track(model, (Attention, MLA))
    named = list(model.named_parameters())
    shard = ModelShard(model, spec, dims,
                       expert_params=[(n, p) for n, p in named if is_expert_param(n)],
                       replicated_params=[(n, p) for n, p in named if not is_expert_param(n)], ep_lanes=lanes,
                       tokens=model.tokens)

    # Init by global identity already agrees; the broadcast from each group's first rank is the seed's
    # belt and braces (and what makes a replica that diverged by a bug visible to check_replicas).
    distributed = dist.is_initialized() and dims.world_size > 1
    if distributed:
        broadcast_params(shard.replicated_params, dims.group_ranks("non_expert_dp")[0], dims.group("non_expert_dp"))
        broadcast_params(shard.expert_params, dims.group_ranks("expert_dp")[0], dims.group("expert_dp"))

    # The one place that picks the DP flavour: every later branch on it is a method of shard.sync.
    p = cfg.parallel
    scale = 1.0 / dims.data_world
    reduce_dtype = torch.bfloat16 if p.reduce_dtype == "bf16" else None  # None: reduce in the gradients' fp32
    args = (model, dims, shard.expert_params, shard.replicated_params)
    # what zero 2/3 hold during a step: gradients accumulated in shards or full, zero 3's params regathered or kept
    # (resolve.py settled "auto" with sync.zero_memory_choices)
    accumulate, reshard = p.zero_accumulate, p.zero3_reshard
    if p.dp_impl == "torch_ddp" and distributed:
        shard.sync = TorchDDPSync(*args, p.bucket_mb)
    elif p.zero == 3:  # FSDP2 on the non-expert-DP and expert-DP meshes
        # parallel.fp8_comm: the FP8 weights all-gathered as their forward operands, cast from the compute dtype
        fp8_from = (torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32) if p.fp8_comm else None
        shard.sync = FSDPSync(*args, p.bucket_mb, scale, accumulate, reshard, fp8_from)
    elif p.zero in (1, 2):
        shard.sync = ZeroSync(*args, p.bucket_mb, scale, p.zero, reduce_dtype, accumulate)
    else:
        shard.sync = ReplicatedSync(*args, p.bucket_mb, scale, reduce_dtype)
    shard.tied = TiedEmbedding.build(model, dims, cfg.model.mtp_layers, p.timeout_s)
    shard.rebalancer = Rebalancer.build(shard, p)
    return shard
