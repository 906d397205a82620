"""Experts placed by load, at run time (parallel.expert_placement=balanced; the rule is placement.py).

    spare slots  each MoE layer's ExpertFFN holds C = E/P + (R - 1) slots (`add_spare_slots`, before the gradient
                 sync is built); a slot's expert is `experts.slot_experts[s]` (-1 empty; checkpoints key by it)
    window       every rebalance_every steps the routing counts the model kept (Transformer.window_load, training
                 forwards only) are summed over the stage's data ranks (the same on every rank), and
                 `placement.choose` picks each layer's next placement
    move         between two steps, every expert tensor (weights, AdamW's moments) is put together per EP rank
                 from its DP pieces (whatever the zero level: `GradSync.sharded_state`), its rows sent to their new
                 slots in one all-to-all per layer over the EP group, and written back into the live pieces
    replicas     a replicated expert's gradient is the sum over its copies (one spare column, placement.py) and DP.
                 zero 0: the DP reduction skips the copies' rows and the empty slots' (`_skip`); `_fold` reduces
                 the copies over copies x DP, each copy moving a 1/r share over DP. zero 1-3: the DP reduction
                 reduces every row; the copies then sum their reduced pieces over EP (`_sum_pieces`). Either way
                 every copy ends with the same bits, so their AdamW steps stay identical; the extra copies leave
                 the clipping norm
Exact: the experts' maths is untouched, only where it runs (tests/equivalence/test_equivalence_placement.py).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from .comm import collectives as comm
from .ep import EPDispatcher
from .placement import Placement, balanced, choose, dp_shares, identity, sticky
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
    d.slot_of = placement.tables(moe.experts.W_gate.device)
    moe.experts.slot_experts = list(placement.slots[rank])
    moe.count_window = True


def ep_nodes(dims, node_size: int) -> list[int] | None:
    """The node of each EP rank (dims.moe_ep of them), numbered in order of appearance, for `placement.balanced`:
    the stage's first EP group's, so that every data replica of the group computes the same placement (None: one
    node, or nodes that do not split an EP group)."""
    if node_size <= 0:
        return None
    group = [g for g in dims.all_group_ranks("ep") if dims.pp_rank == dims.coords(g[0])[1]][0]
    seen: dict[int, int] = {}
    nodes = [seen.setdefault(r // node_size, len(seen)) for r in group]
    return nodes if len(seen) > 1 else None


def _region(off, shape) -> tuple:
    return tuple(slice(o, o + z) for o, z in zip(off, shape))


def placement_extra(shard) -> dict:
    """The checkpoint's placement record (`Rebalancer.record`; collective), {} with the static placement."""
    return shard.rebalancer.record() if shard.rebalancer is not None else {}


class Rebalancer:
    """One rank's placements (one per MoE layer of its stage) and their moves; train.py calls `sum_replica_grads`
    after the gradient sync and `after_step` after the update."""

    def __init__(self, shard, every: int, replicas: int, node_size: int = 0):
        self.shard, self.every, self.R = shard, every, replicas
        self.nodes = ep_nodes(shard.dims, node_size)
        model = shard.model
        self.keys = [k for k, b in model.layers.items() if b.is_moe and isinstance(b.moe.dispatcher, EPDispatcher)]
        prefix = {id(m): n for n, m in model.named_modules()}
        self.names = {k: [f"{prefix[id(model.layers[k].moe.experts)]}.{t}" for t in EXPERT_TENSORS]
                      for k in self.keys}
        self.changes: list[dict] = []  # one per placement change: step, before, after, bytes, pause_s, replicated
        self.last_load: dict[str, list[int]] = {}  # the last window's counts per layer (checkpoints keep them)
        self._pending = None  # the fold started after the final backward (`start_replica_sum`), not yet finished
        self._skip()

    def log(self, msg: str) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(msg, flush=True)

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
        self.last_load = dict(zip(self.keys, loads))
        old = self.placements()
        new = {k: choose(old[k], load, self.R, self.nodes) for k, load in zip(self.keys, loads)}
        return self._apply(step + 1, old, new, loads, optimizer, t0)

    def restore(self, loads: dict | None, optimizer) -> dict | None:
        """After a resume (any layout: an elastic re-layout included): the checkpoint's last window, placed afresh over
        this layout's EP ranks, so the placement's idea outlives the layout. Collective over the stage."""
        if not loads or not self.keys or not all(k in loads for k in self.keys):
            return None
        t0, old = time.perf_counter(), self.placements()
        spare = self.R - 1
        new = {k: sticky(old[k], balanced(loads[k], old[k].P, spare, self.R, self.nodes), self.nodes)
               for k in self.keys}
        self.last_load = {k: loads[k] for k in self.keys}
        return self._apply(0, old, new, [loads[k] for k in self.keys], optimizer, t0)

    def record(self) -> dict:
        """{"placement_load": {layer: counts}} of every stage's layers (a MAX over PP: collective), for a checkpoint."""
        model, dims = self.shard.model, self.shard.dims
        n = model.cfg.n_layers + model.cfg.mtp_layers
        E = model.cfg.num_experts
        t = torch.full((n, E), -1, dtype=torch.long, device=self._device())
        for k, load in self.last_load.items():
            t[int(k)] = torch.tensor(load)
        if dist.is_initialized() and dims.group("pp") is not None:
            comm.all_reduce(t, group=dims.group("pp"), axis="other", op=dist.ReduceOp.MAX)
        return {"placement_load": {str(i): row for i, row in enumerate(t.tolist()) if row[0] >= 0}}

    def _apply(self, step: int, old: dict, new: dict, loads: list, optimizer, t0: float) -> dict | None:
        """Move the changed layers from `old` to `new` and log the change's line (step 0: a resume's restore)."""
        model, dims = self.shard.model, self.shard.dims
        changed = [k for k in self.keys if new[k] != old[k]]
        if not changed:
            return None
        moved = self._move(optimizer, [(k, old[k], new[k]) for k in changed])
        for k in changed:
            install(model.layers[k].moe, new[k], dims.moe_ep_rank)
        if optimizer is not None:  # what knew the old slots (Muon's owner plan) goes: its next step plans the new
            optimizer.on_layout_change()
        self._skip()
        record = {"step": step, "layers": len(changed), "bytes": moved, "pause_s": time.perf_counter() - t0,
                  "before": max(old[k].imbalance(load) for k, load in zip(self.keys, loads)),
                  "after": max(new[k].imbalance(load) for k, load in zip(self.keys, loads)),
                  "replicated": sum(len(new[k].replicated()) for k in self.keys)}
        self.changes.append(record)
        self.log(f"placement {'step ' + str(step) if step else 'restored from the checkpoint'}: "
                 f"busiest/mean {record['before']:.2f} -> {record['after']:.2f} (worst layer), {len(changed)} "
                 f"layer(s) moved, {record['replicated']} expert(s) replicated, "
                 f"{moved / 2**20:.2f} MiB moved, pause {record['pause_s'] * 1e3:.0f} ms")
        return record

    @torch.no_grad()
    def _move(self, optimizer, changes: list[tuple[str, Placement, Placement]]) -> int:
        """The changed slots of the changed layers to their new experts; returns the bytes this EP group sent.
        Only the rows a move reads are put together over expert-DP, and only the rows whose expert changes are
        written: a slot that keeps its expert is not touched."""
        sync = self.shard.sync
        model_state, optim_state = sync.sharded_state(optimizer)
        layers = []  # per change: its Pieces, the rows it reads here, its moves
        for k, old, new in changes:
            pieces = []
            for n in self.names[k]:
                pieces.append(model_state[n])
                pieces += [v for _, v in sorted(optim_state.get(n, {}).items()) if len(v.size)]
            moves = self._plan(old, new)
            layers.append((pieces, sorted({s for p, s, _, _ in moves if p == self.shard.dims.moe_ep_rank}), moves))
        wholes = self._gather_rows([(p, src) for ps, src, _ in layers for p in ps])
        sent, i = 0, 0
        for (k, old, new), (pieces, src, moves) in zip(changes, layers):
            mine = wholes[i:i + len(pieces)]
            rows = torch.cat([w.reshape(len(src), p.size[1:].numel()) for p, w in zip(pieces, mine)], 1)  # [src, W]
            dst, new_rows, n_sent = self._exchange(rows, src, moves, old, new)
            sent += n_sent * rows.shape[1] * rows.element_size()
            at = 0
            for p in pieces:
                width = p.size[1:].numel()
                moved = new_rows[:, at:at + width].reshape(len(dst), *p.size[1:])
                at += width
                for off, t in p.boxes:
                    for j, s2 in enumerate(dst):
                        if off[0] <= s2 < off[0] + t.shape[0]:
                            t[s2 - off[0]].copy_(moved[j][_region(off[1:], t.shape[1:])])
            i += len(pieces)
        return sent

    def _plan(self, old: Placement, new: Placement) -> list[tuple[int, int, int, int]]:
        """(src rank, src slot, dst rank, dst slot) of every slot whose expert changes, in dst order: it takes its
        expert from its own rank if that held it, else from the expert's first old copy."""
        first = old.copies()
        plan = []
        for q, row in enumerate(new.slots):
            for s2, e in enumerate(row):
                if e < 0 or old.slots[q][s2] == e:
                    continue
                src = (q, old.slots[q].index(e)) if e in old.slots[q] else first[e][0]
                plan.append((*src, q, s2))
        return plan

    def _gather_rows(self, pieces: list) -> list[torch.Tensor]:
        """Each (Pieces, rows) as those rows of its whole tensor on every rank of the expert-DP group: whole
        already (every replica holds it), else the disjoint pieces summed over the group (x + 0 = x: exact)."""
        group, device = self.shard.dims.group("expert_dp"), self._device()
        wholes, partial = [], []
        for p, rows in pieces:
            t0 = p.boxes[0][1] if p.boxes else None
            w = torch.zeros(p.size, dtype=torch.float32 if t0 is None else t0.dtype, device=device)
            for off, t in p.boxes:
                w[_region(off, t.shape)] = t
            wholes.append(w[rows])
            partial.append(sum(t.numel() for _, t in p.boxes) < w.numel())
        if group is None:
            return wholes
        flags = torch.tensor(partial, dtype=torch.float32, device=device)
        comm.all_reduce(flags, group=group, axis="other", op=dist.ReduceOp.MAX)  # partial anywhere: sum them
        idx = [j for j, f in enumerate(flags.tolist()) if f and wholes[j].numel()]
        if idx:
            buf = torch.cat([wholes[j].reshape(-1) for j in idx])
            comm.all_reduce(buf, group=group, axis="other")
            for j, part in zip(idx, buf.split([wholes[j].numel() for j in idx])):
                wholes[j] = part.view_as(wholes[j])
        return wholes

    def _exchange(self, rows: torch.Tensor, src: list[int], moves: list, old: Placement,
                  new: Placement) -> tuple[list[int], torch.Tensor, int]:
        """rows [len(src), W] of this rank's source slots `src` -> (the slots that change here, their new rows,
        rows sent between ranks by the whole EP group). A slot left empty gets zeros."""
        me, P = self.shard.dims.moe_ep_rank, old.P
        at = {s: j for j, s in enumerate(src)}
        emptied = [s for s in range(new.C) if new.slots[me][s] < 0 <= old.slots[me][s]]
        dst = sorted(emptied + [s2 for _, _, q, s2 in moves if q == me])
        pos = {s2: j for j, s2 in enumerate(dst)}
        out = rows.new_zeros(len(dst), rows.shape[1])
        for p, s, q, s2 in moves:
            if p == q == me:
                out[pos[s2]] = rows[at[s]]
        send = [[at[s] for p, s, q, _ in moves if p == me and q == d] for d in range(P)]
        recv = [[pos[s2] for p, _, q, s2 in moves if q == me and p == o] for o in range(P)]
        send[me], recv[me] = [], []
        inp = rows.index_select(0, torch.tensor([j for d in send for j in d], dtype=torch.long, device=rows.device))
        buf = rows.new_empty(sum(map(len, recv)), rows.shape[1])
        if P > 1:
            comm.all_to_all_single(buf, inp, [len(r) for r in recv], [len(s) for s in send],
                                   group=self.shard.dims.group("ep"), axis="ep")
        got = [j for r in recv for j in r]
        if got:
            out[torch.tensor(got, device=rows.device)] = buf
        return dst, out, sum(1 for p, _, q, _ in moves if p != q)

    # --- inside a step ----------------------------------------------------------------------------------------
    def _skip(self) -> None:
        """Tell the gradient sync the expert rows it leaves out from the next step on: this rank's empty slots (no
        token reaches them: a zero gradient, nothing to reduce) and its copies of replicated experts (reduced by
        `sum_replica_grads`). `folded`: the flavour can (zero 0); else it reduces every row (zero 1-3)."""
        me, rows = self.shard.dims.moe_ep_rank, {}
        for k, placement in self.placements().items():
            n = [len(c) for c in placement.copies()]
            skip = [s for s, e in enumerate(placement.slots[me]) if e < 0 or n[e] > 1]
            rows.update({name: skip for name in self.names[k]})
        self.folded = self.shard.sync.skip_rows(rows)
        # the copies' DP shares (`_fold`): a function of the placements, so made here, where they change
        self.cuts = self._dp_shares() if self.folded else None

    def _entries(self) -> tuple[list, bool]:
        """(this rank's copies' gradient pieces as (view, its group's ranks, (layer, tensor, expert)), in an order
        every rank shares; whether any layer of the stage has a replicated expert: the EP group agrees on it)."""
        placements = self.placements()
        groups = {k: placements[k].replicated() for k in self.keys}
        pieces = self.shard.sync.grad_pieces({n for k in self.keys if groups[k] for n in self.names[k]})
        me, entries = self.shard.dims.moe_ep_rank, []
        for li, k in enumerate(self.keys):
            mine = {s: (e, r) for e, s, r in groups[k] if me in r}  # column -> its expert, this rank's group there
            for j, n in enumerate(self.names[k]):
                for off, t in pieces[n].boxes if n in pieces else []:
                    entries += [(t[s - off[0]], mine[s][1], (li, j, mine[s][0])) for s in sorted(mine)
                                if off[0] <= s < off[0] + t.shape[0]]
        return entries, any(groups.values())

    @torch.no_grad()
    def start_replica_sum(self) -> None:
        """After the final backward, before the gradient sync is waited for (step.finish_grads): at zero 0 the fold's
        first move (the copies' shares summed over EP) and its DP all-reduce, posted behind the DP buckets still on the
        wire (`ReplicatedSync.launch_rest` first: every bucket scaled and posted), so the copies' DP traffic queues
        with the rest instead of starting after it; `sum_replica_grads` finishes it. zero 1-3: nothing yet."""
        self._pending = None
        if self.R == 1 or not self.folded:
            return
        entries, any_copies = self._entries()
        if any_copies:
            self.shard.sync.launch_rest()
            self._pending = (entries, self._fold_start(entries))

    @torch.no_grad()
    def sum_replica_grads(self) -> torch.Tensor | None:
        """After the gradient sync: each replicated expert's gradient is the sum over its copies and over DP, on every
        copy (`_fold` at zero 0, begun by `start_replica_sum` when finish_grads called it; `_sum_pieces` at zero 1-3).
        Returns this rank's part of the squared norm the extra copies add to the clipping norm (the clip sums it
        over the ranks in its own all-reduce), None without replicas allowed (parallel.expert_replicas 1).
        Collective over EP and DP: every rank calls it, with replicas or not."""
        if self.R == 1:
            return None
        dims = self.shard.dims
        pending, self._pending = self._pending, None
        if pending is not None:
            entries = pending[0]
            self._fold_finish(*pending)
        else:
            entries, any_copies = self._entries()
            if any_copies:
                (self._fold if self.folded else self._sum_pieces)(entries)
        me, dup = dims.moe_ep_rank, torch.zeros(1, dtype=torch.float32, device=self._device())
        for v, ranks, _ in entries:
            if me != ranks[0]:
                dup = dup + v.float().square().sum()
        return dup  # this rank's part: the clip sums it with the expert grads' squares (clip.clip_grad_norm_)

    def _fold(self, entries: list) -> None:
        """zero 0: the copies' rows (whole, scaled, left out of the DP reduction by `_skip`). A replicated expert's
        gradient is one sum over its r copies x DP, done in three moves of a share each: copy c sums share c of every
        copy's row (P2P between the copies' ranks, in rank order), reduces it over DP (one all-reduce of every share
        this rank owns) and hands it to the other copies (the same pairs). So DP carries each replicated expert once,
        not once per copy, and every copy ends with the same bits. The shares (`placement.dp_shares`) even out what each
        EP rank reduces over DP (a rank holding fewer single experts takes more of its copies' rows); without DP,
        1/r each. `_fold_start` makes the first two moves (the DP all-reduce posted, not waited for), `_fold_finish`
        the last."""
        self._fold_finish(entries, self._fold_start(entries))

    def _share(self, entries: list, i: int, q: int) -> torch.Tensor:
        """Copy q's share of entry i's row."""
        v, ranks, (layer, tensor, expert) = entries[i]
        bounds, c = self.cuts[layer][expert][tensor], ranks.index(q)
        return v.reshape(-1)[bounds[c]:bounds[c + 1]]

    def _fold_start(self, entries: list) -> tuple:
        me, P = self.shard.dims.moe_ep_rank, self.shard.dims.moe_ep
        group = self.shard.dims.group("expert_dp")
        peers = [[i for i, (_, r, _) in enumerate(entries) if q in r and q != me] for q in range(P)]
        got = self._swap([[self._share(entries, i, q) for i in peers[q]] for q in range(P)],
                         [[self._share(entries, i, me).numel() for i in peers[q]] for q in range(P)], entries)
        theirs = {(q, i): g for q in range(P) for i, g in zip(peers[q], got[q])}
        # this rank's share of each row, summed over the copies
        mine = [_in_rank_order([self._share(entries, i, me) if q == me else theirs[(q, i)] for q in ranks])
                for i, (_, ranks, _) in enumerate(entries)]
        flat, work = None, None
        if sum(m.numel() for m in mine) and group is not None:  # DP replicas hold the same placement: the same shares
            flat = torch.cat(mine)
            work = comm.all_reduce(flat, group=group, axis="dp", async_op=True)
        return peers, mine, flat, work

    def _fold_finish(self, entries: list, state: tuple) -> None:
        peers, mine, flat, work = state
        if work is not None:
            work.wait()
            mine = list(flat.split([m.numel() for m in mine]))
        P, me = self.shard.dims.moe_ep, self.shard.dims.moe_ep_rank
        got = self._swap([[mine[i] for i in peers[q]] for q in range(P)],
                         [[self._share(entries, i, q).numel() for i in peers[q]] for q in range(P)], entries)
        for i, m in enumerate(mine):
            self._share(entries, i, me).copy_(m)
        for q in range(P):
            for i, g in zip(peers[q], got[q]):
                self._share(entries, i, q).copy_(g)

    def _sum_pieces(self, entries: list) -> None:
        """zero 1-3: the pieces were reduced over DP with the rest (a copy's pieces are the same elements on every EP
        rank: one spare column); each copy's pieces go to the other copies only, the same sum in rank order on each."""
        me, P = self.shard.dims.moe_ep_rank, self.shard.dims.moe_ep
        peers = [[(i, v) for i, (v, r, _) in enumerate(entries) if q in r and q != me] for q in range(P)]
        got = self._swap([[v for _, v in peers[q]] for q in range(P)],
                         [[v.numel() for _, v in peers[q]] for q in range(P)], entries)
        theirs = {(q, i): g.view_as(v) for q in range(P) for (i, v), g in zip(peers[q], got[q])}
        for i, (v, ranks, _) in enumerate(entries):
            v.copy_(_in_rank_order([v if q == me else theirs[(q, i)] for q in ranks]))

    def _dp_shares(self) -> list[dict[int, list[list[int]]]]:
        """`placement.dp_shares` of this stage's placements and expert rows (water-filled with DP, 1/r without)."""
        params, placements = dict(self.shard.model.named_parameters()), self.placements()
        rows = [[params[n][0].numel() for n in self.names[k]] for k in self.keys]
        return dp_shares([placements[k] for k in self.keys], rows,
                         balance=self.shard.dims.group("expert_dp") is not None)

    def _swap(self, sends: list[list[torch.Tensor]], sizes: list[list[int]], entries: list) -> list[list[torch.Tensor]]:
        """sends[q]'s tensors (flattened) to EP rank q, from each rank q the flat tensors of sizes[q]: sends and
        receives to the copies' ranks only (one batch of P2P ops; the exchange is symmetric: a rank receives from
        the ranks it sends to), so the copies' traffic costs the latency of the links it uses (one node's, where the
        copies sit) and not an all-to-all's over the whole EP group."""
        dims = self.shard.dims
        me, ranks, group = dims.moe_ep_rank, dims.group_ranks("ep"), dims.group("ep")
        dtype = entries[0][0].dtype if entries else torch.float32  # the gradients' (no entries: nothing moves)
        bufs = [torch.empty(sum(z), dtype=dtype, device=self._device()) for z in sizes]
        ops = []
        for q, vs in enumerate(sends):
            if q != me and bufs[q].numel():
                ops.append(dist.P2POp(dist.irecv, bufs[q], ranks[q], group))
            if q != me and sum(v.numel() for v in vs):
                ops.append(dist.P2POp(dist.isend, torch.cat([v.reshape(-1) for v in vs]), ranks[q], group))
        if ops:
            comm.batch_isend_irecv(ops, axis="ep")
        return [list(buf.split(z)) for buf, z in zip(bufs, sizes)]


def _in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """The copies' sum, `parts` in rank order, added left to right: the same bits on every copy."""
    return sum(parts[1:], parts[0].clone())
