"""Experts placed by load, at run time (parallel.expert_placement=balanced; the rule is placement.py).

    spare slots  each MoE layer's ExpertFFN holds C = E/P + (R - 1) slots (`add_spare_slots`, before the gradient
                 sync is built); a slot's expert is `experts.slot_experts[s]` (-1 empty; checkpoints key by it)
    window       every rebalance_every steps the routing counts the model kept (Transformer.window_load, training
                 forwards only) are summed over the stage's data ranks (the same on every rank), and
                 `placement.choose` picks each layer's next placement
    move         between two steps, every expert tensor (weights, AdamW's moments) is put together per EP rank
                 from its DP pieces (whatever the zero level: `GradSync.sharded_state`), its rows sent to their new
                 slots in one all-to-all per layer over the EP group, and written back into the live pieces
    replicas     after the gradient sync, a replicated expert's copies (one spare column, placement.py) sum their
                 gradients: one all-gather over EP of the replica columns' pieces, the same sum in rank order on
                 every copy, so the copies' AdamW steps stay identical; the extra copies leave the clipping norm
Exact: the experts' maths is untouched, only where it runs (tests/equivalence/test_equivalence_placement.py).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from .comm import collectives as comm
from .ep import EPDispatcher
from .placement import Placement, choose, identity
from .shard import keep_layout

EXPERT_TENSORS = ("W_gate", "W_val", "W_out")


def add_spare_slots(model: nn.Module, spare: int, P: int, rank: int) -> None:
    """Every EP MoE layer: R-1 empty slots after its E/P experts, the identity placement installed."""
    for moe in model.moe_layers():
        if not isinstance(moe.dispatcher, EPDispatcher):
            continue
        ex = moe.experts
        for name in EXPERT_TENSORS:
            w = getattr(ex, name)
            q = nn.Parameter(torch.cat([w.detach(), w.new_zeros(spare, *w.shape[1:])]), requires_grad=w.requires_grad)
            keep_layout(w, q)
            ex._parameters[name] = q
        install(moe, identity(moe.num_experts, P, spare), rank)


def install(moe, placement: Placement, rank: int) -> None:
    d = moe.dispatcher
    d.placement = placement
    d.slot_of, d.copies_of = placement.tables(moe.experts.W_gate.device)
    moe.experts.slot_experts = list(placement.slots[rank])
    moe.count_window = True


def _region(off, shape) -> tuple:
    return tuple(slice(o, o + z) for o, z in zip(off, shape))


class Rebalancer:
    """One rank's placements (one per MoE layer of its stage) and their moves; train.py calls `sum_replica_grads`
    after the gradient sync and `after_step` after the update."""

    def __init__(self, shard, every: int, replicas: int, log=print):
        self.shard, self.every, self.R, self.log = shard, every, replicas, log
        model = shard.model
        self.keys = [k for k, b in model.layers.items() if b.is_moe and isinstance(b.moe.dispatcher, EPDispatcher)]
        prefix = {id(m): n for n, m in model.named_modules()}
        self.names = {k: [f"{prefix[id(model.layers[k].moe.experts)]}.{t}" for t in EXPERT_TENSORS]
                      for k in self.keys}
        self.changes: list[dict] = []  # one per placement change: step, before, after, bytes, pause_s, replicated

    def _device(self) -> torch.device:
        return next(self.shard.model.parameters()).device

    def placements(self) -> dict[str, Placement]:
        return {k: self.shard.model.layers[k].moe.dispatcher.placement for k in self.keys}

    # --- between two steps ------------------------------------------------------------------------------
    def after_step(self, step: int, optimizer) -> dict | None:
        """At the end of a window: the next placements from its counts; moves if any layer changed (collective
        over the stage: every rank of it calls this at every step). Returns the change's record, else None."""
        if (step + 1) % self.every or not self.keys:
            return None
        t0 = time.perf_counter()
        model, dims = self.shard.model, self.shard.dims
        counts = torch.stack([model.window_load.pop(k) for k in self.keys])  # (layers, E), int64: exact
        if dist.is_initialized() and dims.data_world > 1:
            comm.all_reduce(counts, group=dims.group("non_expert_dp"), axis="other")
        loads = counts.tolist()  # one host read per window
        old = self.placements()
        new = {k: choose(old[k], load, self.R) for k, load in zip(self.keys, loads)}
        changed = [k for k in self.keys if new[k] != old[k]]
        if not changed:
            return None
        moved = self._move(optimizer, [(k, old[k], new[k]) for k in changed])
        for k in changed:
            install(model.layers[k].moe, new[k], dims.moe_ep_rank)
        record = {"step": step + 1, "layers": len(changed), "bytes": moved, "pause_s": time.perf_counter() - t0,
                  "before": max(old[k].imbalance(load) for k, load in zip(self.keys, loads)),
                  "after": max(new[k].imbalance(load) for k, load in zip(self.keys, loads)),
                  "replicated": sum(len(new[k].replicated()) for k in self.keys)}
        self.changes.append(record)
        self.log(f"placement step {record['step']}: busiest/mean {record['before']:.2f} -> {record['after']:.2f} "
                 f"(worst layer), {len(changed)} layer(s) moved, {record['replicated']} expert(s) replicated, "
                 f"{moved / 2**20:.2f} MiB moved, pause {record['pause_s'] * 1e3:.0f} ms")
        return record

    @torch.no_grad()
    def _move(self, optimizer, changes: list[tuple[str, Placement, Placement]]) -> int:
        """Every expert tensor of the changed layers to its new slots; returns the bytes this EP group sent."""
        dims, sync = self.shard.dims, self.shard.sync
        model_state, optim_state = sync.sharded_state(optimizer)
        layers = []  # per change: its Pieces, their whole tensors [C, ...]
        for k, _, _ in changes:
            pieces = []
            for n in self.names[k]:
                pieces.append(model_state[n])
                pieces += [v for _, v in sorted(optim_state.get(n, {}).items()) if len(v.size)]
            layers.append(pieces)
        wholes = self._gather_whole([p for ps in layers for p in ps])
        sent, i = 0, 0
        for (k, old, new), pieces in zip(changes, layers):
            rows = torch.cat([w.reshape(w.shape[0], -1) for w in wholes[i:i + len(pieces)]], 1)  # [C, W]
            new_rows, n_sent = self._exchange(rows, old, new)
            sent += n_sent * rows.shape[1] * rows.element_size()
            at = 0
            for p, w in zip(pieces, wholes[i:i + len(pieces)]):
                width = w[0].numel()
                moved = new_rows[:, at:at + width].reshape(w.shape)
                at += width
                for off, t in p.boxes:
                    t.copy_(moved[_region(off, t.shape)])
            i += len(pieces)
        return sent

    def _gather_whole(self, pieces: list) -> list[torch.Tensor]:
        """Each Pieces as its whole tensor on every rank of the expert-DP group: whole already (every replica holds
        it), else the disjoint pieces summed over the group (x + 0 = x: exact)."""
        group, device = self.shard.dims.group("expert_dp"), self._device()
        wholes, partial = [], []
        for p in pieces:
            t0 = p.boxes[0][1] if p.boxes else None
            w = torch.zeros(p.size, dtype=torch.float32 if t0 is None else t0.dtype, device=device)
            for off, t in p.boxes:
                w[_region(off, t.shape)] = t
            wholes.append(w)
            partial.append(sum(t.numel() for _, t in p.boxes) < w.numel())
        if group is None:
            return wholes
        flags = torch.tensor(partial, dtype=torch.float32, device=device)
        comm.all_reduce(flags, group=group, axis="other", op=dist.ReduceOp.MAX)  # partial anywhere: sum them
        idx = [j for j, f in enumerate(flags.tolist()) if f]
        if idx:
            buf = torch.cat([wholes[j].reshape(-1) for j in idx])
            comm.all_reduce(buf, group=group, axis="other")
            for j, part in zip(idx, buf.split([wholes[j].numel() for j in idx])):
                wholes[j] = part.view_as(wholes[j])
        return wholes

    def _exchange(self, rows: torch.Tensor, old: Placement, new: Placement) -> tuple[torch.Tensor, int]:
        """rows [C, W] of this rank's slots under `old` -> under `new`: a new slot takes its expert from this rank if
        it held it, else from the expert's first old copy. Returns (new rows, rows sent between ranks by the
        whole EP group)."""
        me, P = self.shard.dims.moe_ep_rank, old.P
        first = old.copies()
        plan = []  # (src rank, src slot, dst rank, dst slot), in dst order
        for q, row in enumerate(new.slots):
            for s2, e in enumerate(row):
                if e < 0:
                    continue
                src = (q, old.slots[q].index(e)) if e in old.slots[q] else first[e][0]
                plan.append((*src, q, s2))
        out = torch.zeros_like(rows)
        for p, s, q, s2 in plan:
            if p == q == me:
                out[s2] = rows[s]
        send = [[s for p, s, q, _ in plan if p == me and q == d] for d in range(P)]
        recv = [[s2 for p, _, q, s2 in plan if q == me and p == src] for src in range(P)]
        send[me], recv[me] = [], []
        inp = rows.index_select(0, torch.tensor([s for d in send for s in d], dtype=torch.long, device=rows.device))
        buf = rows.new_empty(sum(map(len, recv)), rows.shape[1])
        if P > 1:
            comm.all_to_all_single(buf, inp, [len(r) for r in recv], [len(s) for s in send],
                                   group=self.shard.dims.group("ep"), axis="ep")
        dst = [s2 for r in recv for s2 in r]
        if dst:
            out[torch.tensor(dst, device=rows.device)] = buf
        return out, sum(1 for p, _, q, _ in plan if p != q)

    # --- inside a step ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def sum_replica_grads(self) -> torch.Tensor | None:
        """After the gradient sync: each replicated expert's gradient is the sum of its copies', on every copy.
        Returns the squared norm the extra copies add to the clipping norm (summed over the ranks), None without
        replicas allowed (parallel.expert_replicas 1). Collective over EP, the stage and PP: every rank calls it, with
        replicas or not (another stage may have some)."""
        if self.R == 1:
            return None
        placements = self.placements()
        groups = {k: placements[k].replicated() for k in self.keys}
        dims, sync = self.shard.dims, self.shard.sync
        pieces = sync.grad_pieces({n for k in self.keys if groups[k] for n in self.names[k]})
        me = dims.moe_ep_rank
        parts, owners = [], []  # per (layer, tensor, box, column): the view; its column's (ranks, first?)
        for k in self.keys:
            columns = sorted({s for _, s, _ in groups[k]})
            ranks_at = {s: r for _, s, r in groups[k] if me in r}  # the group this rank is in, per column
            for n in self.names[k]:
                for off, t in pieces[n].boxes if n in pieces else []:
                    for s in columns:
                        if off[0] <= s < off[0] + t.shape[0]:
                            parts.append(t[s - off[0]])
                            owners.append(ranks_at.get(s))
        device = self._device()
        sizes = [t.numel() for t in parts]
        v = torch.cat([t.reshape(-1) for t in parts]) if parts else torch.zeros(0, device=device)
        every = v.new_empty(dims.moe_ep, v.numel())
        comm.all_gather(every.view(-1), v, dims.group("ep"), axis="ep").wait()
        dup = torch.zeros((), dtype=torch.float32, device=device)
        for t, seg, ranks in zip(parts, every.split(sizes, dim=1), owners):
            if ranks is None:
                continue
            t.copy_(seg[ranks].sum(0).view_as(t))  # the same sum, in rank order, on every copy
            if me != ranks[0]:
                dup = dup + t.float().square().sum()
        group = dims.group("ep") if sync.grads_whole else dims.group("stage")
        dup = dup.reshape(1)
        if group is not None:
            comm.all_reduce(dup, group=group, axis="other")
        if dims.group("pp") is not None:
            comm.all_reduce(dup, group=dims.group("pp"), axis="other")
        return dup
