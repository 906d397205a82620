"""Pipeline parallelism: one training step's forwards and backwards over M microbatches (GPipe or 1F1B).

Each rank holds one stage (`Transformer(cfg.model, build_shard_spec(cfg, pp_rank, ep_rank), seed)`):
stage 0 takes token microbatches `(m, S)`, later stages receive hidden states `(m, S, D)` from the
previous stage and send the gradient of that input back (pp_comms.py). The last stage computes the
loss. Per microbatch, the objective a stage backpropagates is

    last stage:   loss_scale * (ce + aux_weight * aux_sum)
    other stages: loss_scale * aux_weight * aux_sum   +   <received output gradient, output>

so every stage's own MoE balance loss is part of its backward (the trainer passes
loss_scale = 1/M and aux_weight = aux_coef / n_moe_layers_total, DESIGN §4). Summed over stages this
is exactly the single-process gradient of  sum_i loss_scale * (ce_i + aux_weight * aux_i).

Schedules (seed "GPipe Schedule" / "1F1B schedule"; Narayanan et al. 2021, Megatron-LM's
`forward_backward_pipelining_without_interleaving`):
- gpipe: all M forwards, then all M backwards in reverse order; holds M microbatches' activations.
- 1f1b:  stage p runs `warmup = min(PP - p - 1, M)` forwards, then alternates one forward / one
         backward (M - warmup times; the output send and the gradient receive are one paired P2P),
         then drains the remaining `warmup` backwards. Holds at most PP - p microbatches' activations.
         (The seed's sketch warms up PP - p forwards, which starts the steady phase one microbatch late
         and needs special cases at its boundaries; Megatron's count makes every phase a plain loop and
         is correct for any M >= 1, including M < PP.)
With pp == 1 both reduce to plain gradient accumulation (forward, backward, next microbatch).

Order is a pure function of (schedule, PP, pp_rank, M), so the ranks of one EP group (same pp_rank)
run their microbatches in the same order and their all-to-alls pair up.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Literal

import torch

from .dims import ParallelDims
from .pp_comms import StageComms


@dataclass
class StepStats:
    """What one step of `pipeline_forward_backward` measured on this rank."""
    ce_sum: torch.Tensor | None  # sum over microbatches of mean CE (detached); last stage only, else None
    aux_sum: torch.Tensor  # sum over microbatches of this stage's MoE aux losses (detached, unweighted)
    wall_s: float  # the whole call
    p2p_wait_s: float  # time blocked in pipeline send/recv (idle: the bubble, plus transfer time)
    compute_s: float  # wall_s - p2p_wait_s: forwards, backwards (incl. EP all-to-alls), bookkeeping
    max_in_flight: int  # most microbatches whose activations this stage held at once (GPipe M, 1F1B PP - p)

    @property
    def bubble(self) -> float:
        """Measured idle fraction of this rank's step."""
        return self.p2p_wait_s / self.wall_s if self.wall_s > 0 else 0.0


def theoretical_bubble(pp: int, num_microbatches: int) -> float:
    """Idle fraction of a GPipe/1F1B pipeline with equal stages and free communication: (PP-1)/(M+PP-1)."""
    return (pp - 1) / (num_microbatches + pp - 1)


class _StageRunner:
    """Forward/backward of one microbatch on this stage, keeping what the backward needs."""

    def __init__(self, model, dims, comms, xs, ys, aux_weight, loss_scale, before_backward, device, autocast):
        self.model, self.comms, self.autocast = model, comms, autocast
        self.first, self.last = dims.is_pp_first_stage, dims.is_pp_last_stage
        self.xs, self.ys, self.device = xs, ys, device
        self.aux_weight, self.loss_scale = aux_weight, loss_scale
        self.before_backward = before_backward
        self.pending: dict[int, tuple] = {}  # microbatch -> (recv buffer, input leaf, objective tensors)
        self.ce_sum = None
        self.aux_sum = None
        self.max_in_flight = 0

    def forward(self, i: int, recv_buf: torch.Tensor | None) -> torch.Tensor | None:
        """Run microbatch i; returns the activation to send on (None on the last stage)."""
        if self.first:
            inp = self.xs[i].to(self.device, non_blocking=True)
        else:
            # A leaf on the pooled buffer: its .grad goes back. A bf16 wire is widened to fp32 (a copy) so the
            # residual stream stays fp32 as in one process; the gradient is narrowed again when sent back.
            inp = recv_buf.detach().float().requires_grad_()
        targets = self.ys[i].to(self.device, non_blocking=True) if self.last else None
        with self.autocast():  # mixed precision for the forward only; backward runs outside it
            out, aux = self.model(inp, targets)
        self.aux_sum = aux.detach() if self.aux_sum is None else self.aux_sum + aux.detach()
        # aux is a constant zero when the stage has no MoE layer: nothing to backpropagate.
        aux_term = self.loss_scale * self.aux_weight * aux if aux.requires_grad and self.aux_weight else None
        if self.last:
            self.ce_sum = out.detach() if self.ce_sum is None else self.ce_sum + out.detach()
            loss = self.loss_scale * out if aux_term is None else self.loss_scale * out + aux_term
            self._hold(i, (recv_buf, inp, [loss], [None]))
            return None
        outs, grads = ([out], [None]) if aux_term is None else ([out, aux_term], [None, None])
        self._hold(i, (recv_buf, inp, outs, grads))
        return out

    def _hold(self, i: int, state: tuple) -> None:
        self.pending[i] = state
        self.max_in_flight = max(self.max_in_flight, len(self.pending))

    def backward(self, i: int, grad_buf: torch.Tensor | None, is_last: bool) -> torch.Tensor | None:
        """Backward of microbatch i given the gradient of its output; returns the input gradient to send back."""
        recv_buf, inp, outs, grads = self.pending.pop(i)
        if not self.last:
            grads[0] = grad_buf.to(outs[0].dtype)
        if self.before_backward is not None:
            self.before_backward(is_last)
        torch.autograd.backward(outs, grads)
        grad_in = None if self.first else inp.grad
        # The graph is freed, so nothing reads these buffers any more: reuse them.
        self.comms.release(recv_buf)
        self.comms.release(grad_buf)
        return grad_in


def _gpipe(run: _StageRunner, comms: StageComms, M: int) -> None:
    for i in range(M):
        out = run.forward(i, comms.recv_forward())
        comms.send_forward(out)
    for i in reversed(range(M)):
        grad_in = run.backward(i, comms.recv_backward(), is_last=i == 0)
        comms.send_backward(grad_in)


def _one_f_one_b(run: _StageRunner, comms: StageComms, M: int, pp: int, pp_rank: int) -> None:
    warmup = min(pp - pp_rank - 1, M)  # forwards in flight before this stage's first gradient can arrive
    steady = M - warmup

    # Warmup: forwards only.
    for i in range(warmup):
        out = run.forward(i, comms.recv_forward())
        comms.send_forward(out)

    # Steady state: forward microbatch warmup+j, then backward microbatch j.
    recv_buf = comms.recv_forward() if steady > 0 else None
    for j in range(steady):
        out = run.forward(warmup + j, recv_buf)
        grad_buf = comms.send_forward_recv_backward(out) if out is not None else None
        grad_in = run.backward(j, grad_buf, is_last=j == M - 1)
        if j == steady - 1:
            comms.send_backward(grad_in)  # no further forward to receive
        else:
            recv_buf = comms.send_backward_recv_forward(grad_in) if grad_in is not None else comms.recv_forward()

    # Cooldown: drain the backwards of the warmup forwards.
    for j in range(steady, M):
        grad_in = run.backward(j, comms.recv_backward(), is_last=j == M - 1)
        comms.send_backward(grad_in)


def pipeline_forward_backward(
    model: torch.nn.Module,
    dims: ParallelDims,
    xs: list[torch.Tensor],
    ys: list[torch.Tensor],
    *,
    comms: StageComms,
    schedule: Literal["gpipe", "1f1b"],
    aux_weight: float,
    loss_scale: float,
    before_backward: Callable[[bool], None] | None,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
) -> StepStats:
    """Run this stage's forwards and backwards of one step, accumulating into the stage's .grad.

    xs: the M token microbatches (m, S) (read on the first stage); ys: the M target microbatches
    (read on the last stage); M = len(xs). `comms` is this stage's P2P endpoints (activation shape
    (m, S, D), dtype, device; the caller keeps it across steps so its buffers are reused).
    before_backward(is_last) is called right before each microbatch's backward; is_last is True
    exactly once, for this stage's final backward of the step (the DP reducer starts its gradient
    communication then). `autocast()` is entered around each microbatch's forward (bf16 mixed precision),
    never around a backward. Every rank of the step calls this.
    Timings are host wall-clock (on CUDA, kernels still queued at a P2P are charged to the wait).
    """
    M = len(xs)
    if M < 1:
        raise ValueError("pipeline_forward_backward needs at least one microbatch (--parallel.microbatches)")
    if dims.is_pp_last_stage and len(ys) != M:
        raise ValueError(f"got {len(xs)} input microbatches but {len(ys)} target microbatches")
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"parallel.schedule={schedule!r} must be 'gpipe' or '1f1b' (--parallel.schedule)")

    t0 = time.perf_counter()
    comms.reset_wait()
    run = _StageRunner(model, dims, comms, xs, ys, aux_weight, loss_scale, before_backward, comms.device, autocast)
    if schedule == "gpipe" and dims.pp > 1:
        _gpipe(run, comms, M)
    else:  # 1f1b; with pp == 1 it is plain gradient accumulation, whatever the schedule
        _one_f_one_b(run, comms, M, dims.pp, dims.pp_rank)
    assert not run.pending, f"microbatches {sorted(run.pending)} never ran their backward"

    wall = time.perf_counter() - t0
    wait = comms.reset_wait()
    return StepStats(ce_sum=run.ce_sum, aux_sum=run.aux_sum, wall_s=wall, p2p_wait_s=wait, compute_s=wall - wait, max_in_flight=run.max_in_flight)


@torch.no_grad()
def pipeline_forward(
    model: torch.nn.Module,
    dims: ParallelDims,
    xs: list[torch.Tensor],
    ys: list[torch.Tensor],
    *,
    comms: StageComms,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Forward-only pass of M microbatches through the pipeline (evaluation): returns (ce_sum, aux_sum),
    ce_sum the sum of the microbatches' mean CE on the last stage (None elsewhere), aux_sum this stage's
    summed aux losses. Every rank of the PP group calls it with the same M."""
    device = comms.device
    ce_sum, aux_sum = None, torch.zeros((), device=device)
    for i in range(len(xs)):
        buf = comms.recv_forward()
        inp = xs[i].to(device, non_blocking=True) if dims.is_pp_first_stage else buf.float()  # fp32 residual
        targets = ys[i].to(device, non_blocking=True) if dims.is_pp_last_stage else None
        out, aux = model(inp, targets)
        aux_sum = aux_sum + aux
        if dims.is_pp_last_stage:
            ce_sum = out if ce_sum is None else ce_sum + out
        else:
            comms.send_forward(out)
        comms.release(buf)  # no graph holds it: reuse for the next microbatch
    comms.reset_wait()
    return ce_sum, aux_sum
