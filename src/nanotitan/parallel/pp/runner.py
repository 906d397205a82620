"""The pipeline schedules' runner: forward and backward of one microbatch on one of this rank's chunks, keeping
what the backward needs. A schedule (pp/schedules.py) or the EP lanes (parallel/lanes.py) drive it.

One type per way a backward runs:
- `StageRunner`: plain autograd, F then B (gpipe, 1f1b, interleaved; evaluation with `training` False).
- `FillRunner`: the EP lanes' fill (parallel.ep_overlap_microbatches): each backward defers its weight-gradient
  GEMMs and runs them while its own EP all-to-alls travel, the rest at its end; bitwise plain autograd's.
- `SplitRunner`: zb1's B/W split: B defers every weight gradient, W runs them later (`weights_until`); with a
  filler, the W's due after B(j) run while B(j)'s own all-to-alls travel.
The filler is handed in (the shard's EP lanes, anything with `filling(fn)`), so nothing here knows EP.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, ContextManager, Protocol

import torch

from ...model.wgrad import WeightGradStore, attach
from .comms import StageComms

__all__ = ["Filler", "FillRunner", "SplitRunner", "StageRunner", "run_weights"]

run_weights = WeightGradStore.run  # zb1's W: one microbatch's deferred weight-gradient GEMMs (tests count in it)


class Filler(Protocol):
    """What a deferring runner asks of the shard's EP lanes (parallel/lanes.py EPLanes)."""

    def filling(self, fill: Callable[[], None]) -> ContextManager: ...


class StageRunner:
    """Forward/backward of one microbatch on one of this rank's chunks, keeping what the backward needs."""

    def __init__(self, chunks, first: list[bool], last: list[bool], comms: StageComms, xs, ys, aux_weight: float,
                 loss_scale: float, before_backward: Callable[[bool], None] | None,
                 autocast: Callable[[], ContextManager] = contextlib.nullcontext, timeline: list | None = None,
                 docs: list | None = None, weights: list[float] | None = None):
        self.chunks, self.comms, self.autocast = chunks, comms, autocast
        self.docs = docs  # per microbatch its windows' document starts (model/docs.py) or None; None: all causal
        self.ce_weights = weights  # per microbatch the factor on its mean CE (parallel/step.py `target_weights`)
        # Global first / last chunk: chunk 0 of the first rank reads tokens, chunk V-1 of the last the targets.
        self.first, self.last = first, last
        self.xs, self.ys, self.device = xs, ys, comms.device
        self.aux_weight, self.loss_scale = aux_weight, loss_scale
        self.before_backward = before_backward
        self.timeline = timeline
        self.pending: dict[tuple[int, int], tuple] = {}  # (chunk, microbatch) -> what its backward needs
        self.n_weights = len(xs)
        self.training = True  # False: forwards only (evaluation), nothing kept for a backward
        self.ce_sum = None
        self.aux_sum = None
        self.mtp_sum = None
        self.max_in_flight = 0
        self.spans: list[tuple[str, float, float]] = []  # ("F"/"B"/"W", start, end) of every computation

    def close(self) -> None:
        """The end of the step: nothing to undo for plain autograd."""

    def done(self) -> bool:
        """Every microbatch forwarded has run its backward."""
        return not self.pending

    def _event(self, kind: str, v: int, i: int, t0: float) -> None:
        t1 = time.perf_counter()
        self.spans.append((kind, t0, t1))  # list.append: atomic across the two lanes
        if self.timeline is not None:
            self.timeline.append((kind, v, i, t0, t1))

    def in_flight(self) -> int:
        return len(self.pending)

    def forward(self, v: int, i: int, recv_buf: torch.Tensor | None) -> torch.Tensor | None:
        """Run microbatch i through chunk v; returns the activation to send on (None on the last chunk)."""
        t0 = time.perf_counter()
        first, last = self.first[v], self.last[v]
        if first:
            inp = self.xs[i].to(self.device, non_blocking=True)
        else:
            # A leaf on the pooled buffer: its .grad goes back. A bf16 wire is widened to fp32 (a copy) so the
            # residual stream stays fp32 as in one process; the gradient is narrowed again when sent back.
            inp = recv_buf.detach().float().requires_grad_(self.training)
        targets = self.ys[i].to(self.device, non_blocking=True) if last else None
        docs = self.docs[i].to(self.device, non_blocking=True) if self.docs and self.docs[i] is not None else None
        with self.autocast():  # mixed precision for the forward only; backward runs outside it
            out, aux, *mtp = self.chunks[v](inp, targets, docs)  # mtp: [its weighted loss] where the MTP modules run
        self.aux_sum = aux.detach() if self.aux_sum is None else self.aux_sum + aux.detach()
        # aux is a constant zero when the chunk has no MoE layer: nothing to backpropagate.
        aux_term = self.loss_scale * self.aux_weight * aux if aux.requires_grad and self.aux_weight else None
        if not self.training:
            if last:
                self.ce_sum = out if self.ce_sum is None else self.ce_sum + out
            self.comms.release(recv_buf)  # no graph holds it
            self._event("F", v, i, t0)
            return None if last else out
        if last:
            out = out if self.ce_weights is None else out * self.ce_weights[i]  # masked targets: the global count's
            self.ce_sum = out.detach() if self.ce_sum is None else self.ce_sum + out.detach()
            if mtp:  # multi-token prediction (model/mtp.py): a term of the last chunk's objective, summed like ce
                self.mtp_sum = mtp[0].detach() if self.mtp_sum is None else self.mtp_sum + mtp[0].detach()
                out = out + mtp[0]
            loss = self.loss_scale * out if aux_term is None else self.loss_scale * out + aux_term
            state, send = (recv_buf, inp, [loss], [None]), None
        else:
            outs, grads = ([out], [None]) if aux_term is None else ([out, aux_term], [None, None])
            state, send = (recv_buf, inp, outs, grads), out
        self.pending[v, i] = state
        self.max_in_flight = max(self.max_in_flight, self.in_flight())
        self._event("F", v, i, t0)
        return send

    def _take(self, v: int, i: int, grad_buf: torch.Tensor | None):
        recv_buf, inp, outs, grads = self.pending.pop((v, i))
        if not self.last[v]:
            grads[0] = grad_buf.to(outs[0].dtype)
        return recv_buf, inp, outs, grads

    def _autograd(self, outs: list, grads: list) -> None:
        torch.autograd.backward(outs, grads)

    def backward(self, v: int, i: int, grad_buf: torch.Tensor | None, is_last: bool) -> torch.Tensor | None:
        """Backward of microbatch i through chunk v given its output gradient; returns the input gradient to send."""
        t0 = time.perf_counter()
        recv_buf, inp, outs, grads = self._take(v, i, grad_buf)
        if self.before_backward is not None:
            self.before_backward(is_last)
        self._autograd(outs, grads)
        grad_in = None if self.first[v] else inp.grad
        # The graph is freed, so nothing reads these buffers any more: reuse them.
        self.comms.release(recv_buf)
        self.comms.release(grad_buf)
        self._event("B", v, i, t0)
        return grad_in


class _DeferringRunner(StageRunner):
    """A runner whose backwards defer weight-gradient GEMMs into a WeightGradStore (model/wgrad.py), attached to
    the chunks for this step only, so every other schedule (and evaluation) runs plain autograd."""

    def __init__(self, *args, filler: Filler | None, fuse: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.filler = filler
        self.store = WeightGradStore(fuse=fuse)
        for chunk in self.chunks:
            attach(chunk, self.store)

    def close(self) -> None:
        for chunk in self.chunks:
            attach(chunk, None)


class FillRunner(_DeferringRunner):
    """The EP lanes' fill: each backward defers its weight-gradient GEMMs and runs them while its own EP all-to-alls
    travel (the filler's `filling`), the rest at its end: every term still lands within the same backward, in the
    order produced, and stays bitwise plain autograd's (no fusing), as its twin-without-lanes tests require."""

    def __init__(self, *args, filler: Filler, **kwargs):
        super().__init__(*args, filler=filler, fuse=False, **kwargs)

    def _autograd(self, outs: list, grads: list) -> None:
        with self.store.deferring(), self.filler.filling(self._drain):
            torch.autograd.backward(outs, grads)
        self._drain()  # what no all-to-all was left to hide (the blocks below the first MoE layer's dispatch)

    def _drain(self) -> None:
        """Run the weight-gradient GEMMs deferred so far, in the order their backward produced them."""
        run_weights(self.store.take())


class SplitRunner(_DeferringRunner):
    """zb1's split stages: each backward is B (`backward_input`), its weight gradients W wait in self.weights until
    `weights_until`. W's GEMMs accumulate straight into .grad (wgrad.GemmTerm: equal up to reassociation). With a
    filler (the EP lanes), the W's due after B(j) run while B(j)'s own all-to-alls travel (`backward_input(due=)`)
    instead of only during its send."""

    def __init__(self, *args, filler: Filler | None = None, **kwargs):
        super().__init__(*args, filler=filler, fuse=True, **kwargs)
        self.weights: dict[int, tuple] = {}  # microbatch -> (its deferred W, the P2P buffers W may read)
        self.w_done = 0  # W's run so far (in microbatch order)

    def done(self) -> bool:
        return not self.pending and not self.weights

    def in_flight(self) -> int:
        return len(self.pending) + len(self.weights)

    def backward_input(self, i: int, grad_buf: torch.Tensor | None, due: int = 0) -> torch.Tensor | None:
        """zb1's B of microbatch i (one chunk): one autograd backward that computes the input gradient and defers
        every weight-gradient GEMM (and every other parameter's gradient) into the store; its W waits in
        self.weights. No .grad changes, so the gradient syncs see nothing until W.
        due (with a filler): the W's of microbatches before `due` are due after this B; each of its EP all-to-alls
        runs the next of them while it travels. W's still run one whole W at a time, in microbatch order, and B's
        own terms stay queued in the store: every .grad sees the same terms in the same order."""
        t0 = time.perf_counter()
        recv_buf, inp, outs, grads = self._take(0, i, grad_buf)
        fill = self.filler is not None and self.w_done < min(due, self.n_weights)
        with self.store.deferring(), self.filler.filling(lambda: self.weights_until(min(self.w_done + 1, due))) \
                if fill else contextlib.nullcontext():
            torch.autograd.backward(outs, grads)
        # The received input and output gradient stay until W: a deferred GEMM may read either (the received
        # activation is the first norm's input; the output gradient passes the residual adds unchanged).
        self.weights[i] = (self.store.take(), [recv_buf, grad_buf])
        self._event("B", 0, i, t0)
        return None if self.first[0] else inp.grad

    def weights_until(self, n: int) -> None:
        """zb1: run the deferred W's of microbatches w_done .. n-1, in order."""
        while self.w_done < min(n, self.n_weights):
            i, t0 = self.w_done, time.perf_counter()
            work, buffers = self.weights.pop(i)
            if self.before_backward is not None:
                self.before_backward(i == self.n_weights - 1)  # the final W delivers every param's last term
            run_weights(work)  # each term lands through its gradient sync's sink (dp.py, zero.py): ready counted
            for buf in buffers:
                self.comms.release(buf)
            self.w_done += 1
            self._event("W", 0, i, t0)
