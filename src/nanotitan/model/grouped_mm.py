"""The grouped experts' GEMM (`torch._grouped_mm`) as dynamo may trace it in any dtype.

torch 2.13's fake kernel of `_grouped_mm` (what dynamo and AOTAutograd run while tracing) accepts bf16 operands
only, though the CPU kernel runs fp32 too: a compiled block with fp32 grouped experts would not trace. `grouped_mm`
hands the traced graph an opaque op, `nanotitan::grouped_mm`, that calls the same kernel at run time, with a fake
kernel of any dtype and the backward autograd runs for `_grouped_mm` (the same two grouped GEMMs), so a compiled
block computes what the eager one does. Eagerly, and for bf16 operands (whose fake kernel exists, and which inductor
may lower on CUDA), it is `torch._grouped_mm` itself.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("nanotitan::grouped_mm", mutates_args=())
def _opaque(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


@_opaque.register_fake
def _(a, b, offs):
    if b.dim() == 3:  # rows of a grouped by offs, one [K, M] matrix per group
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])  # 2D x 2D: the shared dim grouped, one product per group


def _setup(ctx, inputs, output):
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _backward(ctx, grad):
    a, b, offs = ctx.saved_tensors  # forward only ever has a 2D and b 3D (the experts' projections)
    grad_a = _opaque(grad, b.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
    grad_b = _opaque(a.t(), grad, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


_opaque.register_autograd(_backward, setup_context=_setup)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm(a, b, offs=offs) for a 2D, b 3D; traced as an opaque op unless the operands are bf16."""
    if torch.compiler.is_compiling() and a.dtype != torch.bfloat16:
        return _opaque(a, b, offs)
    return torch._grouped_mm(a, b, offs=offs)
