"""Which FP8 operands flip when every weight moves by a relative K * 2^-24 (K fp32 half-ulps: the size of what a
layout's float reassociation leaves in the weights after a step), and what that does to one step's loss.

    PYTHONPATH=src python scripts/experiments/fp8_flips.py 1 16 256
    PYTHONPATH=src python scripts/experiments/fp8_flips.py mxfp8 1 16 256

One forward and backward of the tests' tiny model (d_model 32, 4 layers, 4 experts; at mxfp8 the experts' width 64,
its rows' model) at rowwise (or the recipe named first) on one batch of 2 sequences, before and after the move;
every FP8 operand torchao's linears and our expert GEMM cast (at mxfp8: every `to_mx` cast) is recorded and compared
bit for bit (docs/experiments/fp8_flips.md, mxfp8-log-2026-12-06.md)."""

import sys

import torch
import torch.nn.functional as F
import torchao.float8.float8_linear as torchao_linear
import torchao.prototype.mx_formats.mx_tensor as mx_tensor

from nanotitan.config.config import Config
from nanotitan.config.fp8_rules import FP8_SKIP
from nanotitan.model import fp8 as float8
from nanotitan.model.spec import ModelShardSpec
from nanotitan.model.transformer import Transformer

V = 300
cast: list[tuple[str, torch.Tensor, torch.Tensor]] = []
ours, theirs, to_mx = float8.quantize, torchao_linear.hp_tensor_to_float8_dynamic, mx_tensor.to_mx


def ours_recorded(t, dtype, dim, pow2):
    bits, scale = ours(t, dtype, dim, pow2)
    cast.append(("experts", bits.view(torch.uint8).clone(), scale.clone()))
    return bits, scale


def theirs_recorded(t, *args, **kw):
    out = theirs(t, *args, **kw)
    cast.append((str(kw["gemm_input_role"]).rsplit(".", 1)[-1].lower(), out._data.view(torch.uint8).clone(),
                 out._scale.clone()))
    return out


def to_mx_recorded(*args, **kw):
    scale, bits = to_mx(*args, **kw)
    cast.append(("mxfp8", bits.view(torch.uint8).clone(), scale.view(torch.uint8).clone()))
    return scale, bits


def step(model, idx) -> tuple[float, list]:
    cast.clear()
    model.zero_grad()
    out = model(idx[:, :-1])
    logits = out[0] if isinstance(out, tuple) else out
    loss = F.cross_entropy(logits.reshape(-1, V), idx[:, 1:].reshape(-1))
    loss.backward()
    return loss.item(), list(cast)


def main(recipe: str, moves: list[float]) -> None:
    float8.quantize, torchao_linear.hp_tensor_to_float8_dynamic = ours_recorded, theirs_recorded
    mx_tensor.to_mx = to_mx_recorded
    torch.manual_seed(0)
    cfg = Config().model
    ffn = 64 if recipe == "mxfp8" else 48
    cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.n_layers, cfg.num_experts = V, 32, ffn, 4, 4
    idx = torch.randint(0, V, (2, 17))
    for k in moves:
        model = Transformer(cfg, ModelShardSpec.full(cfg), seed=0)
        float8.convert(model, float8.recipe(recipe), list(FP8_SKIP))
        loss0, before = step(model, idx)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + k * 2.0**-24 * torch.where(torch.rand_like(p) < 0.5, -1.0, 1.0))
        loss1, after = step(model, idx)
        print(f"move {k:g} * 2^-24: loss {loss0:.7f} -> {loss1:.7f} (relative {abs(loss1 - loss0) / loss0:.1e})")
        roles: dict[str, list[int]] = {}
        for (role, a, sa), (_, b, sb) in zip(before, after, strict=True):
            r = roles.setdefault(role, [0, 0, 0, 0])
            r[0] += (a != b).sum().item()
            r[1] += a.numel()
            r[2] += (sa != sb).sum().item()
            r[3] += sa.numel()
        for role, (flips, n, scales, ns) in roles.items():
            print(f"  {role:12s} elements flipped {flips}/{n}, scales changed {scales}/{ns}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    args = sys.argv[1:]
    recipe = args.pop(0) if args and args[0] in float8.RECIPES else "rowwise"
    main(recipe, [float(a) for a in args] or [1.0, 16.0, 256.0])
