"""One thin layer for every collective and P2P, recording calls, bytes and wait time per axis.

Axes: "dp" (gradient all-reduce), "ep" (token all-to-all), "pp" (activation send/recv),
"other" (broadcasts, norms, metrics). Wait time is the wall time the calling thread spent blocked:
the whole call for blocking ops, the `wait()` for async ones. `COMM.snapshot_and_reset()` gives the
per-step figures that go to metrics.jsonl.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.profiler import record_function

AXES = ("dp", "ep", "pp", "other")


class CommStats:
    def __init__(self):
        self.reset()

    def reset(self):
        self.calls = defaultdict(int)
        self.bytes = defaultdict(int)
        self.wait_s = defaultdict(float)

    def record(self, axis: str, nbytes: int, wait_s: float, calls: int = 1):
        self.calls[axis] += calls
        self.bytes[axis] += nbytes
        self.wait_s[axis] += wait_s

    def snapshot_and_reset(self) -> dict:
        out = {}
        for a in AXES:
            out[f"comm_{a}_calls"] = self.calls[a]
            out[f"comm_{a}_bytes"] = self.bytes[a]
            out[f"comm_{a}_wait_s"] = round(self.wait_s[a], 6)
        self.reset()
        return out


COMM = CommStats()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _label(axis: str, op: str) -> record_function:
    """Names the call in profiler traces by axis, e.g. "EP all-to-all" (profiling.py sums time per label)."""
    return record_function(f"{axis.upper()} {op}")


class TimedWork:
    """Wraps an async Work so that its wait() is charged to an axis."""

    def __init__(self, work, axis: str):
        self.work, self.axis = work, axis

    def wait(self):
        t0 = time.perf_counter()
        with _label(self.axis, "wait"):
            self.work.wait()
        COMM.record(self.axis, 0, time.perf_counter() - t0, calls=0)


def all_reduce(t: torch.Tensor, group=None, axis: str = "dp", op=dist.ReduceOp.SUM, async_op: bool = False):
    t0 = time.perf_counter()
    with _label(axis, "all-reduce"):
        work = dist.all_reduce(t, op=op, group=group, async_op=async_op)
    COMM.record(axis, _nbytes(t), time.perf_counter() - t0)
    return TimedWork(work, axis) if async_op else None


def broadcast(t: torch.Tensor, src: int, group=None, axis: str = "other"):
    t0 = time.perf_counter()
    with _label(axis, "broadcast"):
        dist.broadcast(t, src=src, group=group)
    COMM.record(axis, _nbytes(t), time.perf_counter() - t0)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None, group=None,
                      axis: str = "ep"):
    t0 = time.perf_counter()
    with _label(axis, "all-to-all"):
        dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=group)
    COMM.record(axis, _nbytes(inp), time.perf_counter() - t0)


def send(t: torch.Tensor, dst: int, group=None, axis: str = "pp"):
    t0 = time.perf_counter()
    with _label(axis, "send"):
        dist.send(t.contiguous(), dst=dst, group=group)
    COMM.record(axis, _nbytes(t), time.perf_counter() - t0)


def recv(t: torch.Tensor, src: int, group=None, axis: str = "pp"):
    t0 = time.perf_counter()
    with _label(axis, "recv"):
        dist.recv(t, src=src, group=group)
    COMM.record(axis, _nbytes(t), time.perf_counter() - t0)


def batch_isend_irecv(ops: list, axis: str = "pp"):
    """Issue paired P2P ops together and wait for all of them (no blocking pair can deadlock)."""
    t0 = time.perf_counter()
    with _label(axis, "send/recv"):
        works = dist.batch_isend_irecv(ops)
        for w in works:
            w.wait()
    COMM.record(axis, sum(_nbytes(op.tensor) for op in ops), time.perf_counter() - t0, calls=len(ops))
