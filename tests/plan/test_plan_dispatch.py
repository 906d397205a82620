"""The EP dispatch in the planner (plan/dispatch.py, docs/planner.md "Static dispatch"): static's padded payload, its
chance of a replay from the routing skew, and `--what-if`'s static against dynamic."""

import dataclasses
import json
import statistics
from pathlib import Path

import pytest

from nanotitan.bench.dispatch import planned
from nanotitan.config.config import Config, load_config
from nanotitan.config.hardware import get_hardware
from nanotitan.parallel.ep import static_slots
from nanotitan.plan import Layout, ModelShape, PlanOptions, layout_config, predict
from nanotitan.plan.dispatch import HOST_SYNC_S, host_reads, overflow_probability, static_payload
from nanotitan.plan.whatif import dispatch_line, dispatch_report

LAY = Layout(2, 1, 4, "1f1b", 2, 2)  # dp2 ep4, M 2 x m 2
MEASURED = Path(__file__).parents[2] / "docs" / "experiments" / "static_dispatch_emulated.json"


def _cfg(dispatch="static", capacity=1.25, experts=8) -> Config:
    cfg = Config()
    cfg.model.vocab_size, cfg.data.vocab_size, cfg.model.num_experts = 288, 288, experts
    cfg.model.experts_impl = "grouped"
    cfg.parallel.ep_dispatch, cfg.parallel.ep_capacity = dispatch, capacity
    return layout_config(cfg, LAY)


def _predict(cfg, skew, hw="h100-sxm"):
    return predict(cfg, LAY, get_hardware(hw), PlanOptions(expert_skew=skew, nodes=1))


def test_the_padded_payload_is_the_runtime_buffer_and_grows_with_capacity():
    cfg = _cfg()
    shape = ModelShape.from_config(cfg)
    assignments = LAY.micro_batch * shape.seq_len * shape.top_k
    caps = [1.0, 1.1, 1.25, 1.5, 2.0, 4.0]
    payloads = [static_payload(cfg, LAY, shape, c) for c in caps]
    assert payloads == [static_slots(assignments, 4, c) * 4 / assignments for c in caps]
    assert all(p >= c for p, c in zip(payloads, caps)) and payloads == sorted(payloads)
    assert payloads[-1] == 4.0  # capacity EP: every assignment fits, the replay's buffers
    assert static_payload(_cfg("dynamic"), LAY, shape) == 0.0  # dynamic: the skewed load, not a payload
    # a balanced router replays nothing, so the step grows with the capacity, by the EP all-to-all alone
    preds = [_predict(_cfg(capacity=c), 0.0) for c in caps]
    steps, a2a = [p.step_time_s for p in preds], [p.costs["ep_a2a"] for p in preds]
    assert steps == sorted(steps) and a2a == sorted(a2a) and a2a[0] < a2a[-1]
    assert all(p.costs["ep_replay"] == 0.0 for p in preds)
    # capacity 1 at a balanced router sends what dynamic's balanced ranks send: the same step
    assert steps[0] == pytest.approx(_predict(_cfg("dynamic"), 0.0).step_time_s, rel=1e-9)


def test_the_replay_chance_falls_with_capacity_and_its_cost_grows_with_skew():
    cfg = _cfg()
    shape = ModelShape.from_config(cfg)
    by_cap = [overflow_probability(cfg, LAY, shape, 0.53, c) for c in (1.0, 1.25, 1.5, 2.0, 4.0)]
    assert by_cap[0] > by_cap[1] > by_cap[2] > by_cap[3] > by_cap[4] and by_cap[0] > 0.9 and by_cap[4] < 1e-6
    skews = [0.0, 0.2, 0.53, 1.0, 2.0]
    by_skew = [overflow_probability(cfg, LAY, shape, s) for s in skews]
    assert by_skew[0] == 0.0 and by_skew == sorted(by_skew) and by_skew[1] < by_skew[-1]
    replay = [_predict(cfg, s).costs["ep_replay"] for s in skews]
    assert replay[0] == 0.0 and all(a < b for a, b in zip(replay[1:], replay[2:]))
    # the replay is a whole step at capacity EP: never more than that step
    worst = _predict(_cfg(capacity=4.0), 2.0)
    assert replay[-1] <= worst.step_time_s
    # a balanced placement leaves the placed residual of the skew: fewer replays
    placed = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, expert_placement="balanced"))
    assert overflow_probability(placed, LAY, shape, 0.53) < by_skew[2]
    assert overflow_probability(_cfg("dynamic"), LAY, shape, 2.0) == 0.0
    # 4 experts on 4 ranks, top-2: a source sends a peer at most one of each token's 2 assignments, 2x the mean, so
    # capacity 2 never overflows whatever the skew (measured: docs/experiments/static_dispatch_emulated.json)
    four = _cfg(experts=4)
    shape4 = ModelShape.from_config(four)
    assert overflow_probability(four, LAY, shape4, 2.0, 2.0) == 0.0 < overflow_probability(four, LAY, shape4, 2.0, 1.9)


def test_host_reads_a_step():
    assert host_reads(LAY, 4, False, "dynamic") == 1 + 4 * 2  # every microbatch's MoE layer calls, and the verdict
    assert host_reads(LAY, 4, True, "dynamic") == 1 + 4 * 2 * 2  # the recompute reads again
    assert host_reads(LAY, 4, True, "static") == 1
    assert host_reads(Layout(8, 1, 1, "1f1b", 2, 2), 4, False, "dynamic") == 1


def test_what_if_says_when_static_pays():
    """Static only costs where host reads are free (a CPU's gloo); on an accelerator it pays once a read costs more
    than the break-even price the report names."""
    cfg, hw = _cfg("dynamic"), get_hardware("h100-sxm")
    best = _predict(cfg, 0.53)

    def report(price):
        return dispatch_report(cfg, best, hw, PlanOptions(nodes=1, host_sync_s=price, expert_skew=0.53))

    free = report(0.0)
    assert not free["pays"] and free["break_even_host_sync_s"] > 0 and 0 < free["overflow"] < 1
    assert free["step_static_s"] > free["step_dynamic_s"] and free["reads"]["dynamic"] > free["reads"]["static"] == 1
    assert free["step_dynamic_s"] == pytest.approx(best.step_time_s)
    assert free["replay_s"] == pytest.approx(_predict(_cfg(), 0.53).costs["ep_replay"])
    costly = report(3 * free["break_even_host_sync_s"])
    assert costly["pays"] and costly["total_s"]["static"] < costly["total_s"]["dynamic"]
    assert "static pays" in dispatch_line(costly) and "dynamic is faster" in dispatch_line(free)
    json.dumps(costly)  # the --json report carries it
    # the capacity it names is the least expected step of those it tried
    assert free["best_capacity_step_s"] <= free["step_static_s"]
    # by default a read costs nothing on a CPU profile, HOST_SYNC_S on an accelerator
    assert dispatch_report(cfg, best, get_hardware("cpu-gloo"), PlanOptions(nodes=1))["host_sync_s"] == 0.0
    assert dispatch_report(cfg, best, hw, PlanOptions(nodes=1))["host_sync_s"] == HOST_SYNC_S


def test_the_planner_agrees_in_direction_with_the_measured_table():
    """docs/experiments/static_dispatch_emulated.json (`nanotitan bench dispatch`): where the measured step ratio
    static ÷ dynamic is clear of the run-to-run spread (its min and median on one side of 1 by 2%), the planner
    prices static on the same side."""
    data = json.loads(MEASURED.read_text())
    cfg = load_config(Path(__file__).parents[2] / data["config"], data["overrides"])
    checked = 0
    for key, res in data["results"].items():
        busiest = statistics.median(r["skew"] for r in res["runs"]["dynamic"])
        for var, rows in res["runs"].items():
            if var == "dynamic":
                continue
            ratios = [s["step_s"] / d["step_s"] for s, d in zip(rows, res["runs"]["dynamic"])]
            lo, mid = min(ratios), statistics.median(ratios)
            if not (lo > 1.02 or max(ratios) < 0.98):
                continue
            plan = planned(cfg, res["dp"], res["ep"], res["M"], res["m"], (res["profile"], res["node_size"]),
                           res["dilation"], busiest, float(var.split()[1]))
            assert (plan["ratio"] > 1) == (mid > 1), (key, var, ratios, plan)
            checked += 1
    assert checked, "no measured row clear of the noise: nothing to agree with"
