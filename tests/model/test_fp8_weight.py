"""model/fp8_weight.py's `Fp8Weight` (a weight as its FP8 forward operand, what zero 3 gathers with parallel.fp8_comm)
in the FP8 GEMMs: a linear and the experts given their weight as the operand the recipe makes of it compute bitwise
what they compute from the high-precision weight at the same flags, forward and backward, in fp32 and under bf16
autocast; the views the modules take keep the bits, any other op reads the values."""

import pytest
import torch

from nanotitan.model.fp8_weight import Fp8Weight

pytest.importorskip("torchao")
RECIPES = ("tensorwise", "rowwise")


def _operand(w: torch.Tensor, rowwise: bool, amax_dims: tuple[int, ...], dtype: torch.dtype):
    """w as its forward operand, cast as parallel/dp/fp8_gather.py casts a shard that holds all of it."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    hp = w.detach().to(dtype)
    amax = hp.abs().amax(dim=amax_dims, keepdim=True).float()
    scale = amax_to_scale(amax, torch.float8_e4m3fn, round_scales_to_power_of_2=rowwise)
    if w.dim() == 2 and not rowwise:
        scale = scale.reshape(())
    return Fp8Weight(to_fp8_saturated(hp.float() * scale, torch.float8_e4m3fn), scale, w.dtype)


def _run(fn, dtype):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        return fn()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_reads_the_gathered_bits_as_its_own_cast(recipe, dtype):
    from nanotitan.model import fp8 as float8

    fp8 = float8.recipe(recipe, wire=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 32, generator=g)
    w = torch.randn(48, 32, generator=g) * 0.2
    dy = torch.randn(24, 48, generator=g)
    outs = []
    for weight in (w.clone().requires_grad_(True), _operand(w, fp8.rowwise, (1,) if fp8.rowwise else (0, 1), dtype)):
        weight.requires_grad_(True)
        xi = x.clone().requires_grad_(True)
        y = _run(lambda: float8.linear(xi, weight, None, fp8), dtype)
        y.backward(dy.to(y.dtype))
        outs.append((y.detach(), xi.grad, weight.grad))
    (y0, dx0, dw0), (y1, dx1, dw1) = outs
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and torch.equal(dw0, dw1)
    assert type(dw1) is torch.Tensor  # the gradient of a gathered weight is a plain tensor, as FSDP2 reduces it


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_experts_read_the_gathered_bits_as_their_own_cast(recipe):
    from nanotitan.model import fp8 as float8

    fp8 = float8.recipe(recipe, wire=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 32, generator=g)
    ws = [torch.randn(3, *shape, generator=g) * 0.2 for shape in ((32, 48), (32, 48), (48, 32))]
    counts = [8, 0, 12]
    dims = (1,) if fp8.rowwise else (1, 2)
    outs = []
    for params in (ws, [_operand(w, fp8.rowwise, dims, torch.float32) for w in ws]):
        params = [p.clone().requires_grad_(True) if type(p) is torch.Tensor else p.requires_grad_(True)
                  for p in params]
        xi = x.clone().requires_grad_(True)
        y = float8.experts(xi, *params, counts, fp8)
        y.square().sum().backward()
        outs.append([y.detach(), xi.grad, *(p.grad for p in params)])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_views_keep_the_bits_and_other_ops_read_the_values():
    w = _operand(torch.randn(3, 16, 32), True, (1,), torch.float32)
    e = w.unbind(0)[1]
    assert isinstance(e, Fp8Weight) and torch.equal(e.bits.float(), w.bits[1].float())
    assert e.scale.shape == (1, 32) and isinstance(e.t(), Fp8Weight) and e.t().scale.shape == (32, 1)
    assert isinstance(w.to(torch.bfloat16), Fp8Weight) and w.to(torch.bfloat16).dtype == torch.bfloat16
    total = w.sum()  # not a view: the dequantized values
    assert type(total) is torch.Tensor and torch.equal(total, w.dequantize().sum())
