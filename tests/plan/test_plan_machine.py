"""This machine's calibration (plan/fit/machine.py, hardware.machine_kind and its cache): a fit that recovers the
constants that made the steps, a check on layouts the fit never saw, and a cache per machine kind that every plan
of this host reads without being asked."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from nanotitan.config import hardware
from nanotitan.config.hardware import cached_calibration, cpu_profile, detect_hardware, host_cores, machine_kind
from nanotitan.parallel.comm.emulate import LinkModel
from nanotitan.plan.fit import machine
from nanotitan.plan.fit.interval import FITTED
from nanotitan.plan.search import enumerate_layouts
from tests.helpers.plan import tiny

EMULATED = {"profile": "h100-sxm", "node_size": 2, "dilation": 1e-3}
TRUTH = dict(compute_efficiency=0.4, a2a_call_s=2e-3, p2p_call_s=1e-3, step_overhead_s=5e-3)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOTITAN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hardware, "cached_cpu_gemm_flops", lambda threads, dtype="fp32", cache_dir=None: 100e9)
    return tmp_path


def _measured(tmp_path, cfg, worlds=(2, 4), noise=0.0):
    """A `bench layouts` file of every layout of `worlds` at m = 2 on an emulated network, its step times made by
    TRUTH's constants (x exp(+-noise), alternating) and its peaks by the planner plus a 400 MiB reserve."""
    truth = dataclasses.replace(machine.base_profile(), **TRUTH)
    links = LinkModel(hardware.get_hardware(EMULATED["profile"]), EMULATED["node_size"], EMULATED["dilation"])
    rows = []
    for n in worlds:
        for lay in enumerate_layouts(cfg, n, 16):
            if lay.micro_batch != 2 or lay.schedule != "1f1b":
                continue
            row = dict(world=n, dp=lay.dp, pp=lay.pp, ep=lay.ep, schedule=lay.schedule if lay.pp > 1 else "-",
                       M=lay.microbatches, m=2)
            p = machine.predict_step(machine.Step(row, links, "x"), cfg, truth)
            row["step_time_s"] = p.step_time_s * math.exp(noise * (-1) ** len(rows))
            row["peak_mem_per_rank"] = [p.mem_by_stage[(g // lay.ep) % lay.pp] + 400 * 2**20 - truth.mem_reserved_bytes
                                        for g in range(n)]
            rows.append(row)
    path = tmp_path / "layouts_fit.json"
    path.write_text(json.dumps({"rows": rows, "emulate": EMULATED}))
    return path


def test_the_fit_recovers_the_constants_that_made_the_steps_and_scores_held_out_layouts(cache):
    cfg = tiny(n_layers=2, m=2)
    steps = machine.read_steps([_measured(cache, cfg)])
    assert steps and all(s.links is not None and s.links.node_size == 2 for s in steps)
    hw, sig = machine.fit(steps, cfg)
    for k, v in TRUTH.items():
        assert getattr(hw, k) == pytest.approx(v, rel=0.05), k
    assert hw.mem_reserved_bytes == pytest.approx(400 * 2**20, rel=1e-3)
    assert abs(sig.step_bias) < 1e-3 and sig.links == FITTED.links  # exact steps: nothing left to compose
    # held out: each 2-rank layout by a fit to the others; steps made by the model itself all fall inside
    scored = machine.leave_one_out(steps, cfg, (2,))
    assert len(scored) == sum(s.row["world"] == 2 for s in steps)
    s = machine.summary(scored)
    assert s["coverage"] == 1.0 and s["median_abs_err"] < 0.01 and s["meets"]
    assert "inside the 80% interval" in machine.format_score(scored, "held out")
    with pytest.raises(Exception, match="at least 7 measured layouts"):
        machine.fit(steps[:3], cfg)


def test_the_calibration_is_cached_per_machine_kind_and_every_plan_of_this_host_reads_it(cache, capsys):
    from nanotitan.plan.cli import main

    cfg_args = ["--model.d_model", "64", "--model.n_heads", "4", "--model.ffn_dim", "128", "--model.n_layers", "2",
                "--model.num_experts", "4", "--data.vocab_size", "512", "--model.vocab_size", "512",
                "--train.seq_len", "64", "--model.max_seq_len", "64"]
    cfg = tiny(n_layers=2, m=2)
    path = _measured(cache, cfg, noise=0.03)
    assert cached_calibration() is None and not detect_hardware().name.endswith("calibrated")
    rc = main(["--calibrate-machine", "--from", str(path), "--fit-ranks", "2", "4", "--holdout-ranks", "0",
               *cfg_args])
    out = capsys.readouterr().out
    assert rc == 0 and f"machine kind: {machine_kind()}" in out and "inside the 80% interval" in out
    entry = cached_calibration()
    assert entry and entry["layouts"] == len(machine.read_steps([path]))
    hw = detect_hardware()  # this host, without being asked: the calibrated profile
    assert hw.name == f"cpu-{host_cores()}core-calibrated" and "calibrated on this machine kind" in hw.source
    assert hw.compute_efficiency == pytest.approx(entry["profile"]["compute_efficiency"])
    assert machine.sigmas_for(hw).step_sigma == entry["sigmas"]["step_sigma"]
    assert machine.sigmas_for(hardware.get_hardware("h100-sxm")) is FITTED
    # another machine kind's entry is not this one's; the nominal profile stays reachable
    assert cached_calibration(kind="another CPU|64 cores|torch 0") is None
    assert not cpu_profile(host_cores(), 1e9, calibrated=False).name.endswith("calibrated")
