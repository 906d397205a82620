"""Routing skew and group-limited routing in the planner's time model (plan/skew.py, docs/planner.md §3), and the
per-microbatch skew record a run writes (parallel/step.py StepEnd, observe/report.py router_record)."""

import dataclasses
import json

import pytest
import torch

from nanotitan.config.config import Config
from nanotitan.config.hardware import Link, get_hardware
from nanotitan.plan import Layout, ModelShape, PlanOptions, layout_config, plan, predict
from nanotitan.plan.skew import group_node_crossings, measured_skew, skew_of_ratio, time_imbalance


def _cfg(E=4, K=2, d_model=64, ffn_dim=128, **model) -> Config:
    cfg = Config()
    cfg.model.vocab_size, cfg.data.vocab_size = 288, 288
    cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads = d_model, 2, 4
    cfg.model.ffn_dim, cfg.model.num_experts, cfg.model.top_k = ffn_dim, E, K
    for k, v in model.items():
        setattr(cfg.model, k, v)
    cfg.train.seq_len, cfg.model.max_seq_len, cfg.train.micro_batch, cfg.parallel.microbatches = 64, 64, 2, 2
    return cfg


def test_skew_raises_the_busiest_ep_ranks_step_and_capacity_caps_it():
    cfg, hw = _cfg(), get_hardware("h100-sxm")
    lay = Layout(1, 1, 4, "1f1b", 2, 2)
    c = layout_config(cfg, lay)
    flat, skewed = (predict(c, lay, hw, PlanOptions(expert_skew=s)) for s in (0.0, 0.8))
    assert flat.expert_time_factor == 1.0 and skewed.expert_time_factor > 1.2
    assert skewed.step_time_s > flat.step_time_s
    assert skewed.costs["ep_a2a"] > flat.costs["ep_a2a"] and skewed.costs["compute"] > flat.costs["compute"]
    # no EP: one rank holds every expert, nothing to be unbalanced
    one = Layout(4, 1, 1, "1f1b", 2, 2)
    assert (predict(layout_config(cfg, one), one, hw, PlanOptions(expert_skew=0.8)).step_time_s
            == pytest.approx(predict(layout_config(cfg, one), one, hw, PlanOptions(expert_skew=0.0)).step_time_s))
    # a capacity factor bounds what the busiest rank receives: cf 1 holds it to the mean whatever the skew
    cap = _cfg(capacity_factor=1.0)
    assert time_imbalance(cap, lay, ModelShape.from_config(cap), 5.0) == pytest.approx(1.0)
    # never above every source token sending min(K, L) of its K assignments to one rank
    assert time_imbalance(cfg, lay, ModelShape.from_config(cfg), 100.0) == pytest.approx(4 * 1 / 2)


def test_a_layout_that_spreads_the_skew_better_can_win():
    """EP 4 gives each expert twice EP 2's rows (a faster GEMM on this profile, where rows are dear and the link
    free), and wins with a balanced router; a skewed one (sigma 4, what an unbalanced fresh router records here,
    docs/planner.md §3) loads EP 4's busiest rank more, and the search ranks EP 2 first."""
    hw = dataclasses.replace(get_hardware("h100-sxm"), gemm_half_rows=8, intra=Link.uniform(1e15, 0.0))
    cfg = _cfg(E=16, K=2, ffn_dim=2048, d_model=256)
    shape = ModelShape.from_config(cfg)
    f2, f4 = (time_imbalance(cfg, Layout(1, 1, ep, "1f1b", 2, 2), shape, 1.0) for ep in (2, 4))
    assert f4 > f2 > 1.0
    first = {}
    for skew in (0.0, 4.0):
        preds = plan(cfg, 4, hw, PlanOptions(zero=0, nodes=1, expert_skew=skew, micro_batch=2, global_batch=16))
        first[skew] = min((p for p in preds if p.layout.pp == 1 and p.layout.ep > 1), key=lambda p: p.step_time_s)
    assert first[0.0].layout.ep == 4 and first[4.0].layout.ep == 2


def test_skew_of_a_recorded_ratio_inverts_the_time_factor(tmp_path):
    cfg = _cfg(E=8)
    shape = ModelShape.from_config(cfg)
    lay = Layout(1, 1, 4, "1f1b", 2, 2)
    for sigma in (0.2, 0.7):
        f = time_imbalance(cfg, lay, shape, sigma)
        assert skew_of_ratio(f, 4, 8) == pytest.approx(sigma)
    path = tmp_path / "metrics.jsonl"
    recs = [{"step": s, "ep": 4, "ep_recv_max_mean": r, "expert_cv": 0.3} for s, r in ((1, 3.0), (2, 1.2), (3, 1.4),
                                                                                      (4, 1.3))]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert measured_skew(path, 8, skip=1) == pytest.approx(skew_of_ratio(1.3, 4, 8))
    path.write_text(json.dumps({"step": 1, "ep": 1, "expert_cv": 0.42}) + "\n")
    assert measured_skew(path, 8) == pytest.approx(0.42)


def test_group_limited_routing_lowers_the_inter_node_bytes_by_its_bound():
    """Experts in 8 groups, each token in at most 1 group (so 1 node) of top-4: a quarter of the copies cross."""
    hw = dataclasses.replace(get_hardware("h100-sxm"), intra=Link.uniform(1e15, 0.0), inter=Link.uniform(1e9, 0.0))
    base = _cfg(E=16, K=4)
    grouped = _cfg(E=16, K=4, n_group=8, topk_group=1)
    lay = Layout(1, 1, 16, "1f1b", 1, 8)
    shape = ModelShape.from_config(grouped)
    assert group_node_crossings(grouped, lay, shape, 8) == pytest.approx(1 / 4)
    assert group_node_crossings(base, lay, shape, 8) == 1.0
    assert group_node_crossings(grouped, lay, shape, 16) == 1.0  # one node: nothing crosses anyway
    assert group_node_crossings(_cfg(E=16, K=4, n_group=8, topk_group=1), Layout(1, 1, 16, "1f1b", 1, 8), shape,
                                2) == pytest.approx(1 / 4)  # 8 nodes of 2: 8 groups, one a node
    assert group_node_crossings(_cfg(E=16, K=4, n_group=4, topk_group=1), lay, shape, 2) == 1.0  # groups straddle
    opts = PlanOptions(nodes=2, expert_skew=0.0)
    a2a = [predict(layout_config(c, lay), lay, hw, opts).costs["ep_a2a"] for c in (base, grouped)]
    # inter-node bytes bound the all-to-all (half the peers off-node, the network 9x slower): 1/4 of them
    assert a2a[1] / a2a[0] == pytest.approx(1 / 4, rel=0.05)


def test_the_run_records_the_busiest_ep_ranks_received_assignments_per_microbatch():
    """2 EP ranks, 4 experts, seen from rank 0: microbatch 1's group load is even (ratio 1), microbatch 2 sends
    everything to rank 0's two experts (ratio 2); the CV of its source microbatches' counts is 1/sqrt(2) and 1. The EP
    group's loads are what the dispatch's count exchange gathered (`Routing.received`, no collective of their own);
    the record's one packed SUM over the world is this rank's alone here (no process group)."""
    from types import SimpleNamespace

    from nanotitan.model.transformer import Routing
    from nanotitan.observe.report import router_record
    from nanotitan.optim.qk_clip import QKClip
    from nanotitan.parallel.dims import ParallelDims
    from nanotitan.parallel.pp.schedules import StepStats
    from nanotitan.parallel.rebalance import Rebalancer
    from nanotitan.parallel.step import StepEnd, StepResult

    mine, peer = [[4, 0, 2, 2], [4, 4, 0, 0]], [[0, 4, 2, 2], [4, 4, 0, 0]]
    cfg = _cfg()

    def record(ep: int) -> dict:
        shard = SimpleNamespace(model=torch.nn.Linear(1, 1), dims=ParallelDims(1, 1, ep, 0))
        shard.rebalancer = Rebalancer(shard, 0, 1)  # the static placement's: no window, no placed figure
        received = torch.tensor([mine]) + torch.tensor([peer]) if ep > 1 else None  # (layers, microbatches, E)
        routing = Routing(["0"], torch.tensor([mine]), torch.zeros(1, 2, 5), received)
        stats = StepStats(torch.zeros(()), torch.zeros(()), 0.0, 0.0, 0.0, 1, routing=routing)
        result = StepEnd(shard, cfg, 1.0, QKClip(shard, 0))(0, StepResult(stats, torch.zeros(()), 0.0, False, False),
                                                         None, True, lambda: None)
        return router_record(result.router, cfg.model)

    out = record(2)
    assert out["ep_recv_max_mean"] == pytest.approx(1.5) and "ep_placed_max_mean" not in out
    assert out["expert_cv"] == pytest.approx((2 ** -0.5 + 1) / 2, abs=1e-4)
    assert out["expert_load"][0] == [8, 4, 2, 2]  # this rank's two microbatches
    # without EP only the CV
    out = record(1)
    assert "ep_recv_max_mean" not in out and out["expert_cv"] == pytest.approx((2 ** -0.5 + 1) / 2, abs=1e-4)