"""parallel.fp8_comm under ZeRO-3: FSDP2 all-gathers each FP8 weight as the operand its forward GEMM reads, e4m3 bits
and scales, as torchao's float8 all-gather for FSDP2 does (its WeightWithDynamicFloat8CastTensor), for both recipes
and for the routed experts too.

The mechanism is FSDP2's all-gather extension: a sharded parameter's local tensor may carry `fsdp_pre_all_gather`
(what to send: here the shard cast to FP8) and `fsdp_post_all_gather` (what the module gets: here an `Fp8Weight`,
model/fp8_weight.py, which the FP8 GEMMs read as it is). FSDP2 reads them when it first gathers ("allow monkey patch
after init"), so `install` sets them on the local tensors of a sharded model before its first forward. The
checkpoints, the optimizer and the gradients see the fp32 shards as before: only the gathered copy is FP8.

Each cast is the one one process makes of the whole weight (model/fp8.py `_weight`, `_expert_weight`), computed on
the shards: the amax over the dims its scale spans, reduced (MAX, exact) over the TP ranks where TP cuts those dims
(the linear's `fp8_split`) and over the shard group where the shard does (a power-of-2 scale, rowwise's, as the MIN
of the ranks' exponents: the largest amax gives the smallest scale; one byte each); the bits elementwise. So the
GEMMs read one process's bits:
- a linear's weight [N, K], sharded on N: tensorwise, one scale, reduced over the group and sent as metadata (the
  same on every rank); rowwise, one per output feature (a row: whole on its rank), all-gathered beside the bits as
  its exponent, one byte (the recipe's scales are powers of 2).
- an expert weight [L, K, N], per expert per column (rowwise) or per expert (tensorwise): sharded on L (whole
  experts), the scales all-gathered; on K, the amax reduced over the group and the scales sent as metadata.
A weight whose rows do not divide evenly over the group, with scales to all-gather, stays high precision (FSDP2
pads its rows, and the scales cannot take the padding's shape).

Bytes: K + 1 per row of a rowwise linear, K per row at tensorwise plus one 4-byte amax all-reduce per weight and
gather, against 2K for the bf16 payload (4K for the fp32 masters FSDP2 gathers by default); an expert weight
[L, K, N] at rowwise K + 1 per column, whether its scales are all-gathered or their exponents all-reduced;
tests/parallel/test_fsdp_fp8.py measures them in the comm meter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ...model.fp8 import Fp8, Reduce, exponent_scale, scale_exponent
from ...model.fp8_weight import Fp8Weight
from ..comm import collectives as comm


@dataclass(frozen=True)
class _Cast:
    """How one weight's forward operand is cast on its shard and rebuilt from the gathered pieces."""
    fp8: Fp8
    hp_dtype: torch.dtype  # what the forward casts from (autocast's dtype: the GEMM's)
    shape: tuple[int, ...]  # the whole weight's
    shard_dim: int
    amax_dims: tuple[int, ...]  # the weight dims each scale spans
    reduces: tuple[Reduce, ...]  # the TP ranks' MAX over dims it spans that TP cuts

    @property
    def gathered_scale(self) -> bool:  # the shard does not cut the scale's dims: each rank's scales are its own
        return self.shard_dim not in self.amax_dims

    def pre_all_gather(self, shard: torch.Tensor, mesh) -> tuple[tuple[torch.Tensor, ...], object]:
        from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

        fp8, hp = self.fp8, shard.to(self.hp_dtype)
        keep = tuple(1 if d in self.amax_dims else n for d, n in enumerate(hp.shape))
        amax = (hp.abs().amax(dim=self.amax_dims, keepdim=True) if hp.numel() else hp.new_zeros(keep)).float()
        for reduce in self.reduces:
            amax = reduce(amax)
        if not self.gathered_scale and not fp8.pow2:
            comm.all_reduce(amax, group=mesh.get_group(), axis="dp", op=dist.ReduceOp.MAX)
        scale = amax_to_scale(amax, fp8.forward_dtype, round_scales_to_power_of_2=fp8.pow2)
        if not self.gathered_scale and fp8.pow2:  # the largest amax's scale is the smallest: its exponent's MIN
            exponent = scale_exponent(scale)
            comm.all_reduce(exponent, group=mesh.get_group(), axis="dp", op=dist.ReduceOp.MIN)
            scale = exponent_scale(exponent)
        bits = to_fp8_saturated(hp.to(torch.float32) * scale, fp8.forward_dtype)
        rows = -(-self.shape[self.shard_dim] // mesh.size())  # FSDP2's padded shard
        if bits.shape[self.shard_dim] < rows:  # (only where the scales are metadata: `install`)
            padded = list(bits.shape)
            padded[self.shard_dim] = rows
            full = bits.new_zeros(padded)
            full.narrow(self.shard_dim, 0, bits.shape[self.shard_dim]).copy_(bits)
            bits = full
        if not self.gathered_scale:
            return (bits,), scale
        return (bits, scale_exponent(scale) if fp8.pow2 else scale), None

    def post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata, dtype: torch.dtype,
                        out: Fp8Weight | None = None):
        bits = outputs[0].reshape(-1)[:math.prod(self.shape)].view(self.shape)  # a view: FSDP2 refills the storage
        if self.gathered_scale:
            scale = exponent_scale(outputs[1]) if self.fp8.pow2 else outputs[1]
            scale = scale.view(tuple(1 if d in self.amax_dims else n for d, n in enumerate(self.shape)))
        else:
            scale = metadata
        if len(self.shape) == 2 and not self.fp8.rowwise:
            scale = scale.reshape(())  # torchao's tensorwise scale
        if out is not None:  # a later gather into the same parameter: the bits' storage is refilled
            out.scale.copy_(scale)
            return None
        return Fp8Weight(bits, scale, dtype), ()


def _casts(module: nn.Module) -> list[tuple[str, tuple[int, ...], tuple[Reduce, ...]]]:
    """(parameter, the dims its forward operand's scales span, the TP reductions of those) of an FP8 module."""
    fp8 = module.fp8
    if hasattr(module, "W_gate"):  # an ExpertFFN: [L, K, N] per expert, per column (over K) or whole
        dims = (1,) if fp8.rowwise else (1, 2)
        return [(name, dims, ()) for name in ("W_gate", "W_val", "W_out")]
    split = module.fp8_split  # a linear's weight [N, K]: per output feature (over K), or whole
    if fp8.rowwise:
        return [("weight", (1,), split.inner)]
    return [("weight", (0, 1), (*split.inner, *split.outer))]


def install(model: nn.Module, hp_dtype: torch.dtype) -> list[str]:
    """Make FSDP2 all-gather every sharded weight of `model`'s FP8 modules with fp8.wire in FP8 (module docstring),
    cast from `hp_dtype` (the forward's compute dtype). Call after `fully_shard`, before the first forward. Returns
    the parameters' names."""
    done = []
    for mname, module in model.named_modules():
        fp8 = getattr(module, "fp8", None)
        if fp8 is None or not fp8.wire:
            continue
        for pname, amax_dims, reduces in _casts(module):
            p = module._parameters.get(pname)
            if not isinstance(p, DTensor):  # left whole by FSDP (TP-partial, or experts at dp 1)
                continue
            (place,) = p.placements
            cast = _Cast(fp8, hp_dtype, tuple(p.shape), place.dim, amax_dims, reduces)
            if cast.gathered_scale and p.shape[place.dim] % p.device_mesh.size():
                continue  # padded rows: the scales cannot take the padding's shape (module docstring)
            _attach(p._local_tensor, cast)
            done.append(f"{mname}.{pname}")
    return done


def _attach(local: torch.Tensor, cast: _Cast) -> None:
    """FSDP2's extension on one local shard: its signature (mesh, outer_size, outer_stride, module, mp_policy)."""
    def fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy):
        return cast.pre_all_gather(local, mesh)

    def fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None):
        return cast.post_all_gather(outputs, metadata, param_dtype, out)

    local.fsdp_pre_all_gather = fsdp_pre_all_gather
    local.fsdp_post_all_gather = fsdp_post_all_gather
