"""The step interval's composition term (plan/fit/interval.py, docs/planner.md §7), its leave-one-layout-out scoring
(score, run_noise), and the per-step gradient-norm sync the time model charges (plan/steptime.py)."""

import dataclasses
import math
import random

import pytest

from nanotitan.plan.fit.interval import run_noise, score
from nanotitan.config.config import Config
from nanotitan.config.hardware import Link, get_hardware, ring_allreduce_s
from nanotitan.plan import Layout, PlanOptions, layout_config, predict
from nanotitan.plan.fit.interval import Sigmas, fit_composition, step_interval, terms_sd


def _pred(lay=Layout(1, 2, 4, "1f1b", 4, 2), hw=None, **opts):
    cfg = Config()
    cfg.model.vocab_size, cfg.data.vocab_size, cfg.model.num_experts = 288, 288, 4
    return predict(layout_config(cfg, lay), lay, hw or get_hardware("h100-sxm"), PlanOptions(nodes=1, **opts))


def test_the_composition_term_shifts_and_widens_the_step_interval():
    p = _pred()
    sig = Sigmas(host=0.02, links={"ep_a2a:intra": 0.01})
    lo, hi = step_interval(p, sig)
    lo2, hi2 = step_interval(p, dataclasses.replace(sig, step_bias=0.05, step_sigma=0.1))
    assert math.sqrt(lo2 * hi2) == pytest.approx(p.step_time_s * math.exp(0.05))  # centred on the corrected step
    sd, sd2 = math.log(hi / lo) / 2, math.log(hi2 / lo2) / 2  # z * sd each
    assert sd2 == pytest.approx(math.sqrt(sd ** 2 + (1.2816 * 0.1) ** 2))  # composed in quadrature with the terms
    assert terms_sd(p, dataclasses.replace(sig, step_sigma=0.1)) == pytest.approx(sd / 1.2816)


def test_fit_composition_recovers_a_bias_and_only_the_spread_the_terms_leave():
    rng = random.Random(0)
    res = [0.04 + rng.gauss(0, 0.05) for _ in range(4000)]
    bias, sd = fit_composition(res, [0.03] * len(res))
    assert bias == pytest.approx(0.04, abs=0.003)
    assert sd == pytest.approx(math.sqrt(0.05 ** 2 - 0.03 ** 2), abs=0.003)
    assert fit_composition([0.01, -0.01], [0.5, 0.5]) == (0.0, 0.0)  # the terms explain it all
    assert fit_composition([0.2], [0.0]) == (0.2, 0.0)


def test_leave_one_layout_out_never_fits_a_layout_on_its_own_runs(tmp_path):
    p = _pred()
    rows = [dict(grid=g, pred=1.0, meas=m, sd=0.0, p=dataclasses.replace(p, step_time_s=1.0))
            for g, m in (("a", 1.5), ("a", 1.5), ("b", 1.0), ("c", 1.1), ("b", 1.05), ("c", 1.0))]
    out = score(rows, Sigmas(host=0.0))
    a = [r for r in out if r["grid"] == "a"]
    others = [math.log(m) for m in (1.0, 1.1, 1.05, 1.0)]
    assert all(r["bias"] == pytest.approx(sum(others) / 4) for r in a)  # fitted without "a"'s large residuals
    assert not any(r["inside"] for r in a)
    assert [r for r in out if r["grid"] == "b"][0]["bias"] > a[0]["bias"]  # "b" sees "a"'s
    # run-to-run noise: rows matched by layout across two files
    import json
    one, two = tmp_path / "a.json", tmp_path / "b.json"
    row = dict(dp=2, pp=1, ep=4, M=1, m=2)
    one.write_text(json.dumps({"rows": [dict(row, step_time_s=1.0), dict(row, dp=4, step_time_s=2.0)]}))
    two.write_text(json.dumps({"rows": [dict(row, step_time_s=1.1)]}))
    noise, logs = run_noise([(str(one), str(two))])
    assert logs == [pytest.approx(math.log(1.1))] and noise == pytest.approx(math.log(1.1) / math.sqrt(2))


def test_the_step_pays_the_gradient_norms_scalar_all_reduces_over_ep_and_pp():
    """parallel/clip.py all-reduces one scalar over EP and over PP every step (over the sharded group at zero >= 1):
    2(g - 1) latencies each, nothing at DP alone."""
    lat = 1e-3
    hw = dataclasses.replace(get_hardware("h100-sxm"), intra=Link.uniform(1e12, lat))
    p = _pred(Layout(1, 2, 4, "1f1b", 4, 2), hw)
    assert p.costs["grad_norm"] == pytest.approx(ring_allreduce_s(4, 4, 1e12, lat) + ring_allreduce_s(4, 2, 1e12, lat))
    assert p.costs["grad_norm"] == pytest.approx((6 + 2) * lat, rel=1e-6)
    assert sum(p.costs.values()) == pytest.approx(p.step_time_s)
    assert _pred(Layout(8, 1, 1, "1f1b", 1, 2), hw).costs["grad_norm"] == 0.0
    z1 = _pred(Layout(2, 1, 4, "1f1b", 1, 2, 1), hw, zero=1)  # zero 1: over the stage's dp*ep ranks, not EP
    assert z1.costs["grad_norm"] == pytest.approx(14 * lat, rel=1e-6)
