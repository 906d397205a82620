"""The step's host reads (`host_syncs` in metrics.jsonl): every place where the host waits for a value the device
computed, so a GPU's stream would stall and a CUDA graph could not hold the step.

Counted (`HostSyncs`, a TorchFunctionMode around the step proper: forwards, backwards, gradient sync, clip, the
finiteness verdict, the update):
  - a read of a device value into Python: `.item()`, `.tolist()`, `bool()`/`int()`/`float()` of a tensor,
    `.numpy()`, `.cpu()`;
  - an op whose output size depends on the data: `nonzero`, `argwhere`, boolean-mask indexing (`x[mask]`),
    `masked_select`, `unique`, `bincount`, `repeat_interleave` without `output_size`, one-argument `where`.
Not counted: reads of host values. A value is on the host when it came from one of the reads above (`.cpu()`), when it
was made from Python data without a device (`torch.tensor(list)`), or when every tensor it was computed from is: the
dispatch's split sizes, once read, cost nothing more however often the host arithmetic reads them again. This holds on
CPU as on CUDA, so the CPU count is the number a GPU would stall.

A function mode, not a dispatch mode: on CPU `.tolist()` and `.cpu()` read the storage without dispatching an op
(checked on torch 2.13), so a TorchDispatchMode misses them. On CUDA, torch's own sync debug mode
(`torch.cuda.set_sync_debug_mode`) flags the same stalls from the driver's side.

Each call runs through Python under the mode, so the trainer meters the same steps as its memory meters
(observe/memory.py `StepMeters`: the first two and every run.peak_every-th logged one).
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

T = torch.Tensor
READS = {T.item, T.tolist, T.__bool__, T.__int__, T.__float__, T.__index__, T.numpy, T.cpu}
SIZED_BY_DATA = {torch.nonzero, T.nonzero, torch.argwhere, T.argwhere, torch.masked_select, T.masked_select,
                 torch.unique, T.unique, torch.unique_consecutive, T.unique_consecutive, torch.bincount, T.bincount}
TO_HOST = {T.cpu, T.numpy}  # their results are host values
_HOST = "_nanotitan_host"  # the tag of a host value (an attribute: it lasts as long as the tensor)


def is_host(t: torch.Tensor) -> bool:
    return getattr(t, _HOST, False)


def _sized_by_data(func, args, kwargs) -> bool:
    if func in SIZED_BY_DATA:
        return True
    if func in (torch.repeat_interleave, T.repeat_interleave):  # the output's length is sum(repeats)
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if func is T.__getitem__:  # x[mask]: as long as the mask has True entries
        idx = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
    if func is torch.where:
        return len(args) + len(kwargs) == 1
    return False


def _site() -> str:
    """Where a read was made: the innermost frame under nanotitan/ outside this meter (file:function)."""
    f = sys._getframe(2)
    while f is not None and ("/nanotitan/" not in f.f_code.co_filename or f.f_code.co_filename == __file__):
        f = f.f_back
    return "?" if f is None else f.f_code.co_filename.split("/nanotitan/")[-1] + ":" + f.f_code.co_name


def _tensors(args, kwargs) -> list[torch.Tensor]:
    """The tensors among a call's arguments, lists and tuples of them included: pytree's general flatten cost more
    than the ops it metered (5 s of a metered run's 16 under the profiler); torch functions take tensors in lists."""
    out = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += _tensors(a, None)
    return out


def _target(args, kwargs) -> str | None:
    """The device type a `Tensor.to` call names (None: a dtype only)."""
    for a in (*args[1:], kwargs.get("device")):
        if isinstance(a, (str, torch.device)):
            return torch.device(a).type
        if isinstance(a, torch.Tensor):
            return a.device.type
    return None


class HostSyncs(TorchFunctionMode):
    """Counts the host reads of device values while entered (`count`); `reads` names each one (its function) in
    order, for a test to say which it found. Entered in a second thread too (the EP lanes' forward lane)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = torch.device(device)  # the training device: `.to(device)` puts a host value there
        self.reads: list[str] = []  # appended from either lane's thread (parallel/lanes.py enters the mode in both)
        self.sites: Counter[str] = Counter()  # site:function of each read (a test holds the documented table)

    @property
    def count(self) -> int:
        return len(self.reads)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensors(args, kwargs)
        host_in = all(is_host(t) for t in tensors)
        if tensors and not host_in and (func in READS or _sized_by_data(func, args, kwargs)):
            self.reads.append(getattr(func, "__name__", str(func)))
            self.sites[_site() + ":" + self.reads[-1]] += 1
        out = func(*args, **kwargs)
        if func is T.to and _target(args, kwargs) == self.device.type:  # onto the device (a copy there, no wait)
            return out.view(out.shape) if out is args[0] and is_host(out) else out
        # a host value's results stay on the host; so does what a read returns, and a tensor made from Python data
        if func in TO_HOST or (tensors and host_in) or (not tensors and kwargs.get("device") is None):
            if func in TO_HOST and out is args[0]:  # `.cpu()` of a CPU tensor is the tensor itself: tag a view
                out = out.view(out.shape)
            for t in [out] if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    setattr(t, _HOST, True)
        return out
