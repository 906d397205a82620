"""Which MXFP8 operands flip when every weight moves by a relative K * 2^-24 (K fp32 half-ulps: the size of what a
layout's float reassociation leaves in the weights after a step), and what that does to one step's loss.

    PYTHONPATH=src python scripts/experiments/mxfp8_flips.py 1 16 256

One forward and backward of the mxfp8 rows' tiny model (d_model 32, ffn_dim 64, 4 layers, 4 experts) on one batch of
2 sequences of 16 tokens, before and after the move; every operand torchao's `to_mx` casts (the dense linears' six
casts, the experts' four) is recorded and compared bit for bit (docs/experiments/mxfp8-log-2026-12-06.md)."""

import sys

import torch
import torch.nn.functional as F
import torchao.prototype.mx_formats.mx_tensor as mx_tensor

from nanotitan.config.config import Config
from nanotitan.config.fp8_rules import FP8_SKIP
from nanotitan.model import fp8 as float8
from nanotitan.model.spec import ModelShardSpec
from nanotitan.model.transformer import Transformer

V = 300
cast: list[tuple[torch.Tensor, torch.Tensor]] = []
to_mx = mx_tensor.to_mx


def recorded(*args, **kw):
    scale, bits = to_mx(*args, **kw)
    cast.append((bits.view(torch.uint8).clone(), scale.view(torch.uint8).clone()))
    return scale, bits


def step(model, idx) -> tuple[float, list]:
    cast.clear()
    model.zero_grad()
    out = model(idx[:, :-1])
    logits = out[0] if isinstance(out, tuple) else out
    loss = F.cross_entropy(logits.reshape(-1, V), idx[:, 1:].reshape(-1))
    loss.backward()
    return loss.item(), list(cast)


def main(moves: list[float]) -> None:
    mx_tensor.to_mx = recorded
    torch.manual_seed(0)
    cfg = Config().model
    cfg.vocab_size, cfg.d_model, cfg.ffn_dim, cfg.n_layers, cfg.num_experts = V, 32, 64, 4, 4
    idx = torch.randint(0, V, (2, 17))
    for k in moves:
        model = Transformer(cfg, ModelShardSpec.full(cfg), seed=0)
        float8.convert(model, float8.recipe("mxfp8"), list(FP8_SKIP))
        loss0, before = step(model, idx)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + k * 2.0**-24 * torch.where(torch.rand_like(p) < 0.5, -1.0, 1.0))
        loss1, after = step(model, idx)
        flips = sum((a != b).sum().item() for (a, _), (b, _) in zip(before, after, strict=True))
        scales = sum((a != b).sum().item() for (_, a), (_, b) in zip(before, after, strict=True))
        n, ns = sum(a.numel() for a, _ in before), sum(s.numel() for _, s in before)
        print(f"move {k:g} * 2^-24: loss {loss0:.7f} -> {loss1:.7f} (relative {abs(loss1 - loss0) / loss0:.1e}); "
              f"{len(before)} casts: elements flipped {flips}/{n}, block scales changed {scales}/{ns}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main([float(a) for a in sys.argv[1:]] or [1.0, 16.0, 256.0])
