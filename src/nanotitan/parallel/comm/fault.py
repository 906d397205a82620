"""A planted fault: one element of one collective of one axis made wrong, on one rank, for `nanotitan verify`'s own
check that it names the axis a bug lives in (tests/verify, docs/verify.md "Planting a fault").

    plant("tp")        the first floating-point payload rank 0 hands a TP collective gets one element bumped
    plant("ep:2:1")    the third EP call's payload on rank 1
    unplant()

Nothing here runs unless `plant` is called (verify's ranks do, when asked): it rebinds collectives.py's functions
to wrappers that count the calls of the axis and bump element 0 of the chosen call's payload by the payload's largest
magnitude (what the rank sends: a copy where the caller's tensor is not the collective's own buffer), then call the
original. `unplant` puts the originals back, so the training path is the same code as ever.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import collectives

# Each wrapped call: the index of its payload argument, and whether the collective writes into it (all-reduce: the
# payload is the result buffer, bumped in place; the others send a bumped copy).
PAYLOAD = {"all_reduce": 0, "reduce_scatter": 1, "all_gather": 1, "all_to_all_single": 1, "send": 0}


@dataclass
class Fault:
    axis: str
    call: int = 0  # which of the planting rank's floating-point calls on the axis (0: its first)
    rank: int = 0  # the global rank that plants it
    seen: int = 0
    planted: str = ""  # where it went: "all-reduce (64,) element 0", once planted
    keep: list = field(default_factory=list)  # bumped copies in flight (async sends)

    @classmethod
    def parse(cls, spec: str) -> "Fault":
        """AXIS[:CALL[:RANK]], e.g. "ep", "dp:0:1"."""
        axis, *rest = spec.split(":")
        if axis not in collectives.AXES or len(rest) > 2 or not all(r.isdigit() for r in rest):
            raise ValueError(f"fault {spec!r}: want AXIS[:CALL[:RANK]] with AXIS one of {', '.join(collectives.AXES)}")
        return cls(axis, *map(int, rest))

    def hits(self, axis: str, t: torch.Tensor) -> bool:
        """Whether this call (of `axis`, payload t) is the one: counted on the planting rank, floating payloads only."""
        if axis != self.axis or not t.is_floating_point() or not t.numel() or dist.get_rank() != self.rank:
            return False
        self.seen += 1
        return self.seen - 1 == self.call


def bump(t: torch.Tensor) -> None:
    """Element 0 of t += t's largest magnitude (1 in a payload of zeros): one wrong element, of the payload's scale."""
    flat = t.view(-1)
    flat[0] += float(flat.abs().max()) or 1.0


_ORIGINAL: dict[str, object] = {}


def plant(spec: str) -> Fault:
    """Rebind collectives.py's calls to wrappers that bump the chosen call's payload (module docstring)."""
    unplant()
    fault = Fault.parse(spec)
    for name, at in PAYLOAD.items():
        _ORIGINAL[name] = original = getattr(collectives, name)
        setattr(collectives, name, _wrapped(original, name, at, fault))
    _ORIGINAL["batch_isend_irecv"] = original = collectives.batch_isend_irecv
    collectives.batch_isend_irecv = _wrapped_p2p(original, fault)
    return fault


def unplant() -> None:
    for name, original in _ORIGINAL.items():
        setattr(collectives, name, original)
    _ORIGINAL.clear()


def _axis(name: str, args, kwargs) -> str:
    default = {"all_to_all_single": "ep", "send": "pp"}.get(name, "dp")
    at = {"all_reduce": 2, "reduce_scatter": 3, "all_gather": 3, "all_to_all_single": 5, "send": 3}[name]
    return kwargs.get("axis", args[at] if len(args) > at else default)


def _wrapped(original, name: str, at: int, fault: Fault):
    def call(*args, **kwargs):
        t = args[at]
        if fault.hits(_axis(name, args, kwargs), t):
            if name != "all_reduce":  # the caller's tensor is no buffer of the collective: send a bumped copy
                t = t.clone()
                fault.keep.append(t)
                args = (*args[:at], t, *args[at + 1:])
            bump(t)
            fault.planted = f"{name.replace('_', '-')} {tuple(t.shape)} element 0"
        return original(*args, **kwargs)
    return call


def _wrapped_p2p(original, fault: Fault):
    def call(ops, axis: str = "pp", async_op: bool = False):
        sends = [i for i, op in enumerate(ops) if op.op is dist.isend]
        if sends and fault.hits(axis, ops[sends[0]].tensor):
            op = ops[sends[0]]
            t = op.tensor.clone()
            bump(t)
            fault.keep.append(t)
            fault.planted = f"send {tuple(t.shape)} element 0"
            ops = [*ops[:sends[0]], dist.P2POp(op.op, t, op.peer, op.group, op.tag), *ops[sends[0] + 1:]]
        return original(ops, axis=axis, async_op=async_op)
    return call
