"""Point-to-point traffic between neighbouring pipeline stages: activations forward, their gradients back.

Every message is one `[m, S, D]` tensor (docs/design.md) in the compute dtype:
under bf16 mixed precision the sender narrows the fp32 activation (or gradient) to bf16, half the bytes,
and the receiving stage widens it again (schedules.py). The receiver must
own a buffer of that shape and dtype before the message arrives; `StageComms` keeps a pool of them so
a step allocates only as many as it holds at once (an input per microbatch in flight, `pp.in_flight`, plus
the output gradients not yet backpropagated; zb1 keeps both until W), and reuses them across microbatches
and steps.

All traffic goes through `nanotitan.parallel.comm.collectives` on axis "pp" (blocking calls, and the interleaved
schedule's posted ones alike), which records calls, bytes and the time the calling thread spent blocked,
labels each call for the profiler and enters it in the stall record. `StageComms.wait_s` additionally
accumulates that blocked time for the schedule's own bubble measurement.

Neighbours are GLOBAL ranks (`ParallelDims.prev_pp_rank/next_pp_rank`), the group is this rank's PP
group; torch's P2P API takes global ranks together with the group.
The paired calls (`send_forward_recv_backward`, `send_backward_recv_forward`) issue both directions in
one `batch_isend_irecv`, so two neighbours that both send before they receive cannot deadlock.

The interleaved schedule runs on a ring (`exchange`, `post_exchange`): the last rank's chunk v feeds the first rank's
chunk v+1, so the first rank receives activations from, and sends gradients to, the last. With PP=2 both neighbours are
the same rank; every rank lists its ops activations first, then gradients, so each direction's messages are
matched in the same order at both ends (NCCL matches point-to-point messages between two ranks by order).
zb1 passes `during`: local work (deferred weight gradients) that runs while a send is in flight, so the
wait it would otherwise spend blocked is spent computing; only the time blocked counts as wait.

parallel.ep_overlap_microbatches (two lanes, lanes.py `two_lanes`, any schedule) uses `post_exchange` from two
threads, each lane one direction: the forward lane its activations on the PP group, the backward lane its
gradients on the backward PP group (`group=`, dims.py "pp_backward"), so each group carries one lane's messages
between two ranks, in order at both ends. Shared between the lanes: the buffer pool (atomic pops and
appends) and `wait_s` (summed over both lanes, an unlocked `+=`: a lost update is possible and only a statistic).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from ..comm import collectives as comm
from ..dims import ParallelDims


class StageComms:
    """This stage's P2P endpoints. On the first stage the `*_backward` sends and `*_forward` receives
    are no-ops (return None); on the last stage likewise for `*_forward` sends and `*_backward` receives,
    so a schedule can call them unconditionally."""

    def __init__(self, dims: ParallelDims, act_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.prev, self.next = dims.prev_pp_rank, dims.next_pp_rank
        d, p, e = dims.coords()  # the ring of the interleaved schedule: last -> first for the next chunk
        self.ring_prev = dims.rank_of(d, (p - 1) % dims.pp, e) if dims.pp > 1 else None
        self.ring_next = dims.rank_of(d, (p + 1) % dims.pp, e) if dims.pp > 1 else None
        self.group = dims.group("pp")
        self.act_shape, self.dtype, self.device = tuple(act_shape), dtype, torch.device(device)
        self._free: list[torch.Tensor] = []  # receive buffers not holding a live message
        self.wait_s = 0.0  # blocked time since the last `reset_wait()`
        self.timeline: list | None = None  # when a list: ("wait", -1, -1, start, end) per blocked interval

    # --- receive buffers -------------------------------------------------------------------------
    def acquire(self) -> torch.Tensor:
        """A receive buffer of act_shape/dtype, reused when one is free. Both lanes of
        parallel.ep_overlap_microbatches take buffers: list.pop is atomic, a test-then-pop would not be."""
        try:
            return self._free.pop()
        except IndexError:
            return torch.empty(self.act_shape, dtype=self.dtype, device=self.device)

    def release(self, buf: torch.Tensor | None) -> None:
        """Give a buffer back once nothing reads it any more (its microbatch's backward has run)."""
        if buf is not None:
            self._free.append(buf)

    def reset_wait(self) -> float:
        w, self.wait_s = self.wait_s, 0.0
        return w

    def _check(self, t: torch.Tensor, what: str) -> torch.Tensor:
        # A wrong shape/dtype would make the receiver read garbage or hang: fail loudly on the sender.
        assert tuple(t.shape) == self.act_shape, f"{what}: shape {tuple(t.shape)} != act_shape {self.act_shape}"
        return t.detach().to(self.dtype).contiguous()

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        self._waited(t0, time.perf_counter())
        return out

    def _waited(self, t0: float, t1: float) -> None:
        self.wait_s += t1 - t0
        if self.timeline is not None:
            self.timeline.append(("wait", -1, -1, t0, t1))

    # --- one direction -------------------------------------------------------------------------
    def send_forward(self, out: torch.Tensor) -> None:
        if self.next is not None:
            self._timed(comm.send, self._check(out, "send_forward"), self.next, self.group)

    def recv_forward(self) -> torch.Tensor | None:
        if self.prev is None:
            return None
        buf = self.acquire()
        self._timed(comm.recv, buf, self.prev, self.group)
        return buf

    def send_backward(self, grad_in: torch.Tensor, during: Callable[[], None] | None = None) -> None:
        if self.prev is not None:
            ops = [dist.P2POp(dist.isend, self._check(grad_in, "send_backward"), self.prev, self.group)]
            self._batch(ops, during)
        elif during is not None:
            during()

    def recv_backward(self) -> torch.Tensor | None:
        if self.next is None:
            return None
        buf = self.acquire()
        self._timed(comm.recv, buf, self.next, self.group)
        return buf

    # --- both directions at once (steady 1F1B) ---------------------------------------------------
    def send_forward_recv_backward(self, out: torch.Tensor) -> torch.Tensor | None:
        """Send this microbatch's output to the next stage and receive the gradient of an earlier one."""
        if self.next is None:
            return None
        buf = self.acquire()
        ops = [dist.P2POp(dist.isend, self._check(out, "send_forward"), self.next, self.group),
               dist.P2POp(dist.irecv, buf, self.next, self.group)]
        self._timed(comm.batch_isend_irecv, ops)
        return buf

    def send_backward_recv_forward(self, grad_in: torch.Tensor,
                                   during: Callable[[], None] | None = None) -> torch.Tensor | None:
        """Send an input gradient to the previous stage and receive the next microbatch's input."""
        if self.prev is None:
            if during is not None:
                during()
            return None
        buf = self.acquire()
        ops = [dist.P2POp(dist.isend, self._check(grad_in, "send_backward"), self.prev, self.group),
               dist.P2POp(dist.irecv, buf, self.prev, self.group)]
        self._batch(ops, during)
        return buf

    # --- the ring of the interleaved schedule ----------------------------------------------------
    def exchange(self, out: torch.Tensor | None, grad_in: torch.Tensor | None, recv_forward: bool,
                 recv_backward: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One exchange on the ring of the interleaved schedule, in one batch, waited for: send `out` to the next
        rank and `grad_in` to the previous one (None: nothing to send), receive an input from the previous rank
        and an output gradient from the next (when asked). Returns (input buffer, gradient buffer), None where
        nothing was received."""
        ops, in_buf, grad_buf = self._exchange_ops(out, grad_in, recv_forward, recv_backward)
        if ops:
            self._batch(ops)
        return in_buf, grad_buf

    def _exchange_ops(self, out, grad_in, recv_forward: bool, recv_backward: bool,
                      group=None) -> tuple[list, object, object]:
        """The P2P ops of one interleaved round (activations first, then gradients) and the receive buffers."""
        ops, in_buf, grad_buf = [], None, None
        group = self.group if group is None else group
        if out is not None:
            ops.append(dist.P2POp(dist.isend, self._check(out, "send_forward"), self.ring_next, group))
        if recv_forward:
            in_buf = self.acquire()
            ops.append(dist.P2POp(dist.irecv, in_buf, self.ring_prev, group))
        if grad_in is not None:
            ops.append(dist.P2POp(dist.isend, self._check(grad_in, "send_backward"), self.ring_prev, group))
        if recv_backward:
            grad_buf = self.acquire()
            ops.append(dist.P2POp(dist.irecv, grad_buf, self.ring_next, group))
        return ops, in_buf, grad_buf

    def post_exchange(self, out: torch.Tensor | None, grad_in: torch.Tensor | None, recv_forward: bool,
                      recv_backward: bool, group=None) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                                               _Posted | None]:
        """`exchange` without its wait: the ops are posted, and the returned handle's `wait()` (before anything
        reads the received buffers) completes them. The interleaved schedule overlaps each round's traffic with
        its next compute this way (Megatron's overlap_p2p_comm); the lanes of parallel.ep_overlap_microbatches
        post each lane's send with its next receive (lanes.py `two_lanes`; `group`: the backward lane's PP group).
        On a ring's neighbours (interleaved) and a line's alike: the first stage never receives an activation nor
        sends a gradient, the last never sends an activation nor receives a gradient, unless it holds a chunk
        that does (interleaved)."""
        ops, in_buf, grad_buf = self._exchange_ops(out, grad_in, recv_forward, recv_backward, group)
        return in_buf, grad_buf, (self._post(ops) if ops else None)

    def _batch(self, ops: list, during: Callable[[], None] | None = None) -> None:
        """Issue ops together and wait for all; `during()` runs while they are in flight (its time is not wait)."""
        if during is None:
            self._timed(comm.batch_isend_irecv, ops)
            return
        posted = self._post(ops)
        during()
        posted.wait()

    def _post(self, ops: list) -> _Posted:
        """comm.batch_isend_irecv without its wait: post now, `wait()` later (charged to axis pp)."""
        t0 = time.perf_counter()
        work = comm.batch_isend_irecv(ops, async_op=True)
        self._waited(t0, time.perf_counter())
        return _Posted(self, work, [op.tensor for op in ops])


class _Posted:
    """Posted P2P ops: `wait()` completes them, counting the blocked time as this stage's wait. Holds the
    tensors until then (a send's source must outlive it)."""

    def __init__(self, comms: StageComms, work: comm.TimedWork, tensors: list[torch.Tensor]):
        self.comms, self.work, self.tensors = comms, work, tensors

    def wait(self) -> None:
        t0 = time.perf_counter()
        self.work.wait()
        self.comms._waited(t0, time.perf_counter())
        self.work, self.tensors = None, []
