"""Pipeline parallelism: one training step's forwards and backwards over M microbatches (GPipe, 1F1B,
interleaved 1F1B, zero-bubble ZB-H1).

Each rank holds one stage (a Transformer), or under the interleaved schedule V model chunks (`StageChunks`,
pp/chunks.py): global chunk c = v*PP + pp_rank, both built by parallel/build.py `build_stage` from
`build_chunk_specs(cfg, pp_rank, ep_rank)`. The runner of one microbatch's F / B / W is pp/runner.py's (a type per
way a backward runs); the shard hands in its EP lanes (`Lanes`), so nothing here imports EP.
The first chunk takes token microbatches `(m, S)`, later ones receive hidden states `(m, S, D)` from the
previous chunk and send the gradient of that input back (pp/comms.py). The last chunk computes the loss.
Per microbatch, the objective a chunk backpropagates is

    last chunk:   loss_scale * (ce + aux_weight * aux_sum)
    other chunks: loss_scale * aux_weight * aux_sum   +   <received output gradient, output>

so every chunk's own MoE router losses are part of its own backward (the trainer passes loss_scale = 1/M
and aux_weight = 1 / n_moe_layers_total, docs/design.md §4). Summed over chunks this is exactly the single-process
gradient of  sum_i loss_scale * (ce_i + aux_weight * aux_i), whatever the order the schedule runs them in.

Schedules (seed "GPipe Schedule" / "1F1B schedule"; Narayanan et al. 2021, Megatron-LM's
`forward_backward_pipelining_without_interleaving` / `_with_interleaving`; Qi et al. 2023):
- gpipe: all M forwards, then all M backwards in reverse order; holds M microbatches' activations.
- 1f1b:  stage p runs `warmup = min(PP - p - 1, M)` forwards, then alternates one forward / one
         backward (M - warmup times; the output send and the gradient receive are one paired P2P),
         then drains the remaining `warmup` backwards. Holds at most PP - p microbatches' activations.
         (The seed's sketch warms up PP - p forwards, which starts the steady phase one microbatch late
         and needs special cases at its boundaries; Megatron's count makes every phase a plain loop and
         is correct for any M >= 1, including M < PP.)
- zb1:   1F1B's forwards, backwards and P2P, but each backward is only B, the input gradient the previous
         stage waits for, with every weight-gradient GEMM deferred into a WeightGradStore (model/wgrad.py); those
         weight gradients W run later: stage p keeps p of them pending
         through the steady phase (torch's ScheduleInterleavedZeroBubble with one chunk) and runs them while
         its gradient sends are in flight, i.e. in the cooldown's idle time. Bubble (PP-1)(F+B-W) instead of
         1F1B's (PP-1)(F+B+W); every stage holds at most PP microbatches (F done, W not yet), 1F1B's peak.
- interleaved: Megatron's interleaved 1F1B over V chunks per rank: virtual step k runs chunk
         (k mod PV) div PP forward (chunks in reverse order backward) on microbatch (k div PV)*PP + k mod PP,
         warmup (PP - p - 1)*2 + (V-1)*PP steps, each one batched exchange on the ring; then every steady
         step posts two exchanges, its forward's and its backward's, and waits for each only before the
         compute that reads it, so the transfers overlap compute (Megatron's overlap_p2p_comm); the cooldown
         overlaps likewise. M must be a multiple of PP. Bubble (PP-1)/(V*M) of the ideal step, not (PP-1)/M.
With pp == 1 every schedule is plain gradient accumulation (forward, backward, next microbatch).
parallel.ep_overlap_microbatches runs any of them in two lanes (lanes.py `two_lanes`): the forwards on a thread,
the backwards (and W's) on the caller's, each in the schedule's order, so that a stage's steady F(w+j) runs beside
its B(j) (F(j+1) beside B(j) on 1F1B's last stage and at pp == 1; interleaved likewise, chunk by chunk; gpipe has
no forward beside a backward) and each one's EP all-to-alls travel while the other computes.
`virtual_stages`, `warmup`, `in_flight` and the other counts are stated once, in pp/facts.py (re-exported here:
`schedules.warmup` is that function); the schedules, the planner (plan/cost.py) and the tests all ask them.

The order is a pure function of (schedule, PP, pp_rank, M, V), so the ranks of one EP group (same pp_rank)
run their microbatches in the same order and their all-to-alls pair up: in forwards and in backwards (B under
zb1, recompute of activation checkpointing included; W is GEMMs only, it runs none).
"""

from __future__ import annotations

import collections
import contextlib
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Literal, Protocol

import torch

from ...model.transformer import Routing
from ..dims import ParallelDims
from .comms import StageComms
from .facts import (SCHEDULES, in_flight, interleaved_chunk, interleaved_microbatch, lane_orders, lane_window,
                       theoretical_bubble, virtual_stages, warmup)
from .runner import Filler, FillRunner, SplitRunner, StageRunner, run_weights

__all__ = ["SCHEDULES", "Lanes", "RunOptions", "StepStats", "in_flight", "interleaved_chunk", "interleaved_microbatch",
           "lane_orders", "lane_window", "pipeline_forward", "pipeline_forward_backward", "run_weights", "stage_chunks",
           "theoretical_bubble", "virtual_stages", "warmup"]  # the facts: pp/facts.py's, re-exported



class Lanes(Filler, Protocol):
    """What the shard hands in to run a step in two lanes: its EP dispatchers' shared lanes (parallel/lanes.py
    EPLanes), which fill backwards (`filling`), record EP waits (`recording`), drive the schedule in two lanes
    (`run_schedule`) and sum a step's figures (`account`)."""

    def recording(self, on: bool = True) -> ContextManager: ...

    def run_schedule(self, run: StageRunner, comms: StageComms, M: int, pp: int, pp_rank: int, split: bool,
                     backward_group, least: int, schedule: str, V: int) -> None: ...

    def account(self, spans: list, waits: list | None) -> dict: ...


@dataclass
class RunOptions:
    """pipeline_forward_backward's knobs that only the benches and tests turn."""
    timeline: list | None = None  # receives (kind "F"/"B"/"W", chunk, microbatch, start, end) per computation
    #                               and ("wait", -1, -1, start, end) per blocked P2P call (perf_counter seconds)
    lanes_fill: bool = True  # with lanes: each backward's weight GEMMs fill its all-to-alls (FillRunner);
    #                          False: plain autograd (the bench's comparison)
    lanes_window: int = 2  # with lanes: the least window L of lanes.py `lane_window`


@dataclass
class StepStats:
    """What one step of `pipeline_forward_backward` measured on this rank."""
    ce_sum: torch.Tensor | None  # sum over microbatches of mean CE (detached); last stage only, else None
    aux_sum: torch.Tensor  # sum over microbatches of this stage's MoE aux losses (detached, unweighted)
    wall_s: float  # the whole call
    p2p_wait_s: float  # time blocked in pipeline send/recv (idle: the bubble, plus transfer time)
    compute_s: float  # wall_s - p2p_wait_s: forwards, backwards (incl. EP all-to-alls), bookkeeping
    max_in_flight: int  # most microbatches whose activations this stage held at once (`in_flight` predicts it:
    #                     GPipe M, 1F1B min(M, PP - p), zb1 min(M, PP): F to W; interleaved: chunk-microbatches)
    # The lanes' figures (parallel.ep_overlap_microbatches, lanes.py `account_step`; 0.0 without the lanes, whose
    # EP wait, all of it exposed, is comm.py's comm_ep_wait_s):
    ep_wait_s: float = 0.0  # time blocked in EP calls and waits, summed over the lanes (lanes.EPLanes records it)
    ep_exposed_s: float = 0.0  # time some EP call was pending and no lane computed (`lanes.exposed_ep_wait`)
    lanes_overlap_s: float = 0.0  # time a forward and a backward ran at once (`lanes.lanes_overlap`)
    ep_waits: list | None = None  # the lanes' raw EP records (lanes.EPLanes.waits: lane, start, end, kind, posted)
    mtp_sum: torch.Tensor | None = None  # sum over microbatches of the weighted MTP loss (model/mtp.py); its stage
    routing: Routing | None = None  # each MoE layer's routing counts per training forward (parallel/step.py drains
    #                                 the model's record into it: model/transformer.py `take_routing`)

    @property
    def bubble(self) -> float:
        """Measured idle fraction of this rank's step."""
        return self.p2p_wait_s / self.wall_s if self.wall_s > 0 else 0.0


def _gpipe(run: StageRunner, comms: StageComms, M: int) -> None:
    for i in range(M):
        out = run.forward(0, i, comms.recv_forward())
        comms.send_forward(out)
    for i in reversed(range(M)):
        grad_in = run.backward(0, i, comms.recv_backward(), is_last=i == 0)
        comms.send_backward(grad_in)


def _one_f_one_b(run: StageRunner, comms: StageComms, M: int, pp: int, pp_rank: int, split: bool = False) -> None:
    """1F1B; with `split`, ZB-H1 (zb1 on the stages after the first): the same F and B (and P2P), each backward
    only B, and each W deferred until pp_rank later B's have run, then run while the B's input gradient is on its
    way (the cooldown's idle time on the early stages)."""
    n_warmup = warmup("1f1b", pp, pp_rank, M)  # forwards in flight before this stage's first gradient can arrive
    steady = M - n_warmup

    def backward(j: int, grad_buf):  # -> (input gradient, the W's now due: run during its send)
        if not split:
            return run.backward(0, j, grad_buf, is_last=j == M - 1), None
        return run.backward_input(j, grad_buf), lambda: run.weights_until(j + 1 - pp_rank)

    # Warmup: forwards only.
    for i in range(n_warmup):
        out = run.forward(0, i, comms.recv_forward())
        comms.send_forward(out)

    # Steady state: forward microbatch n_warmup+j, then backward microbatch j.
    recv_buf = comms.recv_forward() if steady > 0 else None
    for j in range(steady):
        out = run.forward(0, n_warmup + j, recv_buf)
        grad_buf = comms.send_forward_recv_backward(out) if out is not None else None
        out = None  # zb1's B retains the graph for W: no reference here may outlive that W
        grad_in, due = backward(j, grad_buf)
        if j == steady - 1:
            comms.send_backward(grad_in, during=due)  # no further forward to receive
        else:
            recv_buf = comms.send_backward_recv_forward(grad_in, during=due) if grad_in is not None \
                else comms.recv_forward()

    # Cooldown: drain the backwards of the warmup forwards.
    for j in range(steady, M):
        grad_in, due = backward(j, comms.recv_backward())
        comms.send_backward(grad_in, during=due)
    if split:
        run.weights_until(M)  # the last pp_rank W's: nothing left to overlap with


def _interleaved(run: StageRunner, comms: StageComms, M: int, pp: int, pp_rank: int, V: int,
                 forward_only: bool = False) -> None:
    """Megatron-LM's interleaved 1F1B (`forward_backward_pipelining_with_interleaving` with overlap_p2p_comm),
    step for step: the same chunk order, warmup, and send/receive flags, so every exchange on the ring is
    matched by the neighbours' (comms.py exchange / post_exchange). Warmup steps exchange once, blocking;
    steady steps post two exchanges (forward's, then backward's) and cooldown steps one, each waited for just
    before the compute that reads it. forward_only: the warmup loop over every virtual step (evaluation)."""
    total = M * V
    first_rank, last_rank = pp_rank == 0, pp_rank == pp - 1

    def chunk(k: int, forward: bool) -> int:
        return interleaved_chunk(k, pp, V, forward)

    def microbatch(k: int) -> int:  # per chunk, forwards and backwards both take microbatches in order
        return interleaved_microbatch(k, pp, V)

    inputs = [collections.deque() for _ in range(V)]  # received inputs per chunk, FIFO
    grads = [collections.deque() for _ in range(V)]  # received output gradients per chunk, FIFO

    def forward(k: int):
        v = chunk(k, True)
        return run.forward(v, microbatch(k), None if run.first[v] else inputs[v].popleft())

    def backward(k: int):
        v = chunk(k, False)
        return run.backward(v, microbatch(k), None if run.last[v] else grads[v].popleft(), is_last=k == total - 1)

    n_warmup = total if forward_only else warmup("interleaved", pp, pp_rank, M, V)
    all_warmup = n_warmup == total  # no steady phase (M == PP, or evaluation): every forward comes first
    remaining = total - n_warmup

    # Warmup: forwards; the last one also receives the first output gradient.
    if not first_rank:
        inputs[0].append(comms.exchange(None, None, True, False)[0])
    for k in range(n_warmup):
        out = forward(k)
        next_v = chunk(k + 1, True)
        recv_prev = not (first_rank and next_v == 0) and k != total - 1
        recv_next = k == n_warmup - 1 and not all_warmup and not last_rank
        in_buf, grad_buf = comms.exchange(out, None, recv_prev, recv_next)
        if recv_prev:
            inputs[next_v].append(in_buf)
        if recv_next:
            grads[V - 1].append(grad_buf)

    # Steady: forward k + n_warmup, backward k. Megatron's round, split in its two halves and overlapped
    # (overlap_p2p_comm): the forward's send/receive is posted at once and waited for only before the next
    # forward, so it travels while the backward computes, and the backward's likewise. Every op is posted in
    # the same order as the one-batch round (activations, then gradients), so neighbours still match them.
    pending_f = pending_b = None
    for k in range(remaining):
        fk = k + n_warmup
        # What the next forward and backward take: on the first rank the input comes round from the last
        # rank's previous chunk (none for chunk 0), on the last rank the gradient from the first's next chunk.
        if first_rank:
            next_v = chunk(fk - (pp - 1), True)
            recv_prev, next_v = next_v != V - 1, next_v + 1
        else:
            next_v, recv_prev = chunk(fk + 1, True), True
        if last_rank:
            next_b = chunk(k - (pp - 1), False)
            recv_next, next_b = next_b != 0, next_b - 1
        else:
            next_b, recv_next = chunk(k + 1, False), True
        if k == remaining - 1:
            recv_prev = False
        _wait(pending_f)  # this forward's input
        out = forward(fk)
        in_buf, _, pending_f = comms.post_exchange(out, None, recv_prev, False)
        if recv_prev:
            inputs[next_v].append(in_buf)  # read only after pending_f.wait()
        _wait(pending_b)  # this backward's output gradient
        grad_in = backward(k)
        _, grad_buf, pending_b = comms.post_exchange(None, grad_in, False, recv_next)
        if recv_next:
            grads[next_b].append(grad_buf)
    _wait(pending_f)

    if forward_only:
        return
    # Cooldown: the remaining backwards, each one's exchange overlapped with the next backward's wait.
    if all_warmup and not last_rank:
        grads[V - 1].append(comms.exchange(None, None, False, True)[1])
    for k in range(remaining, total):
        _wait(pending_b)
        grad_in = backward(k)
        next_b = chunk(k + 1, False)
        recv_next = not (last_rank and next_b == V - 1) and k != total - 1
        _, grad_buf, pending_b = comms.post_exchange(None, grad_in, False, recv_next)
        if recv_next:
            grads[next_b].append(grad_buf)
    _wait(pending_b)


def _wait(posted) -> None:
    if posted is not None:
        posted.wait()


def stage_chunks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model chunks a rank runs: a StageChunks' chunks, or the one stage model."""
    return list(getattr(model, "chunks", [model]))


def pipeline_forward_backward(
    model: torch.nn.Module,
    dims: ParallelDims,
    xs: list[torch.Tensor],
    ys: list[torch.Tensor],
    *,
    comms: StageComms,
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb1"],
    aux_weight: float,
    loss_scale: float,
    before_backward: Callable[[bool], None] | None,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
    ep_lanes: Lanes | None = None,
    options: RunOptions | None = None,
    docs: list | None = None,
    weights: list[float] | None = None,
) -> StepStats:
    """Run this stage's forwards and backwards of one step, accumulating into the stage's .grad.

    model: the stage (a Transformer), or under the interleaved schedule a StageChunks of V chunks.
    xs: the M token microbatches (m, S) (read on the first stage); ys: the M target microbatches
    (read on the last stage); M = len(xs). `comms` is this stage's P2P endpoints (activation shape
    (m, S, D), dtype, device; the caller keeps it across steps so its buffers are reused).
    before_backward(is_last) is called right before each microbatch's backward (zb1: before each W, where
    the weight gradients accumulate); is_last is True exactly once, for this stage's final one of the step
    (the DP reducer starts its gradient communication then; under interleaved the final backward is chunk
    0's, so the other chunks' buckets are reduced by the reducer's finish()). `autocast()` is entered around
    each microbatch's forward (bf16 mixed precision), never around a backward. Every rank of the step calls
    this.
    ep_lanes (parallel.ep_overlap_microbatches; any schedule): the shard's EP lanes (ep.py `lanes_of`), handed in
    to run the forwards and backwards in two lanes (lanes.py `two_lanes`); the model's MoE layers must have been
    given their backward EP groups (apply_ep(lanes=True)), and with pp > 1 `dims` its backward PP group
    (dims.build_backward_ep_groups). None: one lane.
    options: the benches' knobs (RunOptions: a timeline, the lanes' fill and window).
    docs: per microbatch the document starts of its windows (model/docs.py: model.attn_mask=doc), or None.
    weights: per microbatch the factor on its mean CE (masked targets: parallel/step.py `target_weights`), or None.
    Timings are host wall-clock (on CUDA, kernels still queued at a P2P are charged to the wait).
    """
    options = options or RunOptions()
    M, chunks = len(xs), stage_chunks(model)
    _check_step(dims, M, len(ys), schedule, len(chunks))
    t0 = time.perf_counter()
    comms.reset_wait()
    comms.timeline = options.timeline
    # zb1's first stage sends no input gradient, so nothing waits for its B, and it defers no W (pp_rank 0): each W
    # would follow its B at once. B + W back to back are one plain backward, so it runs 1F1B, without the split.
    split = schedule == "zb1" and dims.pp > 1 and not dims.is_pp_first_stage
    run = _runner(chunks, dims, comms, xs, ys, aux_weight, loss_scale, before_backward, autocast, split, ep_lanes,
                  options, docs, weights)
    try:
        # The lanes' figures (exposed EP wait, F/B overlap) need every EP call's blocked interval; one lane does
        # not: its exposed wait is comm.py's comm_ep_wait_s, and recording would cost every EP call a timer.
        with ep_lanes.recording() if ep_lanes is not None else contextlib.nullcontext() as ep_waits:
            if ep_lanes is not None and M > 1:  # a forward beside a backward, two lanes
                ep_lanes.run_schedule(run, comms, M, dims.pp, dims.pp_rank, split, dims.group("pp_backward"),
                                      options.lanes_window, schedule, len(chunks))
            else:
                _one_lane(run, comms, dims, M, schedule, split, len(chunks))
    finally:
        run.close()
        comms.timeline = None
    assert run.done(), f"microbatches {sorted(run.pending)} never ran their backward"

    wall = time.perf_counter() - t0
    wait = comms.reset_wait()
    figures = ep_lanes.account(run.spans, ep_waits) if ep_lanes is not None else {}
    return StepStats(ce_sum=run.ce_sum, aux_sum=run.aux_sum, wall_s=wall, p2p_wait_s=wait, compute_s=wall - wait,
                     max_in_flight=run.max_in_flight, mtp_sum=run.mtp_sum, **figures)


def _runner(chunks, dims: ParallelDims, comms: StageComms, xs, ys, aux_weight: float, loss_scale: float,
            before_backward, autocast, split: bool, ep_lanes: Lanes | None, options: RunOptions,
            docs: list | None = None, weights: list[float] | None = None) -> StageRunner:
    """The runner type of this step: zb1's split stages defer W (with the lanes' fill: during B's all-to-alls),
    the lanes' fill defers each backward's weight GEMMs into its own all-to-alls, else plain autograd."""
    args = (chunks, *_ends(dims, len(chunks)), comms, xs, ys, aux_weight, loss_scale, before_backward, autocast,
            options.timeline, docs, weights)
    filler = ep_lanes if ep_lanes is not None and options.lanes_fill and len(xs) > 1 else None
    if split:
        return SplitRunner(*args, filler=filler)
    if filler is not None:
        return FillRunner(*args, filler=filler)
    return StageRunner(*args)


def _ends(dims: ParallelDims, V: int) -> tuple[list[bool], list[bool]]:
    """Per chunk: is it the global first (reads tokens: chunk 0 of the first rank) / last (reads the targets:
    chunk V-1 of the last rank)."""
    return ([dims.is_pp_first_stage and v == 0 for v in range(V)],
            [dims.is_pp_last_stage and v == V - 1 for v in range(V)])


def _check_step(dims: ParallelDims, M: int, n_targets: int, schedule: str, V: int) -> None:
    """pipeline_forward_backward's arguments: M microbatches (and as many targets on the last stage), a known
    schedule, and V chunks only under the interleaved one (with M a multiple of PP)."""
    if M < 1:
        raise ValueError("pipeline_forward_backward needs at least one microbatch (--parallel.microbatches)")
    if dims.is_pp_last_stage and n_targets != M:
        raise ValueError(f"got {M} input microbatches but {n_targets} target microbatches")
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.schedule={schedule!r} must be one of {list(SCHEDULES)} (--parallel.schedule)")
    if V > 1 and (schedule != "interleaved" or dims.pp == 1):
        raise ValueError(f"{V} model chunks per rank need parallel.schedule=interleaved with pp > 1")
    if schedule == "interleaved" and dims.pp > 1 and M % dims.pp:
        raise ValueError(f"parallel.schedule=interleaved needs parallel.microbatches={M} to be a multiple of "
                         f"parallel.pp={dims.pp} (--parallel.microbatches)")


def _one_lane(run: StageRunner, comms: StageComms, dims: ParallelDims, M: int, schedule: str, split: bool,
              V: int) -> None:
    """The schedule, one computation at a time."""
    if dims.pp == 1:  # plain gradient accumulation, whatever the schedule
        _one_f_one_b(run, comms, M, 1, 0)
    elif schedule == "gpipe":
        _gpipe(run, comms, M)
    elif schedule in ("1f1b", "zb1"):
        _one_f_one_b(run, comms, M, dims.pp, dims.pp_rank, split=split)
    else:
        _interleaved(run, comms, M, dims.pp, dims.pp_rank, V)


@torch.no_grad()
def pipeline_forward(
    model: torch.nn.Module,
    dims: ParallelDims,
    xs: list[torch.Tensor],
    ys: list[torch.Tensor],
    *,
    comms: StageComms,
    docs: list | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Forward-only pass of M microbatches through the pipeline (evaluation): returns (ce_sum, aux_sum),
    ce_sum the sum of the microbatches' mean CE on the last stage (None elsewhere), aux_sum this stage's
    summed aux losses. Every rank of the PP group calls it with the same M."""
    device = comms.device
    chunks = stage_chunks(model)
    if len(chunks) > 1:  # the interleaved schedule's order, forwards only
        run = StageRunner(chunks, *_ends(dims, len(chunks)), comms, xs, ys, 0.0, 1.0, None, docs=docs)
        run.training = False
        _interleaved(run, comms, len(xs), dims.pp, dims.pp_rank, len(chunks), forward_only=True)
        comms.reset_wait()
        zero = torch.zeros((), device=device)
        return run.ce_sum, run.aux_sum if run.aux_sum is not None else zero
    ce_sum, aux_sum = None, torch.zeros((), device=device)
    for i in range(len(xs)):
        buf = comms.recv_forward()
        inp = xs[i].to(device, non_blocking=True) if dims.is_pp_first_stage else buf.float()  # fp32 residual
        targets = ys[i].to(device, non_blocking=True) if dims.is_pp_last_stage else None
        out, aux = model(inp, targets, docs[i].to(device) if docs and docs[i] is not None else None)
        aux_sum = aux_sum + aux
        if dims.is_pp_last_stage:
            ce_sum = out if ce_sum is None else ce_sum + out
        else:
            comms.send_forward(out)
        comms.release(buf)  # no graph holds it: reuse for the next microbatch
    comms.reset_wait()
    return ce_sum, aux_sum
