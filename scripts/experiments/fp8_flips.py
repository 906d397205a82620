"""Which FP8 operands flip when every weight moves by a relative K * 2^-24 (K fp32 half-ulps: the size of what a
layout's float reassociation leaves in the weights after a step), and what that does to one step's loss.

    PYTHONPATH=src python scripts/experiments/fp8_flips.py 1 16 256

One forward and backward of the tests' tiny model (d_model 32, 4 layers, 4 experts) at rowwise on one batch of 2
sequences, before and after the move; every FP8 operand torchao's linears and our expert GEMM cast is recorded and
compared bit for bit (docs/experiments/fp8_flips.md)."""

import sys

import torch
import torch.nn.functional as F
import torchao.float8.float8_linear as torchao_linear

from nanotitan.config.config import Config
from nanotitan.config.fp8_rules import FP8_SKIP
from nanotitan.model import fp8 as float8
from nanotitan.model.spec import ModelShardSpec
from nanotitan.model.transformer import Transformer

V = 300
cast: list[tuple[str, torch.Tensor, torch.Tensor]] = []
ours, theirs = float8.quantize, torchao_linear.hp_tensor_to_float8_dynamic


def ours_recorded(t, dtype, dim, pow2):
    bits, scale = ours(t, dtype, dim, pow2)
    cast.append(("experts", bits.view(torch.uint8).clone(), scale.clone()))
    return bits, scale


def theirs_recorded(t, *args, **kw):
    out = theirs(t, *args, **kw)
    cast.append((str(kw["gemm_input_role"]).rsplit(".", 1)[-1].lower(), out._data.view(torch.uint8).clone(),
                 out._scale.clone()))
    return out


def step(model, idx) -> tuple[float, list]:
    cast.clear()
    model.zero_grad()
    out = model(idx[:, :-1])
    logits = out[0] if isinstance(out, tuple) else out
    loss = F.cross_entropy(logits.reshape(-1, V), idx[:, 1:].reshape(-1))
    loss.backward()
    return loss.item(), list(cast)


def main(moves: list[float]) -> None:
    float8.quantize, torchao_linear.hp_tensor_to_float8_dynamic = ours_recorded, theirs_recorded
    torch.manual_seed(0)
    cfg = Config().model
    cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.n_layers, cfg.num_experts = V, 32, 48, 4, 4
    idx = torch.randint(0, V, (2, 17))
    for k in moves:
        model = Transformer(cfg, ModelShardSpec.full(cfg), seed=0)
        float8.convert(model, float8.recipe("rowwise"), list(FP8_SKIP))
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
    main([float(a) for a in sys.argv[1:]] or [1.0, 16.0, 256.0])
