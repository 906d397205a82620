"""The planner prices parallel.ep_overlap_microbatches under a pipeline (plan/cost.py::ep_lanes_time with the
stage's unpaired forwards and backwards, pp.in_flight(lanes=True) for its memory)."""

import pytest

from nanotitan.config import load_config
from nanotitan.hardware import get_hardware
from nanotitan.plan import Layout, PlanOptions, predict
from nanotitan.plan.cost import ep_lanes_time

BASE = ["--model.d_model", "1024", "--model.ffn_dim", "4096", "--model.n_heads", "8", "--model.num_experts", "8",
        "--model.n_layers", "4", "--data.vocab_size", "1024", "--model.vocab_size", "1024", "--train.seq_len", "512"]
LANES = ["--parallel.ep_overlap_microbatches", "true", "--parallel.ep", "2", "--parallel.pp", "2",
         "--parallel.microbatches", "4"]


def test_a_stages_warmup_runs_unpaired():
    """Stage with warmup w: w forwards alone, M - w pairs, w backwards alone; pp = 1 and the last stage: one each."""
    assert ep_lanes_time(1.0, 2.0, 0.5, 0.5, 4, 1) == ep_lanes_time(1.0, 2.0, 0.5, 0.5, 4)
    assert ep_lanes_time(1.0, 2.0, 0.5, 0.5, 4, 0) == pytest.approx(1.5 + 3 * 3.0 + 2.5)
    assert ep_lanes_time(1.0, 2.0, 2.0, 2.0, 4, 2) == pytest.approx(2 * (3.0 + 4.0) + 2 * 4.0)  # link-bound pairs
    assert ep_lanes_time(1.0, 2.0, 2.0, 2.0, 2, 3) == pytest.approx(2 * 7.0)  # w >= M: nothing pairs


@pytest.mark.parametrize("schedule", ["1f1b", "zb1"])
def test_lanes_under_a_pipeline_hide_ep_time_and_hold_one_more_on_the_last_stage(schedule):
    """PP2·EP2, EP crossing nodes: the lanes charge less exposed EP time and a shorter step, the same compute; the
    first stage holds what it holds without them (its F(1+j) pairs with B(j)), the last stage one microbatch more
    (its F(j+1) pairs with B(j))."""
    lay = Layout(1, 2, 2, schedule, 4, 1)
    hw = get_hardware("h100-sxm")
    opts = PlanOptions(link_node_size=1)
    off = predict(load_config(None, BASE), lay, hw, opts)
    on = predict(load_config(None, BASE + LANES), lay, hw, opts)
    assert on.costs["ep_a2a"] < off.costs["ep_a2a"] and on.costs["compute"] == off.costs["compute"]
    assert on.step_time_s < off.step_time_s
    first_off, last_off = off.mem_by_stage[0], off.mem_by_stage[-1]
    first_on, last_on = on.mem_by_stage[0], on.mem_by_stage[-1]
    assert first_on == pytest.approx(first_off) and last_on > last_off
    # refused schedules are not priced as lanes
    gp = Layout(1, 2, 2, "gpipe", 4, 1)
    assert predict(load_config(None, BASE + LANES + ["--parallel.schedule", "1f1b"]), gp, hw, opts).costs[
        "ep_a2a"] == pytest.approx(predict(load_config(None, BASE), gp, hw, opts).costs["ep_a2a"])
