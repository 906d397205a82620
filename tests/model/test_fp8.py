"""FP8 GEMMs (model/fp8.py, docs/fp8.md) against their truths: the dense projections are torchao's Float8Linear bit
for bit (forward, input and weight gradients, both recipes); the experts' GEMM is the dequantized fp32 matmul bit
for bit, with the scales the recipe says; `convert` keeps the default skips in high precision; train.fp8 trains."""

import pytest
import torch

pytest.importorskip("torchao")

from nanotitan.config.config import Config  # noqa: E402
from nanotitan.config.fp8_rules import FP8_SKIP  # noqa: E402
from nanotitan.model import fp8 as float8  # noqa: E402
from nanotitan.model.spec import ModelShardSpec  # noqa: E402
from nanotitan.model.transformer import Transformer  # noqa: E402
from nanotitan.model.wgrad import Linear  # noqa: E402

RECIPES = ["tensorwise", "rowwise"]


@pytest.mark.parametrize("name, dtype", [("tensorwise", torch.float32), ("rowwise", torch.float32),
                                         ("tensorwise", torch.bfloat16), ("rowwise", torch.bfloat16)])
def test_linear_is_torchaos_float8_linear(name, dtype):
    """Bit for bit torchao's Float8Linear, save rowwise in fp32: torchao rounds that GEMM's output through bf16
    (CUDA's rowwise kernel has no fp32 output), we keep its fp32 accumulate (model/fp8.py `_mm`), which is torchao's
    emulated GEMM (the dequantized fp32 matmul) on its casts."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    ours = Linear(64, 32, bias=True).to(dtype)
    theirs = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=True)).to(dtype)
    theirs[0].load_state_dict(ours.state_dict())
    config = Float8LinearConfig.from_recipe_name(name)
    emulated = name == "rowwise" and dtype == torch.float32
    convert_to_float8_training(theirs, config=dataclasses.replace(config, emulate=emulated))
    ours.fp8 = float8.recipe(name)
    x = torch.randn(2, 8, 64, dtype=dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    assert torch.equal(ya, yb)
    assert torch.equal(xa.grad, xb.grad)
    assert torch.equal(ours.weight.grad, theirs[0].weight.grad) and torch.equal(ours.bias.grad, theirs[0].bias.grad)
    assert not torch.equal(ya, torch.nn.functional.linear(x, ours.weight, ours.bias)), "no FP8 rounding happened"


def _dequantized(t, dtype, dim, pow2):
    """The GEMM's operand as the kernel reads it: the bits times the inverse scale (torchao hands it 1/scale)."""
    bits, scale = float8.quantize(t, dtype, dim, pow2)
    return bits.float() * scale.reciprocal()


@pytest.mark.parametrize("name", RECIPES)
def test_expert_gemm_is_the_dequantized_fp32_matmul(name):
    """ExpertsMM over 4 experts' row groups (one empty): x per row and each w per column (rowwise) or whole
    (tensorwise) in e4m3; dy per row in the recipe's gradient dtype; dw in fp32. The references are written per
    expert from those words, not from the code's calls."""
    f = float8.recipe(name)
    torch.manual_seed(1)
    counts = [5, 0, 12, 7]
    x, w = torch.randn(24, 32, requires_grad=True), torch.randn(4, 32, 48, requires_grad=True)
    w_dim = 0 if name == "rowwise" else None
    y = float8.ExpertsMM.apply(x, w, counts, f)
    want = torch.cat([_dequantized(xg, torch.float8_e4m3fn, -1, f.pow2) @ _dequantized(wg, torch.float8_e4m3fn,
                                                                                     w_dim, f.pow2)
                      for xg, wg in zip(x.detach().split(counts), w.detach())])
    assert torch.equal(y, want)
    dy = torch.randn_like(y) * 1e-3
    y.backward(dy)
    grad_dtype = torch.float8_e5m2 if name == "tensorwise" else torch.float8_e4m3fn
    # (operands contiguous, as the kernel reads them: a GEMM's fp32 sums can differ in their last bit by layout)
    dx = torch.cat([_dequantized(g, grad_dtype, -1, f.pow2) @ _dequantized(wg.t().contiguous(), torch.float8_e4m3fn,
                                                                          w_dim, f.pow2)
                    for g, wg in zip(dy.split(counts), w.detach())])
    assert torch.equal(x.grad, dx)
    assert torch.equal(w.grad, torch.stack([a.t().mm(g) for a, g in zip(x.detach().split(counts), dy.split(counts))]))
    assert float8.ExpertsMM.apply(x[:0], w, [0] * 4, f).shape == (0, 48)  # no expert has tokens


def _grouped_reference(a, b, scale_a, scale_b, offs, out_dtype):
    """torch._scaled_grouped_mm's 2-D x 3-D case as its docs define it, from its own arguments: rows
    offs[g-1]:offs[g] of a times b[g], each operand times its inverse scale (per row, per column), fp32 accumulate."""
    ends = offs.tolist()
    out = [torch._scaled_mm(a[lo:hi], b[g], scale_a=scale_a[lo:hi, None], scale_b=scale_b[g][None],
                            out_dtype=out_dtype) for g, (lo, hi) in enumerate(zip([0] + ends[:-1], ends))]
    return torch.cat(out)


def test_the_gpu_launch_places_each_group_at_an_aligned_start():
    """The GPU path's one launch (`grouped_launch`): each expert's rows at a multiple of ALIGN_M, the scales as the
    kernel takes them, the padding dropped: run here with the kernel's definition in its place, it gives the CPU
    path's numbers bit for bit, empty and unaligned groups included."""
    torch.manual_seed(2)
    counts = [3, 0, 17, 16, 1]
    qa, sa = float8.quantize(torch.randn(37, 32), torch.float8_e4m3fn, -1, True)
    qb, sb = float8.quantize(torch.randn(5, 32, 48), torch.float8_e4m3fn, 1, True)
    launched = []

    def kernel(a, b, scale_a, scale_b, offs, out_dtype):
        launched.append(offs.tolist())
        assert b.stride()[-2:] == (1, 32) and scale_a.shape == (a.shape[0],) and scale_b.shape == (5, 48)
        return _grouped_reference(a, b, scale_a, scale_b, offs, out_dtype)

    got = float8.grouped_launch(qa, sa, qb, sb, counts, torch.float32, kernel)
    assert launched == [[16, 16, 48, 64, 80]]
    assert torch.equal(got, float8.grouped_mm((qa, sa), (qb, sb), counts, torch.float32))


def test_the_gpu_launch_is_one_the_kernel_takes():
    """torch._scaled_grouped_mm has no CPU kernel, but its meta function holds the CUDA kernel's checks (dtypes,
    row- and column-major operands, 16-byte strides, the scales' shapes, the offsets): the launch's arguments, on
    meta tensors, pass them and give [n, N]."""
    counts = [3, 0, 17, 16]
    qa = torch.empty(36, 64, dtype=torch.float8_e4m3fn, device="meta")
    sa = torch.empty(36, 1, device="meta")
    qb = torch.empty(4, 64, 32, dtype=torch.float8_e4m3fn, device="meta")
    sb = torch.empty(4, 1, 32, device="meta")
    y = float8.grouped_launch(qa, sa, qb, sb, counts, torch.bfloat16, torch._scaled_grouped_mm)
    assert y.shape == (36, 32) and y.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="bfloat16"):  # its only output dtype: fp32 runs take the per-expert GEMMs
        float8.grouped_launch(qa, sa, qb, sb, counts, torch.float32, torch._scaled_grouped_mm)


def test_scales_follow_torchao():
    """A tensorwise scale is torchao's (fp8 max / amax); rowwise rounds down to a power of 2 (the recipe's)."""
    t = torch.tensor([[0.3, -1.7], [2.5, 0.1]])
    _, s = float8.quantize(t, torch.float8_e4m3fn, None, False)
    assert torch.equal(s, torch.tensor(448.0 / 2.5))
    _, s = float8.quantize(t, torch.float8_e4m3fn, -1, True)
    assert torch.equal(s, torch.tensor([[256.0], [128.0]]))  # 448 / 1.7 = 263.5, 448 / 2.5 = 179.2


def test_convert_keeps_the_skips_in_high_precision():
    cfg = Config().model
    cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.n_layers, cfg.shared_experts, cfg.shared_expert_gate = (
        300, 32, 48, 2, 1, True)
    model = Transformer(cfg, ModelShardSpec.full(cfg), seed=0)
    done = float8.convert(model, float8.recipe("rowwise"), list(FP8_SKIP))
    leaves = {n.rsplit(".", 1)[-1] for n in done}
    assert leaves == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts"}, leaves
    assert model.head.fp8 is None and model.layers["0"].moe.router.fp8 is None
    float8.convert(model, None, [])
    assert all(getattr(m, "fp8", None) is None for m in model.modules())
