"""ZeRO-3: parameters, gradients and optimizer state sharded over DP through torch FSDP2 (`fully_shard`).

Two meshes, as torchtitan shards an MoE (models/llama4/infra/parallelize.py), each a `DeviceMesh.from_group`
of a ParallelDims group, so FSDP reduces each gradient over exactly the ranks our Reducer would:
- the non-expert-DP group (dp*ep ranks of one stage) for everything replicated: each Block, and the root
  (embedding, final norm, head). FSDP's default average over it is docs/design.md §4's rule for replicated grads.
- the expert-DP group (dp ranks) for each MoE layer's `experts` (disjoint over EP, replicated over DP).
  Their grads are summed over it and divided by dp*ep, not by its size dp (the seed's division by EP):
  `set_gradient_divide_factor(dp*ep)`. With ep == 1 that group is the block's and dp*ep its size: the experts
  are then in their block's unit (one all-gather and one reduce-scatter per block; `experts_in_block_unit`).
  With dp == 1 there is nothing to shard them over (`shards_experts`): FSDP ignores them and `FSDPSync` syncs
  them with a Reducer (group None, scale 1/(dp*ep)), as at zero 0.

What a rank holds during a step is two choices (`sync.zero_memory_choices`, docs/dp.md "Peak memory"):
- parallel.zero3_reshard: "always" frees a module's gathered params after its forward and after its backward
  (FSDP2's `reshard_after_forward=True`): full params exist only around one module's forward or backward, for
  2M all-gathers per module per step. Without PP the last block (and its experts) is the exception, as in
  torchtitan's default policy: its backward starts right after the head's, so it stays gathered from its
  forward to its backward (M all-gathers, not 2M; `kept_gathered`). The root FSDP2 never reshards after its
  forward.
  "never" keeps them from the step's first forward to the end of its final backward: one all-gather per
  module per step.
- parallel.zero_accumulate: "shard" reduce-scatters every microbatch's gradients into the sharded grads (FSDP2
  adds each into the last), so no full gradient outlives its module's backward: M reduce-scatters per module.
  "full" accumulates unsharded gradients over the step and reduce-scatters once, in the final backward.
`FSDPSync.prepare(sync)` (the Reducer's protocol, called before each microbatch's backward) sets FSDP's flags
accordingly. Between steps a rank holds 1/N of params, grads and state either way.

With parallel.fp8_comm the FP8 modules' weights are all-gathered as their FP8 forward operands (bits and scales,
dp/fp8_gather.py); everything else, and every gradient, as before.

`shards_experts`, `experts_in_block_unit` and `kept_gathered` are the rules `apply_fsdp` follows; the planner's
memory and time models (plan/memory.py, plan/steptime.py) call the same functions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

try:  # FSDP2's pluggable collectives (torch >= 2.8; not re-exported, so the private module)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover
    AllGather = ReduceScatter = None

from ...model.families import keep_tag, tag_of
from ..comm import collectives as comm
from ..clip import clip_grad_norm_
from ..dims import ParallelDims
from .reducer import Reducer
from .sync import GradSync, Pieces
from ..shard import Grad, grad_layout, keep_layout, token_ranks
from . import fp8_gather


def shards_experts(dp: int) -> bool:
    """FSDP shards the experts over the expert-DP group (dp ranks); with dp == 1 there is nothing to shard them
    over, and `FSDPSync` leaves them to a Reducer."""
    return dp > 1


def experts_in_block_unit(dp: int, ep: int) -> bool:
    """With ep == 1 (EP x CP: the CP ranks hold other experts too, docs/cp.md) the experts' group is their block's
    (the same dp ranks, and the mean over them the default):
    they join the block's FSDP unit, one all-gather and one reduce-scatter per block instead of two (on gloo each
    exchange costs both ranks a rendezvous and the caller its send)."""
    return shards_experts(dp) and ep == 1


def kept_gathered(n_blocks: int, pp: int) -> list[int]:
    """The blocks (indices into a stage's `n_blocks`) that zero3_reshard "always" does not reshard after their
    forward: without PP the last block, whose backward starts right after the head's, so resharding it would only
    gather it again at once (torchtitan's default policy; the root FSDP2 keeps itself)."""
    return [n_blocks - 1] if pp == 1 and n_blocks > 0 else []


def apply_fsdp(model: nn.Module, dims: ParallelDims, reshard_after_forward: bool = False,
               fp8_from: torch.dtype | None = None) -> list[nn.Parameter]:
    """Shard this stage's Transformer in place (experts, then blocks, then the root); `reshard_after_forward`
    frees each module's gathered params after its forward (parallel.zero3_reshard=always), except the blocks
    `kept_gathered` names (module docstring). `fp8_from` (parallel.fp8_comm: the forward's compute dtype): the FP8
    modules' weights are all-gathered as their FP8 operands, cast from that dtype (dp/fp8_gather.py).

    Returns the params FSDP leaves alone (the experts when dp == 1), for a Reducer to sync."""
    group = dims.group("non_expert_dp")
    if group is None:
        raise ValueError("parallel.zero=3 shards over dp*ep ranks, here 1 (--parallel.zero 0, or dp/ep > 1)")
    device_type = next(model.parameters()).device.type
    mesh = DeviceMesh.from_group(group, device_type)
    expert_mesh = DeviceMesh.from_group(dims.group("expert_dp"), device_type) if shards_experts(dims.dp) else None
    # TP-replicated params with partial gradients stay whole (FSDPSync reduces them over the stage, tp.py)
    unsharded: list[nn.Parameter] = [q for q in model.parameters() if grad_layout(q).kind is Grad.PARTIAL]
    merge = experts_in_block_unit(dims.dp, dims.moe_ep // dims.tp)  # EP x CP: the ranks with other experts
    blocks = list(model.layers.values())
    kept = kept_gathered(len(blocks), dims.pp)
    for i, block in enumerate(blocks):
        reshard = reshard_after_forward and i not in kept
        shard_dim_of = None  # FSDP2's shard_placement_fn: Shard(dim) per param
        if block.is_moe and expert_mesh is not None:
            experts = block.moe.experts
            # Shard(0) splits the local experts; with fewer local experts than DP ranks, split D instead.
            dim = 0 if experts.W_gate.shape[0] % expert_mesh.size() == 0 else 1
            if merge:
                ids = {id(q) for q in experts.parameters()}
                shard_dim_of = lambda p, d=dim, ids=ids: Shard(d if id(p) in ids else 0)
            else:
                fully_shard(experts, mesh=expert_mesh, reshard_after_forward=reshard,
                            shard_placement_fn=lambda p, d=dim: Shard(d))
                experts.set_gradient_divide_factor(float(dims.data_world))
                # A factor other than the mesh size needs PREMUL_SUM, which gloo lacks: SUM, then scale.
                experts.set_force_sum_reduction_for_comms(True)
        elif block.is_moe:
            unsharded += list(block.moe.experts.parameters())
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, ignored_params=set(unsharded) or None,
                    shard_placement_fn=shard_dim_of)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=set(unsharded) or None)
    if mesh.size() != dims.data_world:  # CP's ranks joined the mesh: their gradients are parts, summed (docs/cp.md)
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):  # every fully_shard'ed module
                module.set_gradient_divide_factor(float(dims.data_world))
                module.set_force_sum_reduction_for_comms(True)
    # A rank whose tokens never reach some module must still enter that module's reduce-scatter.
    model.set_reduce_scatter_unused_params(True)
    if AllGather is not None and comm.backend(group) in comm.SHARDED_BY_EXCHANGE:
        for module in model.modules():
            if hasattr(module, "set_custom_all_gather"):  # every fully_shard'ed module
                module.set_custom_all_gather(_AllGatherByComm())
                module.set_custom_reduce_scatter(_ReduceScatterByComm())
    if fp8_from is not None:
        fp8_gather.install(model, fp8_from)
    return [q for q in unsharded if grad_layout(q).kind is not Grad.PARTIAL]


# On the backends comm.SHARDED_BY_EXCHANGE names (gloo) FSDP2's two collectives go through comm.py as ZeRO-1/2's do:
# direct exchanges between the ranks, a ring's bytes, where gloo's own reduce-scatter and all-gather cost about
# twice its all-reduce of the full buffer; recorded, stall-tracked and emulated as every comm.py call.
if AllGather is not None:
    class _AllGatherByComm(AllGather):
        def allocate(self, size, *, dtype, device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if output_tensor.element_size() == 1:  # FP8 weights (fp8_gather.py): gloo's P2P takes them as bytes
                output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
            work = comm.all_gather(output_tensor, input_tensor, group)  # FSDP2 copies in: in place
            if not async_op:
                work.wait()
                return None
            return _Work(work)

    class _ReduceScatterByComm(ReduceScatter):
        def allocate(self, size, *, dtype, device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # AVG: the mean over the non-expert-DP mesh
                raise RuntimeError(f"FSDP2 asked gloo for a {op} reduce-scatter; the exchange sums or averages")
            comm.reduce_scatter(output_tensor, input_tensor, group,
                                average=op == dist.ReduceOp.AVG).wait()  # FSDP2 calls it blocking on CPU
            return None

    class _Work(dist.Work):
        """A TimedWork as the c10d Work FSDP2 waits for (it checks the type)."""

        def __init__(self, work):
            super().__init__()
            self.work = work

        def wait(self, timeout=None) -> bool:
            self.work.wait()
            return True


def param_groups(model: nn.Module) -> list[dict]:
    """One group per (family tag, mesh): a fused optimizer kernel takes one list of tensors, and DTensors of
    different meshes (or plain tensors: experts FSDP leaves alone) cannot share a call. {"params", "tag"}."""
    groups: dict[tuple, list] = {}
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        groups.setdefault((tag_of(p), id(mesh) if mesh is not None else None), []).append(p)
    return [{"params": ps, "tag": tag} for (tag, _), ps in groups.items()]


class FSDPSync(GradSync):
    """zero 3: the model sharded by `apply_fsdp`, with the Reducer's per-step protocol.

    `prepare(sync)` before each microbatch's backward: with accumulate "full" only the final one (sync=True)
    reduce-scatters, with "shard" every one; with reshard "never" only the final one frees the gathered params,
    with "always" every one (and every forward). `finish()` waits only for the Reducer of experts FSDP left
    whole (dp == 1; FSDP waits for its own reduce-scatters at the end of a backward it was told is the last);
    `zero_grad()` zeroes the sharded grads in place (FSDP adds the next reduce-scatter into them: 0 + g is
    exact), so like zero 2 a rank keeps 1/N of the gradients between steps. The optimizer steps the model's
    params, which are DTensor shards.
    """

    def __init__(self, model, dims, expert_params, replicated_params, bucket_mb: float, scale: float,
                 accumulate: str = "full", reshard: str = "never", fp8_from: torch.dtype | None = None):
        super().__init__(model, dims, expert_params, replicated_params)
        if accumulate not in ("shard", "full") or reshard not in ("always", "never"):
            raise ValueError(f"FSDPSync takes accumulate shard|full and reshard always|never, got {accumulate!r}, "
                             f"{reshard!r} (sync.zero_memory_choices resolves auto)")
        self.every_backward, self.reshard = accumulate == "shard", reshard == "always"
        before = dict(model.named_parameters())
        left = {id(q) for q in apply_fsdp(model, dims, reshard_after_forward=self.reshard, fp8_from=fp8_from)}
        # fully_shard replaced the model's params by DTensor shards; the caller's lists (ModelShard's too) must
        # name those, in place: a reference to an original would keep a full copy of it alive all run.
        current = dict(model.named_parameters())
        for n, q in current.items():  # each lies as its original (a TP slice: the checkpoint places it by its part)
            keep_layout(before[n], q)
            keep_tag(before[n], q)
        before.clear()
        for named in (expert_params, replicated_params):
            named[:] = [(n, current[n]) for n, _ in named]
        # shards of params whole on every token rank (TP's norms without SP): clipping counts them once among them
        self.counted_once = {id(q) for q in current.values() if grad_layout(q).kind is Grad.WHOLE}
        self.unsharded = [(n, q) for n, q in expert_params if id(q) in left]
        # experts with no expert-DP group to shard over: scaled by 1/(dp*ep), as at zero 0
        self.reducer = Reducer(self.unsharded, None, bucket_mb, scale) if self.unsharded else None
        # TP-partial params (whole, outside FSDP): summed over the stage, scaled by 1/(dp*ep) (sync.gradient_groups)
        self.partial = [(n, q) for n, q in replicated_params if grad_layout(q).kind is Grad.PARTIAL]
        self.tp_reducer = Reducer(self.partial, dims.group("stage"), bucket_mb, scale) if self.partial else None

    def prepare(self, sync: bool) -> None:
        # A backward that reduce-scatters is "last" to FSDP: it waits for (and frees) its reduce-scatter buffers.
        self.model.set_requires_gradient_sync(sync or self.every_backward)
        self.model.set_reshard_after_backward(sync or self.reshard)
        self.model.set_is_last_backward(sync or self.every_backward)
        for r in (self.reducer, self.tp_reducer):
            if r is not None:
                r.prepare(sync)

    def finish(self) -> None:
        for r in (self.reducer, self.tp_reducer):
            if r is not None:
                r.finish()
        self.copies.sum_pieces(self)  # a replicated expert's copies: their reduced pieces summed (rebalance.py)

    @torch.no_grad()
    def zero_grad(self) -> None:
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        for r in (self.reducer, self.tp_reducer):
            if r is not None:
                r.zero_grad()

    def param_groups(self) -> list[dict]:
        return param_groups(self.model)

    def clip(self, max_norm: float) -> torch.Tensor:
        """DTensor shards are disjoint over non-expert-DP; experts FSDP left whole (dp == 1) differ over EP."""
        whole = [q for _, q in self.unsharded]
        shards = [q for q in self.model.parameters() if hasattr(q, "to_local")]
        partial = [q for _, q in self.partial]  # whole, summed over the stage: replicated over EP like any
        # TP slices' shards add up over the stage; shards identical over the token ranks count once among them
        return clip_grad_norm_(whole, partial, max_norm, self.dims.group("pp"),
                               self.dims.group("ep") if whole or partial else None,
                               [q for q in shards if id(q) not in self.counted_once], self.dims.group("stage"),
                               token_ranks=token_ranks(self.dims),
                               shard_once=[q for q in shards if id(q) in self.counted_once],
                               counted_elsewhere=self.counted_elsewhere())

    def local_grad(self, p: nn.Parameter) -> torch.Tensor:
        """A DTensor's local shard of its gradient (FSDP's own storage: a view); a param FSDP left whole, its .grad."""
        return p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad

    def grad_pieces(self, names: set[str]) -> dict[str, Pieces]:
        """Each named DTensor grad's local shard at its offsets (a param FSDP left whole: whole)."""
        return {n: _local_pieces(p.grad) for n, p in self.model.named_parameters() if n in names and p.grad is not None}

    grads_whole = False

    def resharded(self) -> nn.Module:
        """The model with every FSDP module sharded: a forward outside backward (eval) leaves the modules that do
        not reshard after their forward gathered (`never`, and the last block under `always`), and a gathered
        module's params are plain tensors the optimizer does not know. Collective-free (frees the gathered copies)."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return self.model

    def sharded_state(self, optimizer):
        """Each DTensor's local shard (FSDP's own storage) at its offsets in the whole tensor; experts FSDP left
        whole (dp == 1), whole. Nothing gathered."""
        named = dict(self.resharded().named_parameters())
        model_state = {n: _local_pieces(p) for n, p in named.items()}
        optim_state = {}
        if optimizer is not None:
            for n, p in named.items():
                state = optimizer.state_of(p)
                optim_state[n] = {k: _local_pieces(v) for k, v in state.items() if torch.is_tensor(v)}
        return model_state, optim_state

    def state_boxes(self, names: set[str], peer: int) -> dict[str, list[tuple]]:
        """`peer`'s chunk of each named DTensor (one Shard(dim) over its mesh's group, torch.chunk's sizes: ceil(n
        / ranks) each, the last ones short or empty, as `_local_pieces` finds this rank's); a plain tensor whole."""
        out = {}
        for n, q in self.resharded().named_parameters():
            if n not in names:
                continue
            if not isinstance(q, DTensor):
                out[n] = [((0,) * q.dim(), tuple(q.shape))]
                continue
            (place,) = q.placements  # apply_fsdp: a 1-D mesh of one ParallelDims group
            ranks = dist.get_process_group_ranks(q.device_mesh.get_group())
            d, at, size = place.dim, self.dims.place_like(ranks, peer), q.shape[place.dim]
            step = -(-size // len(ranks))
            lo, hi = min(at * step, size), min((at + 1) * step, size)
            offsets, sizes = [0] * q.dim(), list(q.shape)
            offsets[d], sizes[d] = lo, hi - lo
            out[n] = [(tuple(offsets), tuple(sizes))] if hi > lo else []
        return out


def _local_pieces(t: torch.Tensor) -> Pieces:
    """A DTensor as this rank's one box (none when its shard is empty: FSDP's uneven last ranks); a plain
    tensor (AdamW's step, an expert FSDP left whole) whole."""
    if not isinstance(t, DTensor):
        return Pieces.whole(t)
    with unset_fake_temporarily():  # torch finds the offsets with tensors and reads them: real ones under the dry
        # run's FakeTensorMode, whose routing answer to a host read (plan/dryrun.py) is no offset
        sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t.to_local().detach()
    assert tuple(local.shape) == tuple(sizes), (local.shape, sizes)
    return Pieces(t.shape, [(tuple(offsets), local)] if local.numel() else [])

