"""ZeRO-3: parameters, gradients and optimizer state sharded over DP through torch FSDP2 (`fully_shard`).

Two meshes, as torchtitan shards an MoE (models/llama4/infra/parallelize.py), each a `DeviceMesh.from_group`
of a ParallelDims group, so FSDP reduces each gradient over exactly the ranks our Reducer would:
- the non-expert-DP group (dp*ep ranks of one stage) for everything replicated: each Block, and the root
  (embedding, final norm, head). FSDP's default average over it is DESIGN §4's rule for replicated grads.
- the expert-DP group (dp ranks) for each MoE layer's `experts` (disjoint over EP, replicated over DP).
  Their grads are summed over it and divided by dp*ep, not by its size dp (the seed's division by EP):
  `set_gradient_divide_factor(dp*ep)`. With dp == 1 there is nothing to shard them over: FSDP ignores
  them and the caller syncs them with a Reducer (group None, scale 1/(dp*ep)), as at zero 0.

Once per step, not per microbatch (our PP schedules and gradient accumulation run M forwards and
backwards per step): `reshard_after_forward=False` keeps the all-gathered params through the step, and
`FSDPSync.prepare(sync)` (the Reducer's protocol) tells FSDP before each backward whether it is the
step's final one: only then does it reduce-scatter and reshard. So per step: one all-gather per module at
the first forward, one reduce-scatter per module during the final backward, full params live from the
first forward to the end of the final backward, and between steps 1/N of params, grads and state.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import Shard

from .dims import ParallelDims


def apply_fsdp(model: nn.Module, dims: ParallelDims) -> list[nn.Parameter]:
    """Shard this stage's Transformer in place (experts, then blocks, then the root).

    Returns the params FSDP leaves alone (the experts when dp == 1), for a Reducer to sync."""
    group = dims.group("non_expert_dp")
    if group is None:
        raise ValueError("parallel.zero=3 shards over dp*ep ranks, here 1 (--parallel.zero 0, or dp/ep > 1)")
    device_type = next(model.parameters()).device.type
    mesh = DeviceMesh.from_group(group, device_type)
    expert_group = dims.group("expert_dp")
    expert_mesh = DeviceMesh.from_group(expert_group, device_type) if expert_group is not None else None
    unsharded: list[nn.Parameter] = []
    for block in model.layers.values():
        if block.is_moe and expert_mesh is not None:
            experts = block.moe.experts
            # Shard(0) splits the local experts; with fewer local experts than DP ranks, split D instead.
            dim = 0 if experts.W_gate.shape[0] % expert_mesh.size() == 0 else 1
            fully_shard(experts, mesh=expert_mesh, reshard_after_forward=False,
                        shard_placement_fn=lambda p, d=dim: Shard(d))
            experts.set_gradient_divide_factor(float(dims.data_world))
            # A factor other than the mesh size needs PREMUL_SUM, which gloo lacks: SUM, then scale.
            experts.set_force_sum_reduction_for_comms(True)
        elif block.is_moe:
            unsharded += list(block.moe.experts.parameters())
        fully_shard(block, mesh=mesh, reshard_after_forward=False, ignored_params=set(unsharded) or None)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, ignored_params=set(unsharded) or None)
    # A rank whose tokens never reach some module must still enter that module's reduce-scatter.
    model.set_reduce_scatter_unused_params(True)
    return unsharded


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups, decay on matrices only (the trainer's rule), one group per (decay, mesh): a fused
    optimizer kernel takes one list of tensors, and DTensors of different meshes (or plain tensors:
    experts FSDP leaves alone) cannot share a call."""
    groups: dict[tuple, list] = {}
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        groups.setdefault((p.dim() >= 2, id(mesh) if mesh is not None else None), []).append(p)
    return [{"params": ps, "weight_decay": weight_decay if decay else 0.0} for (decay, _), ps in groups.items()]


class FSDPSync:
    """The Reducer's per-step protocol for a model sharded by `apply_fsdp`.

    `prepare(sync)` before each microbatch's backward: only the final one (sync=True) reduce-scatters
    and reshards; `finish()` has nothing to wait for (FSDP waits for its reduce-scatters at the end of
    the final backward); `zero_grad()` zeroes the sharded grads in place (FSDP adds the next step's
    reduce-scatter into them: 0 + g is exact), so like zero 2 a rank keeps 1/N of the gradients between
    steps. The optimizer steps the model's params, which are DTensor shards.
    """

    def __init__(self, model: FSDPModule):
        self.model = model

    def prepare(self, sync: bool) -> None:
        self.model.set_requires_gradient_sync(sync)
        self.model.set_reshard_after_backward(sync)
        self.model.set_is_last_backward(sync)

    def finish(self) -> None:
        pass

    @torch.no_grad()
    def zero_grad(self) -> None:
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.zero_()

    @property
    def shard_params(self) -> list[nn.Parameter]:
        """The DTensor params (what the optimizer steps and the clip counts as shards)."""
        return [p for p in self.model.parameters() if hasattr(p, "to_local")]


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    """({param name: full tensor}, {param name: {state key: full tensor}}) of an FSDP2 model and its
    optimizer, as a replicated one would hold them (collective: all-gathers over each mesh)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    opts = StateDictOptions(full_state_dict=True)
    model_state = get_model_state_dict(model, options=opts)
    if optimizer is None:
        return model_state, {}
    return model_state, get_optimizer_state_dict(model, optimizer, options=opts)["state"]


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                    optim_state: dict | None) -> None:
    """Inverse of `full_state`: every rank passes the full tensors and keeps its shards."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=opts)
    if optim_state is not None:
        groups = get_optimizer_state_dict(model, optimizer, options=opts)["param_groups"]
        set_optimizer_state_dict(model, optimizer, {"state": optim_state, "param_groups": groups}, options=opts)
