"""Planner test helpers: a small config for the planner's models, and the CPU profile they price it on."""

from nanotitan.config.config import Config, validate
from nanotitan.config.hardware import get_hardware

CPU = get_hardware("cpu-gloo")


def tiny(n_layers=4, moe_every=1, pos_emb="rope", ep=1, dp=1, M=1, m=8, num_experts=4, model=None) -> Config:
    c = Config()
    mo = c.model
    mo.vocab_size, mo.d_model, mo.n_heads, mo.ffn_dim, mo.n_layers = 512, 64, 4, 128, n_layers
    mo.num_experts, mo.top_k, mo.moe_every, mo.pos_emb, mo.max_seq_len = num_experts, 2, moe_every, pos_emb, 64
    for k, v in (model or {}).items():
        setattr(mo, k, v)
    c.data.vocab_size, c.train.seq_len = 512, 64
    c.parallel.dp, c.parallel.ep, c.parallel.microbatches, c.train.micro_batch = dp, ep, M, m
    validate(c)
    return c
