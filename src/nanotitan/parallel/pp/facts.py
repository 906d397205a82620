"""Facts of the pipeline schedules: counts that are pure functions of (schedule, PP, pp_rank, M, V).

The schedules (schedules.py), the two lanes (lanes.py), the planner (plan/cost.py) and the tests all ask these
functions, never a copy of them; schedules.py re-exports them, so `schedules.warmup`, `schedules.in_flight`, ... are the
same functions. The virtual-stages rule itself lives in config/config.py (`validate` asks it too, and the config is a
leaf).
"""

from __future__ import annotations

from ...config.config import virtual_stages

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1")

__all__ = ["SCHEDULES", "in_flight", "interleaved_chunk", "interleaved_microbatch", "lane_orders", "lane_window",
           "theoretical_bubble", "virtual_stages", "warmup"]


def warmup(schedule: str, pp: int, pp_rank: int, M: int, V: int = 1) -> int:
    """Forwards stage pp_rank runs before its first backward (chunk-forwards under interleaved, out of M*V)."""
    if pp == 1:
        return 0  # plain gradient accumulation: each forward is followed by its backward
    if schedule == "gpipe":
        return M
    if schedule == "interleaved":  # Megatron: with M == PP every forward comes first ("all warmup")
        return M * V if M == pp else min((pp - pp_rank - 1) * 2 + (V - 1) * pp, M * V)
    return min(pp - pp_rank - 1, M)  # 1f1b, zb1: what is in flight before the first gradient can arrive


def lane_window(pp: int, pp_rank: int, M: int, least: int = 2, schedule: str = "1f1b", V: int = 1) -> int:
    """parallel.ep_overlap_microbatches: the most (chunk-)microbatches stage pp_rank has between F and B at once.
    The schedule's warmup + 1 (its steady F(w+j) beside B(j)), but at least `least` (2): the last stage of 1F1B
    (warmup 0, and pp = 1) has no forward of its own to pair with B(j) but F(j+1). gpipe: all M (every forward
    comes first: no forward runs beside a backward, only the fill hides its all-to-alls)."""
    V = virtual_stages(schedule, pp, V)
    return min(max(warmup(schedule, pp, pp_rank, M, V) + 1, least), M * V)


def lane_orders(schedule: str, pp: int, M: int, V: int = 1) -> tuple[list, list]:
    """The (chunk, microbatch) order of a stage's forwards and of its backwards: the same as the schedule runs
    them one at a time, the same on every rank (interleaved: Megatron's virtual-step order; gpipe: backwards in
    reverse; every other schedule, and pp == 1: microbatch order)."""
    V = virtual_stages(schedule, pp, V)
    if V > 1:
        ks = range(M * V)
        return ([(interleaved_chunk(k, pp, V, True), interleaved_microbatch(k, pp, V)) for k in ks],
                [(interleaved_chunk(k, pp, V, False), interleaved_microbatch(k, pp, V)) for k in ks])
    order = [(0, i) for i in range(M)]
    return order, (order[::-1] if schedule == "gpipe" and pp > 1 else order)


def interleaved_chunk(k: int, pp: int, V: int, forward: bool) -> int:
    """Interleaved 1F1B: the chunk of virtual step k (chunks in reverse order backward)."""
    c = (k % (pp * V)) // pp
    return c if forward else V - 1 - c


def interleaved_microbatch(k: int, pp: int, V: int) -> int:
    """Interleaved 1F1B: the microbatch of virtual step k (per chunk, forwards and backwards both in order)."""
    return (k // (pp * V)) * pp + k % pp


def in_flight(schedule: str, pp: int, pp_rank: int, M: int, V: int = 1, lanes: bool = False) -> int:
    """Most microbatches whose activations stage pp_rank holds at once (chunk-microbatches under interleaved):
    the warmup's forwards plus the steady phase's one. zb1 also holds pp_rank deferred W's (F done, W not yet),
    which makes it min(M, PP) on every stage. lanes (parallel.ep_overlap_microbatches): `lane_window` (the
    schedule's count, but 2 on 1F1B's last stage and at pp = 1), plus zb1's deferred W's."""
    if lanes:
        return min(M * virtual_stages(schedule, pp, V),
                   lane_window(pp, pp_rank, M, 2, schedule, V) + (pp_rank if schedule == "zb1" else 0))
    if schedule == "zb1" and pp > 1:
        return min(M, pp)
    return min(warmup(schedule, pp, pp_rank, M, V) + 1, M * virtual_stages(schedule, pp, V))


def theoretical_bubble(pp: int, num_microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> float:
    """Idle fraction of a pipeline step with equal stages and free communication. GPipe/1F1B: (PP-1)/(M+PP-1).
    Interleaved: each of the PP-1 fill/drain slots is one chunk (1/V of a stage) long: (PP-1)/(V*M+PP-1).
    zb1 (ZB-H1) with F, B and W of equal length: (PP-1)(F+B-W) idle against M(F+B+W) busy: (PP-1)/(3M+PP-1)."""
    if pp == 1:
        return 0.0
    units = {"interleaved": virtual_stages * num_microbatches, "zb1": 3 * num_microbatches}
    return (pp - 1) / (units.get(schedule, num_microbatches) + pp - 1)
