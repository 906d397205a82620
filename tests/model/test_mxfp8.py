"""train.fp8 mxfp8 (model/mxfp8.py, docs/fp8.md) against MXFP8's definition, written here from its words: e4m3
elements, one power-of-2 scale per 32 consecutive elements along each GEMM's contraction dim, RCEIL (the scale the
smallest power of 2 that brings the block's amax within e4m3's 448). The dense linear quantizes all three GEMMs so
(the weight gradient's blocks along the tokens); the routed experts their forward and input gradient, the weight
gradient in high precision. And the blocks are local: a layout that cuts a dim at a multiple of 32 computes one
process's operands."""

import pytest
import torch

pytest.importorskip("torchao")

from nanotitan.model import fp8 as float8  # noqa: E402
from nanotitan.model.moe import ExpertFFN  # noqa: E402
from nanotitan.model.wgrad import Linear  # noqa: E402

E4M3_MAX = 448.0


def mx(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t as MXFP8 holds it, dequantized in fp32: blocks of 32 along `dim`, each scaled by 2^ceil(log2(amax/448))."""
    t = t.float().movedim(dim, -1)
    blocks = t.reshape(*t.shape[:-1], t.shape[-1] // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    q = (blocks / scale).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(t.shape).movedim(-1, dim)


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_linear_is_mxfp8_in_all_three_gemms():
    torch.manual_seed(0)
    lin = Linear(64, 96, bias=True)
    lin.fp8 = float8.recipe("mxfp8")
    x = torch.randn(2, 32, 64, requires_grad=True)
    y = lin(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    x2, w, dy2 = x.detach().reshape(-1, 64), lin.weight.detach(), dy.reshape(-1, 96)
    close(y.detach(), (mx(x2, 1) @ mx(w, 1).t() + lin.bias.detach()).reshape(2, 32, 96))
    close(x.grad, (mx(dy2, 1) @ mx(w, 0)).reshape(2, 32, 64))
    close(lin.weight.grad, mx(dy2, 0).t() @ mx(x2, 0))  # the tokens' blocks: 32 rows each
    close(lin.bias.grad, dy2.sum(0))
    assert not torch.allclose(y, torch.nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-4), "no rounding"


def test_experts_are_mxfp8_grouped_gemms_with_the_weight_gradient_in_high_precision():
    torch.manual_seed(1)
    D, F, counts = 32, 64, [5, 0, 11, 16]
    ffn = ExpertFFN(len(counts), D, F)
    for p in ffn.parameters():
        torch.nn.init.normal_(p, std=0.1)
    ffn.fp8 = float8.recipe("mxfp8")
    x = torch.randn(sum(counts), D, requires_grad=True)
    y = ffn(x, counts)
    dy = torch.randn_like(y)
    y.backward(dy)

    # the reference: per expert, operands quantized as above, autograd through their dequantized values, so the
    # weight gradients read the high-precision activations while the input gradient's operands are quantized
    class MxMM(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, w):
            ctx.save_for_backward(a, w)
            return mx(a, 1) @ mx(w, 0)

        @staticmethod
        def backward(ctx, g):
            a, w = ctx.saved_tensors
            return mx(g, 1) @ mx(w, 1).t(), a.t() @ g

    ref = [p.detach().clone().requires_grad_() for p in (ffn.W_gate, ffn.W_val, ffn.W_out)]
    xr = x.detach().clone().requires_grad_()
    ys = []
    for xe, wg, wv, wo in zip(xr.split(counts), *(r.unbind(0) for r in ref)):
        ys.append(MxMM.apply(torch.nn.functional.silu(MxMM.apply(xe, wg)) * MxMM.apply(xe, wv), wo))
    yr = torch.cat(ys)
    yr.backward(dy)
    close(y.detach(), yr.detach())
    close(x.grad, xr.grad)
    for p, r in zip((ffn.W_gate, ffn.W_val, ffn.W_out), ref):
        close(p.grad, r.grad)
    assert torch.equal(ffn.W_gate.grad[1], torch.zeros(D, F)), "an expert with no rows has no gradient"


def test_blocks_are_local_to_a_cut_at_a_multiple_of_32():
    """A column-parallel cut (N) gives the whole output's slice bit for bit; a row-parallel cut (K) and a token cut
    (T, the weight gradient's blocks) give partial sums that add to the whole to float reassociation."""
    torch.manual_seed(2)
    mxfp8 = float8.recipe("mxfp8")
    x, w, dy = torch.randn(64, 64), torch.randn(64, 64), torch.randn(64, 64)

    def run(x, w, dy):
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = float8.linear(x, w, None, mxfp8)
        y.backward(dy)
        return y.detach(), x.grad, w.grad

    y, dx, dw = run(x, w, dy)
    halves = [run(x, w[i:i + 32], dy[:, i:i + 32]) for i in (0, 32)]  # N cut
    assert torch.equal(torch.cat([h[0] for h in halves], 1), y)
    close(halves[0][1] + halves[1][1], dx)
    halves = [run(x[:, i:i + 32], w[:, i:i + 32], dy) for i in (0, 32)]  # K cut
    close(halves[0][0] + halves[1][0], y)
    assert torch.equal(torch.cat([h[1] for h in halves], 1), dx)
    halves = [run(x[i:i + 32], w, dy[i:i + 32]) for i in (0, 32)]  # T cut
    assert torch.equal(torch.cat([h[0] for h in halves]), y)
    close(halves[0][2] + halves[1][2], dw)
    with pytest.raises(AssertionError, match="divisible by block_size"):  # a cut inside a block: torchao refuses
        run(x[:16], w, dy[:16])


def test_the_emulated_grouped_gemm_is_torchaos_bit_for_bit_in_bf16():
    """model/mxfp8.py `GroupedMM` runs torchao's emulated MXFP8 grouped GEMM (with wgrad_with_hp) step for step in
    the operands' dtype, so that fp32 gets an fp32 output on CPU; in bf16, where torchao's own runs, they agree."""
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm

    from nanotitan.model import mxfp8

    torch.manual_seed(3)
    mx = float8.recipe("mxfp8")
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    W = torch.randn(3, 64, 32, dtype=torch.bfloat16)
    offs = torch.tensor([7, 7, 40], dtype=torch.int32)
    dy = torch.randn(40, 32, dtype=torch.bfloat16)
    xa, Wa = x.clone().requires_grad_(), W.clone().requires_grad_()
    ya = mxfp8.GroupedMM.apply(xa, Wa, offs, mx)
    ya.backward(dy)
    xb, Wb = x.clone().requires_grad_(), W.clone().requires_grad_()
    yb = _to_mxfp8_then_scaled_grouped_mm(xb, Wb.transpose(1, 2).contiguous().transpose(1, 2), offs,
                                          out_dtype=torch.bfloat16, kernel_preference=mx.kernels, wgrad_with_hp=True,
                                          scale_calculation_mode=mx.scale_mode)
    yb.backward(dy)
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad) and torch.equal(Wa.grad, Wb.grad)
