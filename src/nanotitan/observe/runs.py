"""A layout's run read back: the `nanotitan train` arguments it is started with, its step records and per-rank
rows, their medians over a window, and where a lanes run's exposed EP wait went. `nanotitan bench layouts`,
`bench overlap`, `bench tp` and the planner's calibration read runs through these; so do the tests.
"""

from __future__ import annotations

import collections
import json
import statistics
from pathlib import Path

from ..parallel.pp import facts as pp_facts


def layout_argv(dp, pp, ep, schedule, M, m, steps, run_dir: Path, base_args: list[str],
                virtual_stages: int = 1) -> list[str]:
    """`nanotitan train`'s arguments for one layout's run (after base_args)."""
    V = pp_facts.virtual_stages(schedule, pp, virtual_stages)
    vpp = ["--parallel.virtual_stages", str(V)] if V > 1 else []
    return [*base_args, "--parallel.dp", str(dp), "--parallel.pp", str(pp), "--parallel.ep", str(ep),
            "--parallel.schedule", schedule, *vpp, "--parallel.microbatches", str(M), "--train.micro_batch", str(m),
            "--train.steps", str(steps), "--run.dir", str(run_dir), "--run.log_every", "1",
            "--run.progress", "false", "--run.tensorboard", "false", "--train.eval_every", "0",
            "--train.sample_tokens", "0", "--train.ckpt_at_end", "false"]


def run_results(run_dir: Path) -> dict:
    """A finished run's step records (those with a loss) and summary.json's per-rank rows."""
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"records": [r for r in records if "loss" in r], "ranks": summary["ranks"]}


# What each rank keeps (summary.json's ranks[]): live parameters, gradients, optimizer state, and the peak of the
# activations saved for backward. Process RSS (peak_mem_bytes on CPU) is reported beside them, never mixed in.
TENSOR_KEYS = {"param_bytes": "parameters", "grad_bytes": "gradients", "optim_bytes": "optimizer state",
               "act_peak_bytes": "saved activations (peak)"}


def tensor_bytes(rank_row: dict) -> int | None:
    """Parameters + gradients + optimizer state + peak saved activations of one rank (None: not recorded)."""
    if not all(k in rank_row for k in TENSOR_KEYS):
        return None
    return sum(rank_row[k] for k in TENSOR_KEYS)


def summarise(res: dict, window: tuple[int, int]) -> dict:
    recs = [r for r in res["records"] if window[0] < r["step"] <= window[1]] or res["records"][-5:]
    med = lambda k: statistics.median(r[k] for r in recs)  # noqa: E731
    ranks = res["ranks"]
    tensors = [tensor_bytes(r) for r in ranks]
    return {
        "tokens_per_sec": med("tokens_per_sec"), "step_time_s": med("step_time_s"), "mfu": med("mfu"),
        "peak_mem_max": max(r["peak_mem_bytes"] for r in ranks),
        "peak_mem_min": min(r["peak_mem_bytes"] for r in ranks),
        "tensor_mem_max": max(tensors) if None not in tensors else None,
        "tensor_mem_per_rank": [{k: r.get(k) for k in TENSOR_KEYS} for r in ranks],
        "peak_tensor_per_rank": [r.get("peak_tensor_bytes") for r in ranks],  # the step high-water marks
        # how many steps the peak meter saw: the planner's expected busiest-EP-rank peak is the highest of that
        # many steps' routing draws (plan.cost.expert_imbalance)
        "metered_steps": sum("peak_tensor_bytes" in r for r in res["records"]),
        **{f"{a}_wait_s": statistics.median(r[f"comm_{a}_wait_s"] for r in recs) for a in ("dp", "ep", "pp")},
        "bubble": med("bubble_measured") if "bubble_measured" in recs[0] else None,
        "final_loss": res["records"][-1]["loss"],
        # the routing skew the run measured (parallel/step.py StepEnd, observe/report.py router_record): the planner's
        # --expert-skew
        **{k: statistics.median(r[k] for r in recs) for k in ("expert_cv", "ep_recv_max_mean", "ep_placed_max_mean")
           if k in recs[0]},
    }


def ep_wait_breakdown(spans: list, waits: list, peer_waits: list | None, M: int) -> dict[str, float]:
    """Where one rank-step's exposed EP wait (time some EP call was pending and no lane computed, lanes.exposed_ep_wait)
    comes from. spans: (kind F/B/W, chunk, microbatch, start, end); waits: ep.py's records (lane, start, end, kind,
    posted); peer_waits: the same from the other rank of the EP group (EP 2), matched call for call per lane (each
    lane makes its calls one at a time in an order fixed by M). A stretch pending on two calls (both lanes blocked)
    is split evenly between them. Keys (seconds): exposed; lane:F / lane:B; kind:<phase>:<call> (f forward, b
    backward, r recompute); at:F0 / at:B(M-1) (the unpaired ends) / at:pairs; state:both-blocked / state:other-idle
    (the other lane between its spans: waiting for its window or for F(j)); peer:<lane> (the exposed part spent
    before the peer rank had made the matching call); and, exposed or not: wait:<lane> (each lane's summed
    wait), peerwait:<lane> (its part before the peer's call)."""
    lane_of = {"F": 0, "B": 1, "W": 1}
    span_of = []  # per wait: (microbatch of the span it is in, or -1)
    for w in waits:
        found = -1
        for k, _, i, t0, t1 in spans:
            if lane_of[k] == w[0] and k != "W" and t0 <= w[1] <= t1:
                found = i
                break
        span_of.append(found)
    peer_posted = [None] * len(waits)
    if peer_waits is not None:
        for lane in (0, 1):
            mine = sorted((w[4], n) for n, w in enumerate(waits) if w[0] == lane)
            theirs = sorted(w[4] for w in peer_waits if w[0] == lane)
            for (_, n), t in zip(mine, theirs):
                peer_posted[n] = t
    name = ("F", "B")
    out: dict[str, float] = collections.defaultdict(float)
    for n, w in enumerate(waits):
        out[f"wait:{name[w[0]]}"] += w[2] - w[1]
        if peer_posted[n] is not None:
            out[f"peerwait:{name[w[0]]}"] += max(0.0, min(w[2], peer_posted[n]) - w[1])
    # sweep over elementary intervals
    ev = [(t0, 0, n) for n, (_, _, _, t0, _) in enumerate(spans)] + [(t1, 1, n) for n, (*_, t1) in enumerate(spans)]
    ev += [(w[1], 2, n) for n, w in enumerate(waits)] + [(w[2], 3, n) for n, w in enumerate(waits)]
    ev += [(t, 4, n) for n, t in enumerate(peer_posted) if t is not None]
    ev.sort(key=lambda e: e[0])
    in_span, pending, last = [0, 0], set(), None
    for t, typ, n in ev:
        if last is not None and t > last and pending:
            blocked = [0, 0]
            for p in pending:
                blocked[waits[p][0]] += 1
            computing = any(in_span[ln] > 0 and not blocked[ln] for ln in (0, 1))
            if not computing:
                dt = t - last
                out["exposed"] += dt
                share = dt / len(pending)
                both = blocked[0] and blocked[1]
                for p in pending:
                    lane, kind = waits[p][0], waits[p][3]
                    out[f"lane:{name[lane]}"] += share
                    out[f"kind:{kind}"] += share
                    i = span_of[p]
                    at = "F0" if lane == 0 and i == 0 else "B(M-1)" if lane == 1 and i == M - 1 else "pairs"
                    out[f"at:{at}"] += share
                    out["state:both-blocked" if both else "state:other-idle"] += share
                    if peer_posted[p] is not None and peer_posted[p] >= t:  # the peer had not called yet
                        out[f"peer:{name[lane]}"] += share
        if typ == 0:
            in_span[lane_of[spans[n][0]]] += 1
        elif typ == 1:
            in_span[lane_of[spans[n][0]]] -= 1
        elif typ == 2:
            pending.add(n)
        elif typ == 3:
            pending.discard(n)
        last = t
    return dict(out)
