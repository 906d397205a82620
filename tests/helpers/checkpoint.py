"""Checkpoint test helpers: a tiny model's state saved and perturbed (build, perturb, tiny_cfg), and trainer
runs that save and resume across layouts (_train, _run_jobs, _close, _keys)."""

import zlib

import torch
from torch.distributed.checkpoint import FileSystemReader

from nanotitan.config.config import Config, validate
from nanotitan.model.spec import ModelShardSpec
from nanotitan.model.transformer import Transformer, is_expert_param
from nanotitan.optim.adamw import AdamW
from tests.helpers.equivalence import base_args, layout_args

SEED = 7

SAVE_KS = (1, 2)  # the saved state has taken two optimizer steps with these gradient keys


def tiny_cfg(layout=(1, 1, 1), **model) -> Config:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.ffn_dim, m.num_experts, m.top_k = 512, 32, 4, 4, 64, 4, 2
    cfg.data.vocab_size = 260  # the smallest BPE: no data here, but a model must cover the tokenizer's ids
    for k, v in model.items():
        setattr(m, k, v)
    cfg.parallel.dp, cfg.parallel.pp, cfg.parallel.ep = layout[:3]
    cfg.parallel.pp_layers = list(layout[3]) if len(layout) > 3 else []  # e.g. (2.5, 1.5): a half-layer cut
    cfg.train.seed = SEED
    validate(cfg)
    return cfg


def build(cfg: Config, spec: ModelShardSpec):
    model = Transformer(cfg.model, spec, SEED)
    opt = AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)  # the trainer's (optim/)
    return model, opt


def _grad(shape, name: str, expert_id: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"grad/{name}/{expert_id}/{k}".encode()))
    return torch.randn(shape, generator=g)


def perturb(model: Transformer, opt, ks) -> None:
    """Optimizer steps whose gradients depend only on (global name, global expert id, k): every
    layout reaches the same global state as the full model."""
    for k in ks:
        for name, p in model.named_parameters():
            if is_expert_param(name):
                start = model.spec.expert_start
                p.grad = torch.stack([_grad(p.shape[1:], name, start + l, k) for l in range(p.shape[0])])
            else:
                p.grad = _grad(p.shape, name, -1, k)
        opt.step()


CKPT = 5


def _train(args: list[str]) -> list[float]:
    from nanotitan.config.config import load_config
    from nanotitan.train import Trainer

    trainer = Trainer(load_config(None, args))
    res = trainer.train()
    return [(r["step"], r["loss"]) for r in res["history"]]


def _args(corpus_dir, run_dir, layout, resume=""):
    extra = ["--train.ckpt_every", str(CKPT), "--train.keep_last", "3"]
    if resume:
        extra += ["--train.resume", resume]
    return base_args(corpus_dir, run_dir) + layout_args(*layout) + extra


def _run_jobs(rank, world, jobs):
    return [_train(args) for args in jobs]


def _close(a, b, rel=1e-5):
    return abs(a - b) <= rel * abs(b)


def _keys(step_dir) -> dict:
    meta = FileSystemReader(step_dir).read_metadata().state_dict_metadata
    return {k: list(v.size) for k, v in meta.items() if not k.startswith("rng.")}
