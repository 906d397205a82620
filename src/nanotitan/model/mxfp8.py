"""MXFP8 training (train.fp8 mxfp8, docs/fp8.md): e4m3 elements, one e8m0 (power-of-2) scale per 32 consecutive
elements along each GEMM's contraction dim, torchao's recipe, casts and GEMMs (its emulated grouped GEMM's steps
redone in the compute dtype: `GroupedMM`).

- the dense projections: torchao's `mx_mm` (the autograd function its MXFP8Linear calls): forward
  `x @ W^T` with x and W blocked along K; grad input `dy @ W` with dy and W blocked along N; grad weight
  `dy^T @ x` in MXFP8 too, blocked along the tokens T (RCEIL scales, its MXFP8_RCEIL recipe). Every block is 32
  elements of one row or column, so a layout computes one process's scales without an amax reduction wherever it
  holds whole blocks: each rank's slice of a split width, and each rank's run of a split sequence, a multiple of
  32 (config/fp8_rules.py refuses the rest).
- the routed experts: torchao's MXFP8 grouped GEMM (`_to_mxfp8_then_scaled_grouped_mm`), forward and grad input
  blocked as above per assignment row and per expert, the weight gradient in high precision (its
  MXFP8_RCEIL_WGRAD_WITH_HP recipe): its token blocks would span an expert's tokens of the call, which under EP
  come from several ranks' microbatches, a set one process never forms (model/fp8.py says the same of rowwise).

The kernels are torchao's: its SM100 kernels where they load (a Blackwell GPU), else its EMULATED mode, which
quantizes with `to_mx` and multiplies the dequantized operands (exact: e4m3 times a power of 2) in their dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # elements per e8m0 scale, along the contraction dim (MXFP8's, torchao's only block size)
TORCHAO_MODULES = ("torchao.prototype.mx_formats.config", "torchao.prototype.moe_training.mxfp8_grouped_mm",
                   "torchao.prototype.moe_training.mxfp8_linear")  # imported quietly (model/fp8.py)


@dataclass(frozen=True)
class Mxfp8:
    """train.fp8 mxfp8: torchao's kernel choice (`KernelPreference`) and scale rounding (`ScaleCalculationMode`)."""
    kernels: object
    scale_mode: object
    recipe: str = "mxfp8"
    wire: bool = False  # parallel.fp8_comm: not with mxfp8 (config/fp8_rules.py)


def recipe() -> Mxfp8:
    """torchao's MXFP8 recipe: RCEIL scales; its SM100 kernels on a GPU that has them, else its emulation."""
    from torchao.prototype.moe_training import mxfp8_grouped_mm as grouped
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    sm100 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 10 and \
        grouped._SM100_KERNELS_AVAILABLE
    return Mxfp8(KernelPreference.AUTO if sm100 else KernelPreference.EMULATED, ScaleCalculationMode.RCEIL)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mx: Mxfp8) -> torch.Tensor:
    """F.linear in MXFP8: torchao's `mx_mm` (MXFP8Linear's function, with its torch casts along dim 1: the only
    ones that run everywhere), autocast honoured as model/fp8.py `linear` does."""
    from torchao.prototype.moe_training.mxfp8_linear import mx_mm
    from torchao.prototype.mx_formats.config import MXFP8Dim0CastKernelChoice, MXFP8Dim1CastKernelChoice

    dev = x.device.type
    e4m3 = torch.float8_e4m3fn
    dim0 = MXFP8Dim0CastKernelChoice.TORCH if mx.kernels.value == "emulated" else MXFP8Dim0CastKernelChoice.TRITON
    args = (e4m3, e4m3, e4m3, BLOCK, mx.kernels, dim0, MXFP8Dim1CastKernelChoice.TORCH, mx.scale_mode, False)
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        x, weight = x.to(dt), weight.to(dt)
        bias = None if bias is None else bias.to(dt)
        with torch.autocast(dev, enabled=False):
            y = mx_mm.apply(x.contiguous(), weight, *args)
    else:
        y = mx_mm.apply(x.contiguous(), weight, *args)
    return y if bias is None else y + bias.to(y.dtype)


def dequantized(t: torch.Tensor, mx: Mxfp8) -> torch.Tensor:
    """t as its MXFP8 operand holds it, in t's dtype: torchao's `to_mx` along the last dim (e4m3 bits, an e8m0
    scale per 32), times the scales, as torchao's emulated grouped GEMM reads it (exact: e4m3 times a power of 2)."""
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    scale, bits = to_mx(t.contiguous(), torch.float8_e4m3fn, BLOCK, mx.scale_mode)
    blocks = bits.reshape(*t.shape[:-1], t.shape[-1] // BLOCK, BLOCK).to(t.dtype) * scale.unsqueeze(-1).to(t.dtype)
    return blocks.reshape(t.shape)


class GroupedMM(torch.autograd.Function):
    """x @ W[l] for each group of rows (offs_L: their ends), torchao's emulated MXFP8 grouped GEMM
    (`_to_mxfp8_then_scaled_grouped_mm`, EMULATED, wgrad_with_hp) step for step, its operands dequantized in x's
    dtype: torch's CPU grouped GEMM returns only its operands' dtype, so torchao's (bf16 operands) cannot give an
    fp32 run its fp32 output. Forward: x along K, W along K; grad input: dy along N, W along N; grad W: high
    precision. tests/model/test_mxfp8.py holds it to torchao's op bit for bit in bf16."""

    @staticmethod
    def forward(ctx, x_MK, W_LKN, offs_L, mx: Mxfp8):
        ctx.save_for_backward(x_MK, W_LKN, offs_L)
        ctx.mx = mx
        w = dequantized(W_LKN.transpose(1, 2), mx).transpose(1, 2)
        return torch._grouped_mm(dequantized(x_MK, mx), w, offs=offs_L)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, W_LKN, offs_L = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dx = torch._grouped_mm(dequantized(dy_MN, ctx.mx), dequantized(W_LKN, ctx.mx).transpose(1, 2), offs=offs_L)
        dW = torch._grouped_mm(dy_MN.t(), x_MK, offs=offs_L).transpose(1, 2)
        return dx, dW, None, None


def _grouped(x_ND: torch.Tensor, W_LKN: torch.Tensor, offs_L: torch.Tensor, mx: Mxfp8) -> torch.Tensor:
    """x @ W[l] for each group of rows in MXFP8, weight gradient in high precision: torchao's grouped GEMM on its
    SM100 kernels (W handed per-group column-major, groups padded to 32 rows as they need), else `GroupedMM`."""
    if mx.kernels.value == "emulated":
        return GroupedMM.apply(x_ND, W_LKN, offs_L, mx)
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm

    W_LKN = W_LKN.transpose(1, 2).contiguous().transpose(1, 2)
    return _to_mxfp8_then_scaled_grouped_mm(
        x_ND, W_LKN, offs_L, out_dtype=x_ND.dtype, kernel_preference=mx.kernels, wgrad_with_hp=True,
        scale_calculation_mode=mx.scale_mode, pad_token_groups_for_grouped_mm=True)


def experts(x_ND: torch.Tensor, W_gate: torch.Tensor, W_val: torch.Tensor, W_out: torch.Tensor,
            counts_L: list[int], mx: Mxfp8) -> torch.Tensor:
    """L SwiGLU experts on contiguous row groups, each projection one MXFP8 grouped GEMM (`_grouped`)."""
    dev = x_ND.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        x_ND, W_gate, W_val, W_out = (t.to(dt) for t in (x_ND, W_gate, W_val, W_out))
    if x_ND.shape[0] == 0:  # no rows: nothing to quantize (the weights still join the graph, with zero gradients)
        return x_ND.new_zeros(0, x_ND.shape[1]) + 0 * (W_gate.sum() + W_val.sum() + W_out.sum())
    offs_L = torch.tensor(counts_L, device=x_ND.device).cumsum(0).to(torch.int32)
    with torch.autocast(dev, enabled=False):
        h = torch.nn.functional.silu(_grouped(x_ND, W_gate, offs_L, mx)) * _grouped(x_ND, W_val, offs_L, mx)
        return _grouped(h, W_out, offs_L, mx)
