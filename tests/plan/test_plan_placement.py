"""The planner and expert placement (plan/skew.py, plan/whatif.py; docs/planner.md §3): the skew term reads the placed
load, the moves are priced once per window, and --what-if says what balanced placement saves."""

import dataclasses

import pytest

from nanotitan.config.config import Config
from nanotitan.config.hardware import get_hardware
from nanotitan.plan import Layout, ModelShape, PlanOptions, layout_config, predict
from nanotitan.plan.skew import PLACED_RESIDUAL, rebalance_bytes, replica_sync_bytes, time_imbalance
from nanotitan.plan.whatif import placement_saving


def _cfg(placement="static", replicas=1) -> Config:
    cfg = Config()
    cfg.model.vocab_size, cfg.data.vocab_size = 288, 288
    cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads = 64, 2, 4
    cfg.model.ffn_dim, cfg.model.num_experts, cfg.model.top_k = 128, 8, 2
    cfg.train.seq_len, cfg.model.max_seq_len, cfg.train.micro_batch, cfg.parallel.microbatches = 64, 64, 2, 2
    cfg.parallel.expert_placement, cfg.parallel.expert_replicas = placement, replicas
    return cfg


def test_the_skew_term_reads_the_placed_load():
    lay = Layout(1, 1, 4, "1f1b", 2, 2)
    static, placed = _cfg(), _cfg("balanced", 2)
    shape = ModelShape.from_config(static)
    f_static, f_placed = (time_imbalance(c, lay, shape, 0.8) for c in (static, placed))
    assert f_static > 1.2 and f_placed - 1 == pytest.approx((f_static - 1) * PLACED_RESIDUAL)
    hw = get_hardware("h100-sxm")
    assert (predict(layout_config(placed, lay), lay, hw, PlanOptions(expert_skew=0.8)).step_time_s
            < predict(layout_config(static, lay), lay, hw, PlanOptions(expert_skew=0.8)).step_time_s)


def test_the_moves_are_every_slot_of_every_moe_layer_once_per_window():
    lay = Layout(1, 1, 4, "1f1b", 2, 2)
    cfg = _cfg("balanced", 2)
    shape = ModelShape.from_config(cfg)
    moe_layers = sum(shape.is_moe(i) for i in range(shape.n_layers))
    assert rebalance_bytes(cfg, lay, shape) == moe_layers * (8 // 4 + 1) * 3 * 64 * 128 * 12
    assert rebalance_bytes(cfg, Layout(4, 1, 1, "1f1b", 2, 2), shape) == 0.0  # no EP: nothing to place
    # each step: a copy in each rank's one spare slot sends half its fp32 gradient row twice (reduce, hand-back)
    assert replica_sync_bytes(cfg, lay, shape) == moe_layers * 1 * 2 * 1 / 2 * 3 * 64 * 128 * 4
    assert replica_sync_bytes(_cfg("balanced", 1), lay, shape) == 0.0  # no replicas: no sum
    # zero 1-3: the rows were reduce-scattered over DP with the rest; a copy sends its 1/DP piece to the other copy
    z1 = Layout(4, 1, 4, "1f1b", 2, 2, zero=1)
    assert replica_sync_bytes(cfg, z1, shape) == moe_layers * 1 * 1 * 3 * 64 * 128 * 4 / 4


def test_what_if_prices_balanced_placement_for_the_best_layout():
    cfg, lay, hw = _cfg(), Layout(1, 1, 4, "1f1b", 2, 16), get_hardware("h100-sxm")
    # tokens enough that the skew outweighs the copies' gradient sum (its two all-to-alls' latency alone outweighs
    # the skew at 2 x 64 tokens a microbatch)
    cfg.train.seq_len, cfg.model.max_seq_len, cfg.train.micro_batch = 2048, 2048, 16
    opts = PlanOptions(expert_skew=0.8)
    best = predict(layout_config(cfg, lay), lay, hw, opts)
    k = placement_saving(cfg, best, hw, opts)
    assert k["expert_time_factor"] < best.expert_time_factor and k["saving_unmoved"] > 0
    assert k["move_s"] > 0 and k["sync_s"] > 0 and k["step_time_s"] == pytest.approx(best.step_time_s * (1 - k["saving"]))
    rare = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, rebalance_every=10**6))
    assert placement_saving(rare, best, hw, opts)["saving"] == pytest.approx(k["saving_unmoved"], rel=1e-3)
