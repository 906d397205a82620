"""A weight held as its FP8 forward operand: e4m3 bits and their scales, standing in for the high-precision weight.

parallel.fp8_comm under ZeRO-3 (parallel/dp/fp8_gather.py) all-gathers an FP8 weight as the bits and scales its
forward GEMM reads, and FSDP2 makes the gathered result the module's parameter for the forward and backward. That
parameter is an `Fp8Weight`: it reports the weight's shape and dtype, so the module's code runs unchanged, and the
FP8 GEMMs (model/fp8.py `Float8Matmul`, `ExpertsMM`) read `bits` and `scale` as they are, without re-quantizing.

`scale` has the bits' rank with size 1 on each dim it spans (0-dim: the whole tensor); `bits / scale` are the values.
The views the modules take of a weight (transpose, unbind or select of an expert) and autocast's dtype change keep
the bits; any other op reads the dequantized values (`dequantize`), so nothing computes on the raw bits by mistake.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

aten = torch.ops.aten
_SAME = (aten.detach.default, aten.alias.default)
_TRANSPOSE = (aten.t.default, aten.transpose.int)


class Fp8Weight(torch.Tensor):
    bits: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, bits.shape, strides=bits.stride(), dtype=dtype,
                                                   device=bits.device, requires_grad=False)

    def __init__(self, bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.bits, self.scale = bits, scale

    def __repr__(self) -> str:
        return f"Fp8Weight({tuple(self.shape)}, {self.bits.dtype} bits, scale {tuple(self.scale.shape)}, {self.dtype})"

    def dequantize(self) -> torch.Tensor:
        return (self.bits.float() / self.scale).to(self.dtype)

    def __tensor_flatten__(self):
        return ["bits", "scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Fp8Weight(inner["bits"], inner["scale"], dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = args[0] if args else None
        if isinstance(w, Fp8Weight):
            if func in _SAME:
                return Fp8Weight(w.bits, w.scale, w.dtype)
            if func is aten._to_copy.default and set(kwargs) == {"dtype"}:  # autocast's cast: the same values
                return Fp8Weight(w.bits, w.scale, kwargs["dtype"])
            if func in _TRANSPOSE:
                scale = w.scale if w.scale.dim() == 0 else func(w.scale, *args[1:])
                return Fp8Weight(func(w.bits, *args[1:]), scale, w.dtype)
            if func is aten.unbind.int and (args[1:] or (0,))[0] == 0:  # the experts of a stacked weight
                return tuple(Fp8Weight(b, _scale_of(w, i), w.dtype) for i, b in enumerate(w.bits.unbind(0)))
            if func is aten.select.int and args[1] == 0:
                return Fp8Weight(w.bits[args[2]], _scale_of(w, args[2]), w.dtype)
            if func is aten.as_strided.default and tuple(args[1]) == tuple(w.shape):  # FSDP2's view of its param
                return Fp8Weight(w.bits.as_strided(*args[1:], **kwargs), w.scale, w.dtype)
        args, kwargs = pytree.tree_map_only(Fp8Weight, Fp8Weight.dequantize, (args, kwargs))
        return func(*args, **kwargs)


def _scale_of(w: Fp8Weight, i: int) -> torch.Tensor:
    """The scale of w's slice i along dim 0 (one spanning dim 0 serves every slice)."""
    s = w.scale
    return s if s.dim() == 0 else s[i] if s.shape[0] == w.shape[0] else s[0]


def operand(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(bits, scale) of a weight that arrived as its FP8 operand; None for a high-precision one."""
    return (w.bits, w.scale) if isinstance(w, Fp8Weight) else None
