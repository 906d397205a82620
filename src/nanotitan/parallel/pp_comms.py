"""Point-to-point traffic between neighbouring pipeline stages: activations forward, their gradients back.

Every message is one `[m, S, D]` tensor (DESIGN, seed "Communications across ranks") in the compute dtype:
under bf16 mixed precision the sender narrows the fp32 activation (or gradient) to bf16, half the bytes,
and the receiving stage widens it again (pp.py). The receiver must
own a buffer of that shape and dtype before the message arrives; `StageComms` keeps a pool of them so
a step allocates only as many as are in flight at once (GPipe: M inputs, 1F1B: at most PP - p), and
reuses them across microbatches and steps.

All traffic goes through `nanotitan.parallel.comm` on axis "pp", which records calls, bytes and the
time the calling thread spent blocked. `StageComms.wait_s` additionally accumulates that blocked time
for the schedule's own bubble measurement.

Neighbours are GLOBAL ranks (`ParallelDims.prev_pp_rank/next_pp_rank`), the group is this rank's PP
group; torch's P2P API takes global ranks together with the group.
The paired calls (`send_forward_recv_backward`, `send_backward_recv_forward`) issue both directions in
one `batch_isend_irecv`, so two neighbours that both send before they receive cannot deadlock.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from . import comm
from .dims import ParallelDims


class StageComms:
    """This stage's P2P endpoints. On the first stage the `*_backward` sends and `*_forward` receives
    are no-ops (return None); on the last stage likewise for `*_forward` sends and `*_backward` receives,
    so a schedule can call them unconditionally."""

    def __init__(self, dims: ParallelDims, act_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.prev, self.next = dims.prev_pp_rank, dims.next_pp_rank
        self.group = dims.group("pp")
        self.act_shape, self.dtype, self.device = tuple(act_shape), dtype, torch.device(device)
        self._free: list[torch.Tensor] = []  # receive buffers not holding a live message
        self.wait_s = 0.0  # blocked time since the last `reset_wait()`

    # --- receive buffers -------------------------------------------------------------------------
    def acquire(self) -> torch.Tensor:
        """A receive buffer of act_shape/dtype, reused when one is free."""
        return self._free.pop() if self._free else torch.empty(self.act_shape, dtype=self.dtype, device=self.device)

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
        self.wait_s += time.perf_counter() - t0
        return out

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

    def send_backward(self, grad_in: torch.Tensor) -> None:
        if self.prev is not None:
            self._timed(comm.send, self._check(grad_in, "send_backward"), self.prev, self.group)

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

    def send_backward_recv_forward(self, grad_in: torch.Tensor) -> torch.Tensor | None:
        """Send an input gradient to the previous stage and receive the next microbatch's input."""
        if self.prev is None:
            return None
        buf = self.acquire()
        ops = [dist.P2POp(dist.isend, self._check(grad_in, "send_backward"), self.prev, self.group),
               dist.P2POp(dist.irecv, buf, self.prev, self.group)]
        self._timed(comm.batch_isend_irecv, ops)
        return buf
