"""A verify run's rank side: what one rank computes in the first step, in global coordinates.

Installed on a built Trainer from outside (no branch of the training path knows it is there) and taken off after
the first step:
    forward   a forward hook on each module whose output has a meaning in every layout (the embeddings' output as the
              first block's input, each block, its attention, MoE or dense FFN, the final norm, the head, MTP's
              projections and norms): each microbatch's output becomes a box of the global (B, S, ...) tensor at this
              data rank's rows and this token rank's positions (`TokenShard.seq_runs` / `runs`), the vocab split's
              columns for the head's logit shards; a checkpointed block's recompute (in the backward) is not recorded
    backward  an optimizer step pre-hook: every parameter's averaged (clipped) gradient placed as a checkpoint places
              the parameter (state/keys.py `keyed_grads`, parallel/where.py: TP slices, experts per global id,
              ZeRO/FSDP pieces)
    update    after the step: every parameter, buffer and optimizer state (`keyed_state`, what a checkpoint saves)
Every box is a CPU copy (offsets, tensor) under a global key; `verify/compare.py` puts them against one process's.
"""

from __future__ import annotations

import re
import time

import torch

from ..model.moe import in_backward
from ..parallel.shard import Grad, grad_layout
from ..state.keys import keyed_grads, keyed_state

# The modules compared, by global name: they mean the same in every layout (an expert's or a TP region's inner
# outputs do not). The embeddings' output is read as the first block's input ("embed"): zb1 and EP's lanes look the
# table up without calling its module (model/wgrad.py), and MTP looks up its future tokens there too.
WATCHED = re.compile(r"layers\.\d+(\.(attn|moe|mlp))?|norm|head|mtp\.\d+\.(eh_proj|shared_head\.norm)")
EMBED = "embed"

Boxes = list[tuple[tuple[int, ...], torch.Tensor]]


class Capture:
    """Records the first step of `trainer` (see the module docstring): `tensors` {key: (whole size, boxes)} and
    `order` (the forward's module names in call order) once `finish` ran after that step."""

    def __init__(self, trainer):
        self.trainer = trainer
        model, cfg = trainer.model, trainer.cfg
        self.tokens = model.tokens  # which positions (and vocab columns) this rank's outputs hold
        self.m, self.M = cfg.train.micro_batch, cfg.parallel.microbatches
        self.S, self.V, self.B = cfg.train.seq_len, cfg.model.vocab_size, trainer.B
        self.seq_len = sum(n for _, n in trainer.data.runs)  # the positions this rank's loader reads
        self.row0 = trainer.dims.data_rank * (self.B // trainer.dims.data_world)
        self.calls: dict[str, list[torch.Tensor]] = {}
        self.seconds = 0.0  # spent recording (the hooks, the copies): verify's own cost in this rank's step
        self.tensors: dict[str, tuple[tuple[int, ...], Boxes]] = {}
        # the parameters whose gradient a TP rank holds a slice or a partial sum of (a report row's axes)
        self.sliced = [n for n, p in model.named_parameters() if grad_layout(p).kind in (Grad.SHARDED, Grad.PARTIAL)]
        self.handles = [module.register_forward_hook(self._recorder(name)) for name, module in model.named_modules()
                        if WATCHED.fullmatch(name)]
        if "0" in model.layers:  # the first stage: what the embeddings hand the first block
            record = self._recorder(EMBED)
            self.handles.append(model.layers["0"].register_forward_pre_hook(lambda m, args: record(m, args, args[0])))
        self.handles.append(trainer.optimizer.register_step_pre_hook(lambda _opt, _a, _k: self._grads()))

    def _recorder(self, name: str):
        def record(_module, _args, out):
            if in_backward():  # a checkpointed block's recompute: the forward's output is recorded already
                return
            t0 = time.perf_counter()
            y = out[0] if isinstance(out, tuple) else out
            self.calls.setdefault(name, []).append(y.detach().float().cpu().clone())
            self.seconds += time.perf_counter() - t0
        return record

    def _grads(self) -> None:
        if not any(k.startswith("grad.") for k in self.tensors):  # the first step's only
            t0 = time.perf_counter()
            self.tensors.update(_copied(keyed_grads(self.trainer.model, self.trainer.shard)))
            self.seconds += time.perf_counter() - t0

    @property
    def order(self) -> list[str]:
        return list(self.calls)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def finish(self, skipped: bool, replayed: bool = False) -> None:
        """After the first step: hooks off, the forward's outputs as global boxes, the state after the update.
        `skipped`: the step made no update (non-finite), so no gradient was recorded. `replayed`: a static EP
        dispatch overflowed and the step ran again (parallel/step.py `replay_on_overflow`): the replay's outputs,
        each module's last M calls, are the step's; the first try updated nothing."""
        self.close()
        assert skipped or any(k.startswith("grad.") for k in self.tensors), "the optimizer's step pre-hook never ran"
        t0 = time.perf_counter()
        for name, outs in self.calls.items():
            outs = outs[len(outs) // 2:] if replayed else outs
            assert len(outs) == self.M, f"{name}: {len(outs)} forward calls in a step of {self.M} microbatches"
            size, boxes = None, []
            for j, y in enumerate(outs):
                size, parts = self._place(name, y, self.row0 + j * self.m)
                boxes += parts
            self.tensors[f"act.{name}"] = (size, boxes)
        t = self.trainer
        self.tensors.update(_copied(keyed_state(t.model, t.optimizer, t.shard)))
        self.seconds += time.perf_counter() - t0

    def _place(self, name: str, y: torch.Tensor, row: int) -> tuple[tuple[int, ...], Boxes]:
        """(the global size, the boxes) of one microbatch's output y (m or k*m rows: MTP stacks its depths along
        the batch, each m rows, as (k, B, ...)) at global rows [row, row + m)."""
        k = y.shape[0] // self.m
        assert y.shape[0] == k * self.m and y.dim() >= 2, f"{name}: output {tuple(y.shape)} is no microbatch's"
        y = y.view(k, self.m, *y.shape[1:])
        L = y.shape[2]
        # this rank's whole sequence (its CP chunks), or a sequence shard of it (SP's residual stream)
        runs = self.tokens.seq_runs(L) if L == self.seq_len else self.tokens.runs(L)
        last, col = y.shape[-1], 0
        if name == "head" and last < self.V:  # vocab-parallel logits: this rank's columns
            col = self.tokens.split_rank * last
        size = (k, self.B, self.S, *y.shape[3:-1], self.V if name == "head" else last)
        boxes, at = [], 0
        for start, n in runs:
            tail = (0,) * (y.dim() - 4)
            boxes.append(((0, row, start, *tail, col), y[:, :, at:at + n]))
            at += n
        return size, boxes


def _copied(chunks: dict) -> dict[str, tuple[tuple[int, ...], Boxes]]:
    """{key: (whole size, [(offsets, CPU copy)])} of `keyed_*`'s Chunks (views of live state)."""
    return {k: (tuple(c.shape), [(tuple(o), t.detach().float().cpu().clone()) for o, t in c.boxes.items()])
            for k, c in chunks.items()}
