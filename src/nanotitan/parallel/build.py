"""A rank's stage chunks, built without ever holding the whole stage (docs/tp.md, "How a rank builds its shard").

    1. build    every chunk on the meta device: shapes only, nothing allocated, nothing initialised
    2. slice    apply_tp on the meta model: TP-sharded parameters take their rank's shape (tagged `tp_part`)
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
from ..model.spec import ModelShardSpec
from ..model.transformer import Transformer
from .dims import ParallelDims
from .pp.chunks import StageChunks
from .tp import PART, PARTIAL, SHARD_DIM, apply_tp, tp_part

TAGS = (SHARD_DIM, PART, PARTIAL)  # what apply_tp sets on a parameter


def build_stage(cfg: Config, specs: list[ModelShardSpec], dims: ParallelDims, device: torch.device,
                load_weights: Callable[[nn.Module], object] | None = None) -> Transformer | StageChunks:
    """This rank's chunks (one per virtual stage, joined in a StageChunks when V > 1), TP-sliced, filled on
    `device`: from init.from_hf when `load_weights` is given (it fills every parameter: a checkpoint that lacks
    one is refused), else by global identity."""
    with torch.device("meta"):
        chunks = [Transformer(cfg.model, s, seed=cfg.train.seed, init=False) for s in specs]
    model = chunks[0] if len(chunks) == 1 else StageChunks(chunks)
    apply_tp(model, dims, cfg.parallel.sp)  # shapes only: each TP-sharded parameter becomes its rank's slice
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
                chunk.init_param(name, p, cfg.train.seed, tp_part(p))
    return model


def _allocated(p: nn.Parameter, device: torch.device) -> nn.Parameter:
    """A meta parameter allocated (uninitialised) on `device`, with its tags (tp_shard_dim, tp_part, tp_partial)."""
    q = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
    for tag in TAGS:  # only these: a fake tensor (`plan --dry-run`) keeps its own device in its __dict__
        if hasattr(p, tag):
            setattr(q, tag, getattr(p, tag))
    return q
