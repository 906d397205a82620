"""Expert parallelism: move each token's top-k assignments to the ranks that own their experts and back.

Shape legend (as in model/moe.py): T tokens on this rank, D d_model, E experts (global), L = E/EP local
experts, K top_k, P = EP ranks, N = T*K assignments packed expert-major on this rank, R assignments
received by this rank (from all P sources).

One layer call (seed, "Dispatch, expert computation and combine"):
  1. pack the local assignments expert-major (`pack_expert_major`); since rank p owns experts
     [p*L, (p+1)*L), expert-major is also destination-major: the all-to-all send order.
  2. gather every source's counts per expert with one small all-to-all and read them to the host once (the only
     host sync: split sizes must be Python ints); every rank computes the same routes from them, by the layer's
     expert shard (placement.EPShard.route): which slot of which rank each assignment goes to. The static
     placement is the identity one (expert e in slot e % L of rank e // L: expert-major is already the send order);
     a balanced placement cuts each replicated expert's assignments over its copies, this microbatch's cut
     (`Placement.route`), and the packed order becomes slot-major. "Local expert" below is a slot.
  3. payload all-to-all with uneven splits, in the compute dtype (bf16 under autocast: half the bytes);
     received rows are source-major (p, then slot).
  4. permute source-major -> expert-major (vectorised, `source_to_expert_major`), run the L experts,
     undo the permutation, and send every row back with the splits swapped.
  5. `combine`: weight each output by its router weight and sum the K outputs of each token.
Backward is the same path reversed: `_AllToAll.backward` is the all-to-all with the splits swapped.
Every collective goes through `parallel.comm.collectives` on axis "ep", so its time and bytes are accounted.
With parallel.ep_overlap_microbatches (two lanes: one microbatch's forward beside another's backward, lanes.py) the
dispatchers of a shard share one `lanes.EPLanes`: two EP groups over the same ranks, forward collectives on the
first, backward ones (the recompute of activation checkpointing included: it runs inside the backward) on the
second (`EPLanes.group`), so each group sees one lane's calls in one deterministic order on every rank; it also
records every blocked EP interval for the lanes' figures and holds the backward lane's filler.
parallel.ep_dispatch static (`EPDispatcher._static`, docs/ep.md "A step that never waits on the host"): the same trip
in fixed-size buffers, equal splits known before the step and every count kept on the device, so step 2's host read
goes; an overflowing buffer turns the layer NaN and the step is replayed with buffers that cannot overflow.
Dropless by default: every assignment reaches its expert, so EP computes exactly what one process would.
With a capacity factor the router has already dropped assignments (expert id E, model/moe.py) on the
source rank, per source microbatch, before step 1: they are never packed into a send, and each rank's
drops are the ones one process would make on the same microbatch.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from ..model import fp8 as float8, wgrad
from ..model.moe import ExpertFFN, combine, in_backward, pack_expert_major
from .comm import collectives as comm
from .lanes import EPLanes
from .placement import EPShard


def _phase(forward: bool) -> str:
    return ("r" if in_backward() else "f") if forward else "b"


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, lanes: EPLanes,
                kind: str = "f:counts") -> None:
    """A blocking EP all-to-all on the calling lane's group; the blocked interval goes to the lanes' recording, if
    any. Timed inline, not by a context manager: the default job makes 20 of these per rank-step, and a context
    object cost four more Python calls each. In the backward lane with a filler
    (`EPLanes.filling`): posted async, the filler runs while it travels, then waited for (the filler's compute is
    not a wait)."""
    fill = lanes.fill
    if fill is not None and in_backward():
        t0 = time.perf_counter()
        work = comm.all_to_all_single(out, inp, out_splits, in_splits, group=lanes.group(), axis="ep",
                                      async_op=True)
        waits = lanes.waits
        if waits is not None:  # posting is an EP call too (comm.py charges it): a blocked interval of its own
            waits.append((1, t0, time.perf_counter(), kind, t0))
        fill()
        lanes.wait(work, kind, t0)
        return
    waits, t0 = lanes.waits, time.perf_counter()
    comm.all_to_all_single(out, inp, out_splits, in_splits, group=lanes.group(), axis="ep")
    if waits is not None:
        waits.append((int(in_backward()), t0, time.perf_counter(), kind, t0))


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all of rows; the gradient travels back along the same links (splits swapped).
    `lanes`: the groups (the forward's, the backward's) and the wait recording, see `lanes.EPLanes`.

    torch.distributed.nn.functional.all_to_all_single handles uneven splits on gloo too (checked on
    torch 2.13), but it is deprecated and bypasses `parallel.comm.collectives`, so its time would go unaccounted.
    """

    @staticmethod
    def forward(ctx, x_ND, out_splits: list[int], in_splits: list[int], lanes: EPLanes, call: str = "dispatch"):
        ctx.out_splits, ctx.in_splits, ctx.lanes, ctx.call = out_splits, in_splits, lanes, call
        out_RD = x_ND.new_empty(sum(out_splits), x_ND.shape[1])
        _all_to_all(out_RD, x_ND, out_splits, in_splits, lanes, _phase(True) + ":" + call)
        return out_RD

    @staticmethod
    def backward(ctx, grad_RD):
        grad_ND = grad_RD.new_empty(sum(ctx.in_splits), grad_RD.shape[1])
        # gloo needs contiguous buffers; comm.all_to_all_single makes the input contiguous.
        _all_to_all(grad_ND, grad_RD, ctx.in_splits, ctx.out_splits, ctx.lanes, "b:" + ctx.call)
        return grad_ND, None, None, None, None


def _fp8_rows_trip(x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], lanes: EPLanes,
                   dtype: torch.dtype, pow2: bool, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(bits_RD, scale_R1) received: each row of x cast to `dtype` with its own scale (model/fp8.py `quantize`),
    sent as one byte buffer of D + 4 bytes a row (fp32 scales), D + 1 where the scales are powers of 2 (`pow2`: the
    exponent, exactly)."""
    bits_ND, scale_N1 = float8.quantize(x_ND, dtype, -1, pow2)
    D, scale_N1 = x_ND.shape[1], scale_N1.float()
    scale_bytes = float8.scale_exponent(scale_N1).view(torch.uint8) if pow2 else scale_N1.view(torch.uint8)
    send = torch.cat([bits_ND.view(torch.uint8), scale_bytes], dim=1)  # [N, D + 1 or 4]
    recv = send.new_empty(sum(out_splits), send.shape[1])
    _all_to_all(recv, send, out_splits, in_splits, lanes, kind)
    bits_RD = recv[:, :D].contiguous().view(bits_ND.dtype)
    scale_R1 = recv[:, D:].contiguous()
    scale_R1 = float8.exponent_scale(scale_R1.view(torch.int8)) if pow2 else scale_R1.view(torch.float32)
    return bits_RD, scale_R1


class _Fp8Combine(_AllToAll):
    """The combine trip of parallel.fp8_comm: the expert outputs go home as `_AllToAll` sends them, in their dtype,
    and their gradient comes back in FP8 as the recipe casts it for the experts' last GEMM (grad_x of W_out): each
    row in the gradient dtype (e5m2 tensorwise, e4m3 rowwise) with its own scale, `_fp8_rows_trip`'s bytes. The
    experts read its values (dequantized), which model/fp8.py `experts` makes the same where no trip carries them."""

    @staticmethod
    def forward(ctx, y_RD, out_splits: list[int], in_splits: list[int], lanes: EPLanes, fp8):
        ctx.fp8 = fp8
        return _AllToAll.forward(ctx, y_RD, out_splits, in_splits, lanes, "combine")

    @staticmethod
    def backward(ctx, grad_ND):
        f = ctx.fp8
        bits_RD, scale_R1 = _fp8_rows_trip(grad_ND, ctx.in_splits, ctx.out_splits, ctx.lanes, f.grad_dtype, f.pow2,
                                           "b:combine")
        return float8.dequantize(bits_RD, scale_R1, grad_ND.dtype), None, None, None, None


class _Fp8AllToAll(torch.autograd.Function):
    """The dispatch of parallel.fp8_comm: each row x [N, D] as the experts' gate and value GEMMs will read it, its
    FP8 bits and per-row scale (model/fp8.py `experts`: the same quantization the receiver would make), sent as one
    byte buffer of D + 4 bytes a row (fp32 scales), D + 1 where the recipe's scales are powers of 2 (rowwise: the
    exponent, exactly). Returns the received rows' values (dequantized: what the weight gradient
    reads, and the carrier of their gradient) and their bits and scales, which the GEMMs read as they are. The
    gradient travels back as `_AllToAll`'s does, in its own dtype."""

    @staticmethod
    def forward(ctx, x_ND, out_splits: list[int], in_splits: list[int], lanes: EPLanes, fp8):
        ctx.out_splits, ctx.in_splits, ctx.lanes = out_splits, in_splits, lanes
        bits_RD, scale_R1 = _fp8_rows_trip(x_ND, out_splits, in_splits, lanes, fp8.forward_dtype, fp8.pow2,
                                           _phase(True) + ":dispatch")
        ctx.mark_non_differentiable(bits_RD, scale_R1)
        return float8.dequantize(bits_RD, scale_R1, x_ND.dtype), bits_RD, scale_R1

    @staticmethod
    def backward(ctx, grad_RD, _bits, _scale):
        grad_ND = grad_RD.new_empty(sum(ctx.in_splits), grad_RD.shape[1])
        _all_to_all(grad_ND, grad_RD, ctx.in_splits, ctx.out_splits, ctx.lanes, "b:dispatch")
        return grad_ND, None, None, None, None


def all_to_all_rows(x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                    backward_group=None) -> torch.Tensor:
    """Differentiable uneven all-to-all over dim 0: send in_splits[p] rows to rank p, receive out_splits[p].
    The gradient goes back on `backward_group` (default: `group`)."""
    return _AllToAll.apply(x_ND, out_splits, in_splits, EPLanes(group, backward_group))


def source_to_expert_major(recv_counts_PL: torch.Tensor, total: int) -> torch.Tensor:
    """Permutation `perm_R` with `x_expert_major = x_source_major[perm_R]`.

    The received buffer holds, for each source p and then each local expert l, recv_counts_PL[p, l]
    rows. Label every row with its local expert and stable-sort the labels: rows of expert l become
    contiguous and keep source order inside the expert (the order one process would use).
    `total` = recv_counts_PL.sum(), passed from the host so repeat_interleave needs no device sync.
    """
    P, L = recv_counts_PL.shape
    expert_of_slot = torch.arange(L, device=recv_counts_PL.device).repeat(P)  # (P*L,) slot (p, l) -> l
    expert_of_row_R = expert_of_slot.repeat_interleave(recv_counts_PL.reshape(-1), output_size=total)
    return torch.argsort(expert_of_row_R, stable=True)


def inverse_permutation(perm_R: torch.Tensor) -> torch.Tensor:
    inv_R = torch.empty_like(perm_R)
    inv_R[perm_R] = torch.arange(perm_R.numel(), device=perm_R.device)
    return inv_R


class _ChunkPlan:
    """parallel.ep_overlap: the local experts cut into `n` groups [l0, l1); group c's rows travel in their own
    all-to-alls. `idx[c]`: the rows of the packed send buffer (destination-major) that group c sends, in send
    order (destination, then expert); in/out_splits, the received rows' permutation to expert-major and their
    counts per expert of the group (slices of the one-trip path's `counts_L`). `groups[c]`: what group c's expert
    GEMMs are handed, its host counts, or with `grouped` (ExpertFFN.grouped) its offsets on the device."""

    def __init__(self, send_host, recv_host, recv_PL, counts_E, counts_L: list[int], L: int, n: int,
                 lanes: EPLanes, grouped: bool = False):
        P = len(send_host)
        self.lanes = lanes  # the trips of a backward go on the backward lane's group
        self.bounds = [(c * L // n, (c + 1) * L // n) for c in range(n)]
        self.in_splits = [[sum(row[l0:l1]) for row in send_host] for l0, l1 in self.bounds]
        self.out_splits = [[sum(row[l0:l1]) for row in recv_host] for l0, l1 in self.bounds]
        self.counts_L = [counts_L[l0:l1] for l0, l1 in self.bounds]
        self.groups = ([wgrad.group_offsets(recv_PL[:, l0:l1].sum(0)) for l0, l1 in self.bounds] if grouped
                       else self.counts_L)
        group_of_l = torch.tensor([c for c, (l0, l1) in enumerate(self.bounds) for _ in range(l0, l1)],
                                  device=counts_E.device)
        self.N = sum(map(sum, self.in_splits))
        group_of_row = group_of_l.repeat(P).repeat_interleave(counts_E, output_size=self.N)  # expert p*L+l -> group
        self.idx = torch.argsort(group_of_row, stable=True).split([sum(s) for s in self.in_splits])
        self.perm = [source_to_expert_major(recv_PL[:, l0:l1], sum(out))
                     for (l0, l1), out in zip(self.bounds, self.out_splits)]
        self.inv = [inverse_permutation(p) for p in self.perm]

    def post_out(self, t_ND: torch.Tensor) -> tuple[list[torch.Tensor], list]:
        """Every group's rows of the packed `t_ND` sent to their experts' owners at once (async): (received
        buffers, works); the sends are held by the works until waited."""
        recvs = [t_ND.new_empty(sum(o), t_ND.shape[1]) for o in self.out_splits]
        group = self.lanes.group()
        works = [comm.all_to_all_single(r, t_ND.index_select(0, i), o, s, group=group, axis="ep", async_op=True)
                 for r, i, o, s in zip(recvs, self.idx, self.out_splits, self.in_splits)]
        return recvs, works

    def post_back(self, c: int, t_c: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Group c's rows (source-major, as received) back to their sources (async): (buffer, work)."""
        buf = t_c.new_empty(sum(self.in_splits[c]), t_c.shape[1])
        return buf, comm.all_to_all_single(buf, t_c, self.in_splits[c], self.out_splits[c],
                                           group=self.lanes.group(), axis="ep", async_op=True)

    def unpack(self, backs: list[torch.Tensor], works: list, kind: str) -> torch.Tensor:
        """Wait for every group's return trip and put its rows back in their places of the packed buffer."""
        for w in works:
            self.lanes.wait(w, kind)
        t_ND = backs[0].new_empty(self.N, backs[0].shape[1])
        for i, b in zip(self.idx, backs):
            t_ND.index_copy_(0, i, b)
        return t_ND


class _ExpertTrip(torch.autograd.Function):
    """Dispatch, experts and return trip of the packed rows x_ND, pipelined over the groups of a `_ChunkPlan`
    (parallel.ep_overlap): every group's dispatch is posted at once; group c's experts run while the later
    groups' dispatches and the earlier groups' return trips are on the wire. Backward is the same in reverse,
    each group's weight-gradient GEMMs filling the time its input gradient spends travelling back.

    Exact: an expert receives the same rows in the same order (source, then token) as in the one-trip path, and
    each group's rows land back in the same places of the packed buffer, so every GEMM reads what it reads there:
    outputs and gradients are bitwise those of the one-trip path (tests/parallel/test_ep.py). Weight gradients
    land whole, once per call: through the experts' WeightGradStore when one is attached (deferred under zb1's
    B), else returned to autograd (its AccumulateGrad fires the gradient syncs' hooks as usual). Everything the
    backward reads is saved with save_for_backward, so activation checkpointing recomputes the forward, trips
    included, as a block's other ops (every EP rank recomputes at the same point of the same schedule)."""

    @staticmethod
    def forward(ctx, x_ND, W_gate, W_val, W_out, anchor, plan: _ChunkPlan, params, store):
        dt = wgrad._autocast_dtype(x_ND)
        wg, wv, wo = (wgrad._cast(t, dt) for t in (W_gate, W_val, W_out))
        recvs, works = plan.post_out(x_ND)
        xs, saved, backs, back_works = [], [], [], []
        kind = _phase(True) + ":trip"
        for c, (l0, l1) in enumerate(plan.bounds):
            plan.lanes.wait(works[c], kind)
            x_c = wgrad._cast(recvs[c].index_select(0, plan.perm[c]), dt)
            y_c, saved_c = wgrad.experts_forward(x_c, wg[l0:l1], wv[l0:l1], wo[l0:l1], plan.groups[c])
            buf, work = plan.post_back(c, y_c.index_select(0, plan.inv[c]))
            backs.append(buf)
            back_works.append(work)
            xs.append(x_c)
            saved += saved_c
        y_ND = plan.unpack(backs, back_works, kind)
        ctx.save_for_backward(wg, wv, wo, *xs, *saved)
        ctx.plan, ctx.params, ctx.store, ctx.x_dtype = plan, params, store, x_ND.dtype
        ctx.w_dtypes = (W_gate.dtype, W_val.dtype, W_out.dtype)
        return y_ND

    @staticmethod
    def backward(ctx, dy_ND):
        plan = ctx.plan
        wg, wv, wo, *rest = ctx.saved_tensors
        n = len(plan.bounds)
        xs, saved = rest[:n], rest[n:]
        recvs, works = plan.post_out(dy_ND)  # the return trip's gradient goes out again
        deferring = ctx.store is not None and ctx.store.active
        backs, back_works, terms, grads = [], [], [], []
        k = 0
        for c, (l0, l1) in enumerate(plan.bounds):
            plan.lanes.wait(works[c], "b:trip")
            dy_c = recvs[c].index_select(0, plan.perm[c])
            n_s = 4 if isinstance(plan.groups[c], torch.Tensor) else 4 * (l1 - l0)  # grouped: saved once per group
            dx_c, terms_c = wgrad.experts_input_grad(dy_c, xs[c], wg[l0:l1], wv[l0:l1], wo[l0:l1],
                                                     saved[k:k + n_s], plan.groups[c], ctx.x_dtype)
            k += n_s
            buf, work = plan.post_back(c, dx_c.index_select(0, plan.inv[c]))
            backs.append(buf)
            back_works.append(work)
            if deferring:
                terms += terms_c  # zb1's W runs them later, all at once
            else:
                grads.append(wgrad.experts_weight_grads(terms_c))  # while dx_c travels
        dx_ND = plan.unpack(backs, back_works, "b:trip")
        if deferring:
            ctx.store.land(wgrad.land_expert_grads(ctx.params, ctx.store.fuse), *terms)
            return dx_ND, None, None, None, None, None, None, None
        full = [torch.cat(gs).to(dt) for gs, dt in zip(zip(*grads), ctx.w_dtypes)]  # groups are consecutive experts
        if ctx.store is not None:  # attached but not deferring: land now, as _Experts does
            for p, g in zip(ctx.params, full):
                wgrad.accumulate(p, g)
            return dx_ND, None, None, None, None, None, None, None
        return dx_ND, *full, None, None, None, None


class EPDispatcher:
    """Drop-in for `LocalDispatcher` under EP: same call, experts spread over the EP group by `shard`.

    `shard` (placement.EPShard): which global expert each slot of every rank holds; `experts` must hold this rank's
    slots (`shard.experts_at(shard.rank)`: experts [ep_rank*L, (ep_rank+1)*L) under the static placement).
    Every rank of the group must call it the same number of times (it is collective), even with zero tokens.
    Each training forward's call records the whole group's assignments per expert (`received`, drained by the step:
    `take_received`): the routing skew of the step's record, known here without a collective of its own.
    """

    def __init__(self, shard: EPShard, group, overlap_chunks: int = 1, backward_group=None,
                 lanes: EPLanes | None = None, capacity: float | None = None):
        if shard.P > 1 and group is None:
            raise ValueError(f"EPDispatcher over {shard.P} ranks needs the EP process group (dims.group('ep'))")
        # backward_group (parallel.ep_overlap_microbatches): a second group over the same ranks for the backward
        # lane's collectives; without it forwards and backwards share `group`. lanes: the EPLanes this dispatcher
        # shares with the shard's others and the lanes' runtime (apply_ep), else one of its own over these groups.
        self.lanes = lanes if lanes is not None else EPLanes(group, backward_group)
        self.shard = shard
        self.overlap_chunks = overlap_chunks  # > 1: parallel.ep_overlap, that many expert groups per trip
        self.capacity = capacity  # parallel.ep_dispatch static: each peer's buffer in expected shares; None: dynamic
        self.received: list[torch.Tensor] = []  # per training forward: the EP group's assignments per expert (E,)
        self.last_received: torch.Tensor | None = None  # a compiled static call's, until `forward_done`

    def forward_done(self) -> None:
        """After a training forward of the block (model/transformer.py, eagerly, never in a recompute): a block
        compiled whole left its record in `last_received`; it joins `received` here."""
        if self.last_received is not None:
            self.received.append(self.last_received)
            self.last_received = None

    @property
    def group(self):
        """The group of the calling lane (`EPLanes.group`)."""
        return self.lanes.group()

    def __call__(self, x_TD, expert_ids_TK, weights_TK, experts: ExpertFFN, num_experts: int,
                 positions: int | None = None):
        """positions: the tokens every EP rank sizes static buffers by (default T): its positions, routed or not."""
        P, C = self.shard.P, experts.W_gate.shape[0]  # C slots per rank: E/P, and spares for a placement's copies
        assert C == self.shard.C and num_experts % P == 0, (
            f"experts hold {C} slots; the expert shard places {num_experts} experts in {self.shard.C} slots "
            f"on {P} ranks")
        T, D = x_TD.shape
        if self.capacity is not None:
            return self._static(x_TD, expert_ids_TK, weights_TK, experts, num_experts, positions or T)

        # 1. pack expert-major; 2. every source's counts per expert (one small all-to-all), read to the host once: the
        # shard's routes (send_PC[p][s]: mine to rank p's slot s; recv_PC[q][s]: rank q's to my slot s), the same on
        # every rank; then the packed order slot-major, the send order (dropped assignments last: never sent)
        order_N, _, counts_E = pack_expert_major(expert_ids_TK, num_experts)
        counts_PE = self._gather_counts(counts_E).cpu()  # the one host sync per call
        if torch.is_grad_enabled() and not in_backward():  # a training forward (a recompute is in the backward)
            self.received.append(counts_PE.sum(0))
        route = self.shard.route(counts_PE)
        order_N = self.shard.slot_major(expert_ids_TK, order_N, counts_E, route)
        send_host, recv_host = route.send, route.recv
        device = counts_E.device
        recv_PL = torch.tensor(recv_host, dtype=torch.long).to(device)  # "local expert" is a slot from here on
        L = C
        in_splits = [sum(row) for row in send_host]
        out_splits = [sum(row) for row in recv_host]
        counts_L = [sum(col) for col in zip(*recv_host)]
        R, N = sum(out_splits), sum(in_splits)
        order_N = order_N[:N]  # the kept prefix
        token_idx_N = order_N // expert_ids_TK.shape[1]
        x_ND = x_TD.index_select(0, token_idx_N)
        # Under autocast the experts' GEMMs read x in the compute dtype anyway, so casting before the
        # dispatch changes no value and halves the bytes on the wire (bf16); the combine trip (expert
        # outputs) and both backward trips are already in it. fp32 runs skip this.
        if torch.is_autocast_enabled(x_ND.device.type):
            x_ND = x_ND.to(torch.get_autocast_dtype(x_ND.device.type))

        # 3. dispatch; 4. experts in expert-major order, then back to source-major
        # The grouped experts read their counts from the device (recv_PL), the loop from the host ints it has.
        n, grouped = min(self.overlap_chunks, L), experts.grouped(x_TD)
        if n > 1 and P > 1:  # parallel.ep_overlap: the same trip in n pipelined groups of experts
            counts_PC = torch.tensor(send_host, dtype=torch.long).view(-1).to(device)  # mine per global slot p*C + s
            plan = _ChunkPlan(send_host, recv_host, recv_PL, counts_PC, counts_L, L, n, self.lanes, grouped)
            y_ND = self._chunked_trip(x_ND, experts, plan)
        else:
            perm_R = source_to_expert_major(recv_PL, R)
            fp8 = experts.fp8 if experts.fp8 is not None and experts.fp8.wire and P > 1 else None
            if fp8 is not None:  # parallel.fp8_comm: the rows' FP8 operand on the wire, read by the GEMMs as it is
                x_RD, bits_RD, scale_R1 = _Fp8AllToAll.apply(x_ND, out_splits, in_splits, self.lanes, fp8)
                bits_RD = bits_RD.view(torch.uint8).index_select(0, perm_R).view(bits_RD.dtype)  # (bytes: any kernel)
                scale_R1 = scale_R1.index_select(0, perm_R)
                y_RD = experts(x_RD.index_select(0, perm_R), counts_L, x_fp8=(bits_RD, scale_R1))
            else:
                x_RD = self._a2a(x_ND, out_splits, in_splits, "dispatch")
                y_RD = experts(x_RD.index_select(0, perm_R), recv_PL.sum(0) if grouped else counts_L)
            y_RD = y_RD.index_select(0, inverse_permutation(perm_R))
            if fp8 is not None:  # its gradient in FP8 on the way back
                y_ND = _Fp8Combine.apply(y_RD, in_splits, out_splits, self.lanes, fp8)
            else:
                y_ND = self._a2a(y_RD, in_splits, out_splits, "combine")  # return trip: splits swapped

        # 5. combine in this rank's packed order
        w_N = weights_TK.reshape(-1).index_select(0, order_N)
        return combine(y_ND, w_N, token_idx_N, T)

    def _static(self, x_TD, expert_ids_TK, weights_TK, experts: ExpertFFN, num_experts: int,
                positions: int) -> torch.Tensor:
        """parallel.ep_dispatch static: the same trip with every size known before the step. Each rank sends each peer
        S = `static_slots` rows (its assignments to that peer's slots, slot-major, then zeros), so both all-to-alls
        have equal splits; every count stays on the device: the senders' counts travel as in the dynamic path
        (`_gather_counts`) and tell each receiver where each slot's rows sit in its buffer, the grouped experts take
        their offsets from them. A peer owed more than S rows overflows: its rows past S are not sent, and the
        layer's output turns NaN on that rank, which the step's finiteness verdict carries to every rank (the
        step is then replayed with buffers no source can overflow: parallel/step.py `replay_on_overflow`). The rows an
        expert reads, and
        their order (source, then token), are the dynamic path's, so the maths is the same."""
        P, C, me = self.shard.P, self.shard.C, self.shard.rank
        T, K = x_TD.shape[0], expert_ids_TK.shape[1]
        # sized by the rank's positions, the same on every EP rank (an MTP tail leaves one CP rank fewer routed)
        S = static_slots(positions * K, P, self.capacity)
        assert experts.grouped(x_TD), "static dispatch runs the grouped experts (config: model.experts_impl grouped)"
        order_N, _, counts_E = pack_expert_major(expert_ids_TK, num_experts)
        counts_PE = self._gather_counts(counts_E)  # never read: the receivers' slot counts
        if torch.is_grad_enabled() and torch.compiler.is_compiling():  # a block compiled whole: `forward_done`
            self.last_received = counts_PE.sum(0)  # records it outside the graph (an append would guard on the length)
        elif torch.is_grad_enabled() and not in_backward():
            self.received.append(counts_PE.sum(0))
        slots_PG, order_N = self.shard.route_on_device(counts_PE, expert_ids_TK, order_N, counts_E)  # [P, P*C]
        n_P = slots_PG[me].view(P, C).sum(1)  # mine per destination
        # the send buffer: row (p, i) is my i-th assignment to rank p, if it has one and i < S
        i_S = torch.arange(S, device=x_TD.device)
        sent_PS = i_S < n_P.clamp(max=S)[:, None]
        pick_PS = ((n_P.cumsum(0) - n_P)[:, None] + i_S).clamp(max=order_N.numel() - 1)
        a_R = order_N.index_select(0, pick_PS.reshape(-1))  # flat assignment t*K + k of every buffer row
        token_R = a_R // K
        x_RD = torch.where(sent_PS.view(-1, 1), x_TD.index_select(0, token_R), 0)
        if torch.is_autocast_enabled(x_RD.device.type):  # as the dynamic path: the GEMMs' dtype on the wire
            x_RD = x_RD.to(torch.get_autocast_dtype(x_RD.device.type))
        # the receiver: source q's rows of my slot s, as many as fit its buffer (rows of a slot are consecutive)
        recv_PC = slots_PG[:, me * C:(me + 1) * C]
        end_PC = recv_PC.cumsum(1).clamp(max=S)
        slot_PS = torch.searchsorted(end_PC, i_S.expand(P, S).contiguous(), right=True)  # C: padding
        x_RD = self._a2a(x_RD, [S] * P, [S] * P, "dispatch")
        perm_R = torch.argsort(slot_PS.view(-1), stable=True)  # slot-major, source order within a slot, padding last
        kept_C = torch.diff(end_PC, dim=1, prepend=end_PC.new_zeros(P, 1)).sum(0)
        y_RD = experts(x_RD.index_select(0, perm_R), kept_C).index_select(0, inverse_permutation(perm_R))
        y_RD = torch.where((slot_PS < C).view(-1, 1), y_RD, 0)  # padding rows: no expert wrote them
        y_RD = self._a2a(y_RD, [S] * P, [S] * P, "combine")
        w_R = torch.where(sent_PS.view(-1), weights_TK.reshape(-1).index_select(0, a_R), 0)
        out_TD = combine(torch.where(sent_PS.view(-1, 1), y_RD, 0), w_R, token_R, T)
        return out_TD.masked_fill((n_P > S).any(), float("nan"))  # overflow: the step's verdict sees it

    def _gather_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """counts_PE [P, E]: every source's assignments per expert (row q: source q's), by one all-to-all of this
        rank's counts to every rank (what each rank needs to compute every rank's routes)."""
        mine = counts_E.expand(self.shard.P, counts_E.numel()).contiguous()  # row p goes to rank p
        if self.shard.P == 1:
            return mine
        if torch.compiler.is_compiling():  # a block compiled whole: a functional collective, in its graph
            return funcol.all_to_all_single(mine, None, None, self.lanes.group())
        counts_PE = torch.empty_like(mine)
        _all_to_all(counts_PE, mine, None, None, self.lanes, _phase(True) + ":counts")
        return counts_PE

    def _chunked_trip(self, x_ND, experts: ExpertFFN, plan: _ChunkPlan) -> torch.Tensor:
        def trip(W_gate, W_val, W_out, store):  # inside experts' call: its weights as its wrappers present them
            params = (W_gate, W_val, W_out)
            if store is not None and torch.is_grad_enabled():  # weights detached, gradients through the store
                return _ExpertTrip.apply(x_ND, *(p.detach() for p in params), store.anchor, plan, params, store)
            return _ExpertTrip.apply(x_ND, *params, None, plan, params, None)
        return experts(x_ND, plan.counts_L, trip=trip)

    def _a2a(self, x_ND, out_splits, in_splits, call: str):
        if self.shard.P == 1:
            return x_ND
        if torch.compiler.is_compiling():  # static splits in a block compiled whole: the differentiable functional one
            return funcol.all_to_all_single_autograd(x_ND, out_splits, in_splits, self.lanes.group())
        return _AllToAll.apply(x_ND, out_splits, in_splits, self.lanes, call)


def static_slots(assignments: int, P: int, capacity: float) -> int:
    """Rows of each peer's static buffer: `capacity` times a peer's expected share of this rank's assignments, at least
    one (capacity P: every assignment fits, whatever the routing)."""
    return max(1, math.ceil(capacity * assignments / P - 1e-9))


@contextlib.contextmanager
def worst_case_capacity(model: nn.Module):
    """Within: every static dispatcher's buffers hold all of a source's assignments (capacity P), so none overflows:
    the replay of a step that did (parallel/step.py `replay_on_overflow`) and an evaluation (`evaluate`)."""
    static = [m.dispatcher for m in model.moe_layers()
              if isinstance(m.dispatcher, EPDispatcher) and m.dispatcher.capacity is not None]
    saved = [d.capacity for d in static]
    for d in static:
        d.capacity = float(d.shard.P)
    try:
        yield
    finally:
        for d, c in zip(static, saved):
            d.capacity = c


def apply_ep(model: nn.Module, dims, overlap_chunks: int = 1, lanes: bool = False,
             capacity: float | None = None) -> nn.Module:
    """Install an EPDispatcher on every MoE layer of a Transformer shard (in place); no-op when ep == 1.
    overlap_chunks > 1 (parallel.ep_overlap): each trip pipelined over that many groups of the local experts.
    Every dispatcher shares one `lanes.EPLanes` (`lanes_of`). lanes (parallel.ep_overlap_microbatches): backward
    collectives on dims.group("ep_backward"), and each MoE's router statistics kept per lane
    (MoE.lane_local_router_state). capacity (parallel.ep_dispatch static): parallel.ep_capacity; None: dynamic.

    The shard must have been built for this rank's experts (`build_chunk_specs(cfg, pp_rank, ep_rank)`), each MoE
    layer with its expert shard over the EP ranks (`placement.expert_shards(cfg, dims)`), which its dispatcher
    routes by.
    """
    if dims.moe_ep == 1:  # the experts are sharded over EP x CP x TP (parallel/tp.py, cp.py: folded)
        return model
    group = dims.group("ep")
    backward_group = dims.group("ep_backward") if lanes else None
    assert not lanes or backward_group is not None, "lanes need dims.build_backward_ep_groups() first"
    shared = EPLanes(group, backward_group)
    for moe in model.moe_layers():
        n, r = dims.moe_ep, dims.moe_ep_rank
        L = moe.num_experts // n
        if moe.num_experts % n:
            raise ValueError(f"model.num_experts={moe.num_experts} must be divisible by parallel.ep*cp*tp={n} "
                             f"(--model.num_experts or --parallel.ep)")
        if (moe.expert_start, moe.expert_end) != (r * L, (r + 1) * L):
            raise ValueError(f"MoE shard holds experts [{moe.expert_start}, {moe.expert_end}) but expert shard "
                             f"{r} owns [{r * L}, {(r + 1) * L}): build the "
                             f"model with build_chunk_specs(cfg, pp_rank, ep_rank={r})")
        shard = moe.expert_shard
        if not isinstance(shard, EPShard) or (shard.P, shard.rank) != (n, r):
            raise ValueError(f"MoE layer's expert shard is {shard!r}, not EP rank {r} of {n}: build the model with "
                             f"experts=placement.expert_shards(cfg, dims)")
        moe.dispatcher = EPDispatcher(shard, group, overlap_chunks, lanes=shared, capacity=capacity)
        if capacity is not None:  # the static dispatch's tables, on the experts' device before any (traced) call
            shard.static_tables(moe.experts.W_gate.device)
        moe.lane_local_router_state = lanes
    return model


def take_received(model: nn.Module, keys: list[str]) -> torch.Tensor | None:
    """(layers, forwards, E): each EP dispatcher's records since the last call (`EPDispatcher.received`: the EP
    group's assignments per expert, one per training forward), rows in `keys` order (global layer indices), cleared;
    None without EP."""
    dispatchers = [model.layers[k].moe.dispatcher for k in keys]
    if not dispatchers or not isinstance(dispatchers[0], EPDispatcher):
        return None
    out = torch.stack([torch.stack(d.received) for d in dispatchers])
    for d in dispatchers:
        d.received.clear()
    return out


def lanes_of(model: nn.Module) -> EPLanes:
    """The EPLanes the model's EP dispatchers share (apply_ep); without EP a fresh one, which no EP call sees."""
    for moe in model.moe_layers():
        if isinstance(moe.dispatcher, EPDispatcher):
            return moe.dispatcher.lanes
    return EPLanes()
