"""A rank's stage chunks, built without ever holding the whole stage (docs/tp.md, "How a rank builds its shard").

    1. build    every chunk on the meta device, handed the token shard (TP: the vocab-parallel embedding, full q/k
                norms over split heads) and each MoE layer's expert shard (placement.py: its slots, spares included):
                shapes only, nothing allocated, nothing initialised
    2. slice    apply_tp on the meta model: TP-sharded parameters take their rank's shape (tagged with their
                `grad_layout`, its part (dim, rank, n): parallel/shard.py)
    3. fill     each parameter allocated at its shard's size on the device, then filled, one at a time:
                init.from_hf reads only its slice (interop/hf.py's load_into_shard), else init by global identity
                generates the whole parameter and keeps the slice (Transformer.init_param); buffers recomputed

So a rank's build peaks at its shard plus one whole parameter (the largest it generates), where building the
stage whole and slicing it peaked at the whole stage; the values are the same bit for bit (parallel/test_tp_init.py).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from ..config.config import Config
from ..model import fp8 as float8
from ..model.spec import ModelShardSpec
from ..model.transformer import Transformer
from .dims import ParallelDims
from .pp.chunks import StageChunks
from .shard import grad_layout, keep_layout
from .cp import apply_cp, token_shard
from .placement import expert_shards
from .tp import apply_tp


def build_stage(cfg: Config, specs: list[ModelShardSpec], dims: ParallelDims, device: torch.device,
                load_weights: Callable[[nn.Module], object] | None = None) -> Transformer | StageChunks:
    """This rank's chunks (one per virtual stage, joined in a StageChunks when V > 1), built with its token shard
    (`model.tokens`: parallel/cp.py's `token_shard`, the local one at tp = cp = 1), TP-sliced, filled on `device`: from
    init.from_hf when `load_weights` is given (it fills every parameter: a checkpoint that lacks one is refused),
    else by global identity."""
    # what the model needs from the ranks sharing its tokens (CP's composed with TP's), and its TP part
    tokens, tp = token_shard(dims, cfg.parallel.sp, cfg.parallel.cp_impl, cfg.parallel.cp_split)
    experts = expert_shards(cfg, dims)  # which global expert each slot of a layer holds: the identity placement
    with torch.device("meta"):
        chunks = [Transformer(cfg.model, s, seed=cfg.train.seed, init=False, tokens=tokens, experts=experts)
                  for s in specs]
    model = chunks[0] if len(chunks) == 1 else StageChunks(chunks)
    apply_tp(model, tp)  # shapes only: each TP-sharded parameter becomes its rank's slice
    apply_cp(model, tokens)  # FP8's scales over the CP group's tokens
    # train.fp8: which GEMMs run in FP8 (parallel.fp8_comm: the experts' input as the EP dispatch carries it)
    float8.convert(model, float8.recipe(cfg.train.fp8, cfg.parallel.fp8_comm), cfg.train.fp8_skip)
    for chunk in chunks:
        for module in chunk.modules():  # (StageChunks holds these same modules: it sees the new parameters)
            for name, p in module.named_parameters(recurse=False):
                module._parameters[name] = _allocated(p, device)
        chunk.init_buffers()  # computed on the CPU as before, then moved
        if device.type != "cpu":  # (a no-op move is not free either: `plan --dry-run`'s fake tensors cannot take it)
            for module in chunk.modules():
                for name, b in module.named_buffers(recurse=False):
                    setattr(module, name, b.to(device))
        if load_weights is not None:  # each chunk reads only its slice of the checkpoint
            load_weights(chunk)
        else:
            for name, p in chunk.named_parameters():  # one whole parameter at a time, at most
                chunk.init_param(name, p, cfg.train.seed, grad_layout(p).part)
    return model


def _allocated(p: nn.Parameter, device: torch.device) -> nn.Parameter:
    """A meta parameter allocated (uninitialised) on `device`, lying as it did (its grad_layout)."""
    q = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
    keep_layout(p, q)  # only that: a fake tensor (`plan --dry-run`) keeps its own device in its __dict__
    return q
