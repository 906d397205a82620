"""A rank's V model chunks (interleaved pipeline schedule) as one module that looks like a stage.

Under `parallel.schedule=interleaved` rank p holds global chunks p, p+PP, ..., p+(V-1)*PP (Megatron's virtual
pipeline stages, `model.spec.build_chunk_specs`). Each chunk is an ordinary `Transformer` built from its own
spec, so the schedule runs `chunk(inp, targets)` exactly as it runs a stage, and init by global identity
makes every chunk the matching slice of the full model.

Everything else walks `model.named_parameters()` -- checkpoints, the DP Reducer's buckets, clipping, the
report -- and must see one module with the GLOBAL names. `StageChunks` registers the chunks' submodules
under their global names (`tok_emb`, `layers.{i}`, `norm`, `head`: the same Parameter objects, not copies)
and keeps the chunks themselves in a plain list, so every parameter is listed once, under its global name.
The per-forward record the Transformer keeps (`routing`, keyed by global layer index) is one dict shared by all
chunks, so the step drains it as from one stage (parallel/step.py).
"""

from __future__ import annotations

import torch.nn as nn

from ...model.transformer import Transformer


class StageChunks(nn.Module):
    """V Transformer chunks under their global parameter names; run the chunks, not this module."""

    def __init__(self, chunks: list[Transformer]):
        super().__init__()
        first, last = chunks[0], chunks[-1]
        self.cfg, self.spec = first.cfg, first.spec  # spec: the experts this rank owns (the same in every chunk)
        self.tokens = first.tokens  # the token shard every chunk was built with (model/tokens.py)
        for name in ("tok_emb", "pos_emb"):  # tok_emb: stage 0's, or the MTP's replica on the last (model/mtp.py)
            owner = next((c for c in chunks if hasattr(c, name)), None)
            if owner is not None:
                setattr(self, name, getattr(owner, name))
        self.layers = nn.ModuleDict({key: block for c in chunks for key, block in c.layers.items()})
        for name in ("norm", "head", "mtp"):
            if hasattr(last, name):
                setattr(self, name, getattr(last, name))
        for name, value in vars(first).items():  # the forward-time records: one dict for all chunks
            if not name.startswith("_") and isinstance(value, dict):
                assert not value, f"{name} must be empty when the chunks are joined"
                for c in chunks:
                    setattr(c, name, value)
                setattr(self, name, value)
        self.chunks = list(chunks)  # a plain list: not submodules, so no parameter is listed twice

    def forward(self, *args, **kwargs):
        raise RuntimeError("StageChunks has no forward of its own: run its chunks (parallel/pp/schedules.py)")

    def train(self, mode: bool = True) -> "StageChunks":
        super().train(mode)
        for c in self.chunks:  # Transformer.forward reads its own .training (checkpointing, router records)
            c.train(mode)
        return self

    @property
    def activation_checkpointing(self) -> bool:
        return self.chunks[0].activation_checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, on: bool) -> None:
        for c in self.chunks:
            c.activation_checkpointing = on

    def moe_layers(self) -> list:
        return [moe for c in self.chunks for moe in c.moe_layers()]
