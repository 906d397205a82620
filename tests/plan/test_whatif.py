"""`nanotitan plan --what-if` (plan/whatif.py) and the prediction intervals (plan/fit/interval.py)."""

import dataclasses
import json

import pytest

from nanotitan.config.config import Config, ConfigError, load_config
from nanotitan.config.hardware import get_hardware
from nanotitan.plan import Layout, PlanOptions, layout_config, predict
from nanotitan.plan.fit.interval import FITTED, Sigmas, emulator_sigmas, mem_interval, parse_layout, step_interval
from tests.helpers.tiny import tiny_args

TINY = tiny_args("seq_len", "micro_batch", data_vocab_size=288, vocab_size=288, n_layers=2, n_heads=2, ffn_dim=64,
                 max_seq_len=16) + ["--parallel.microbatches", "2", "--global-batch", "16"]
# docs/planner.md §8's example (Mixtral-8x7B on 8 nodes of H100) cut to 8 layers
MIXTRAL_8L = ("--model.vocab_size 32000 --data.vocab_size 32000 --model.d_model 4096 --model.n_layers 8 "
              "--model.n_heads 32 --model.ffn_dim 14336 --model.num_experts 8 --model.top_k 2 --train.seq_len 4096 "
              "--model.max_seq_len 4096 --train.dtype bf16").split()


def _pred(skew=0.5):
    cfg = Config()
    cfg.model.vocab_size, cfg.data.vocab_size, cfg.model.num_experts = 288, 288, 4
    lay = Layout(1, 2, 4, "1f1b", 4, 2)
    return predict(layout_config(cfg, lay), lay, get_hardware("h100-sxm"), PlanOptions(expert_skew=skew, nodes=1))


def test_the_interval_holds_the_prediction_and_widens_with_the_residuals():
    p = _pred()
    narrow, wide = Sigmas(host=0.02, links={"ep_a2a:intra": 0.01}), Sigmas(host=0.2, links={"ep_a2a:intra": 0.1})
    (lo, hi), (lo2, hi2) = step_interval(p, narrow), step_interval(p, wide)
    assert lo2 < lo < p.step_time_s < hi < hi2
    assert hi / p.step_time_s == pytest.approx(p.step_time_s / lo)  # symmetric in log
    mlo, mhi = mem_interval(p, Sigmas(mem=0.1))
    assert mlo < p.peak_mem < mhi
    # a collective the calibration never measured on this link takes its axis' worst link's sigma
    assert Sigmas(host=0.3, links={"ep_a2a:intra": 0.01, "ep_a2a:inter": 0.04}).of("ep_a2a:other") == 0.04
    # a CPU profile's collectives are host work: one shared error with the compute (network=False)
    assert step_interval(p, Sigmas(host=0.1), network=False) != step_interval(p, Sigmas(host=0.1), network=True)
    assert FITTED.host > 0 and FITTED.links


def test_the_emulator_calibration_gives_each_collective_its_link():
    cal = {"h100-sxm:8": {"rows": [{"layout": "dp2 pp1 ep4 - M1 m2", "dp": {"measured_s": 1.02, "modelled_s": 1.0},
                                    "ep": {"measured_s": 0.99, "modelled_s": 1.0}}]},
           "net:2": {"rows": [{"layout": "dp2 pp1 ep4 - M1 m2", "ep": {"measured_s": 1.1, "modelled_s": 1.0}}]}}
    sig = emulator_sigmas(cal)
    assert set(sig) == {"dp_allreduce:intra", "ep_a2a:intra", "ep_a2a:inter"}
    assert sig["ep_a2a:inter"] == pytest.approx(abs(__import__("math").log(1.1)))
    assert parse_layout("dp2 pp4 ep1 zb1 M8 m1 z3") == Layout(2, 4, 1, "zb1", 8, 1, 3)


def test_what_if_reports_fit_worst_rank_layouts_intervals_and_advice_as_json(tmp_path, capsys):
    from nanotitan.plan.cli import main

    out = tmp_path / "whatif.json"
    assert main(["--what-if", "--hardware", "h100", "--nodes", "1", "--top", "3", "--json", str(out), *TINY]) == 0
    text = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["world"] == 8 and r["hardware"] == "h100-sxm" and r["fits"] is True
    w = r["worst_rank"]  # the dry run of the best layout: its heaviest rank, named
    assert 0 <= w["rank"] < 8 and w["peak_bytes"] > 0 and w["limit_bytes"] > w["peak_bytes"] and len(w["coords"]) == 3
    assert f"worst rank {w['rank']}" in text
    assert len(r["layouts"]) == 3 and [x for x in r["layouts"] if x["recommended"]] == [r["best"]]
    for x in r["layouts"]:
        lo, hi = x["step_time_interval_s"]
        assert lo < x["step_time_s"] < hi
        t_lo, t_hi = x["tokens_per_sec_interval"]
        assert t_lo < x["tokens_per_sec"] < t_hi
    assert r["dominant"][0]["share"] >= r["dominant"][-1]["share"] and r["advice"]
    assert abs(sum(d["share"] for d in r["dominant"]) - 1) < 0.01
    # --json alone: the same report on stdout, nothing else
    assert main(["--what-if", "--hardware", "h100", "--nodes", "1", "--no-dry-run", "--json", *TINY]) == 0
    r2 = json.loads(capsys.readouterr().out)
    assert r2["best"]["layout"] == r["best"]["layout"] and r2["worst_rank"] is None


def test_what_if_dry_run_and_planner_agree_on_the_best_layout_at_the_mixtral_shape():
    """docs/planner.md §8's example (1,024 x 4,096 tokens on 64 H100s, checkpointing, zero 3, m = 8) cut to 8
    layers. It planned at --precision bf16-master (bf16 params and residual stream) while its dry run built our
    trainer (fp32 params under bf16 autocast): DOES NOT FIT, rank 0 at 92.3 GiB against the planner's 62.4 at full
    size. Such a --precision now fails in one line; at the trainer's precision the planner missed the all-gather
    result a checkpointed block's recompute keeps (a whole block at EP 1: code +10.9% at 4 layers, +6.5% at 32).
    Now the planner's peak of every rank the dry run built is within 5% of the code's (+4.2% here, +2.8% at 32
    layers); the verdict names the heaviest, at the stage it was built for."""
    from nanotitan.plan.whatif import what_if

    cfg, hw = load_config(None, MIXTRAL_8L), get_hardware("h100-sxm")
    opts = PlanOptions(global_batch=1024, nodes=8, activation_checkpointing=True, zero=3, tp=1, micro_batch=8)
    with pytest.raises(ConfigError, match="--precision bf16-master"):
        what_if(cfg, 64, hw, dataclasses.replace(opts, precision="bf16-master"), FITTED)
    r = what_if(cfg, 64, hw, opts, FITTED, top=1)
    w = r["worst_rank"]
    assert w["built"] and w["peak_bytes"] == max(b["peak_bytes"] + b["skew_bytes"] for b in w["built"])
    for b in w["built"]:
        assert b["coords"][1] == b["stage"], b  # rank_of: the stage the planner named
        assert abs(b["gap"]) < 0.05, (b["stage"], b["peak_bytes"], b["planned_peak_bytes"])
    assert r["fits"] == (w["peak_bytes"] + w["skew_bytes"] + w["reserved_bytes"] <= w["limit_bytes"])
    # the former gap, reproduced at this shape: the same layout priced at bf16-master is far below the code
    L = Layout(*(r["best"][k] for k in ("dp", "pp", "ep", "schedule", "microbatches", "micro_batch", "zero")))
    paper = predict(layout_config(cfg, L), L, hw, dataclasses.replace(opts, precision="bf16-master"))
    assert paper.peak_mem - paper.mem_parts["reserved"] < 0.8 * w["peak_bytes"]


def test_what_if_with_no_layout_at_its_batch_names_the_batch_and_the_flag(capsys):
    from nanotitan.plan.cli import main

    # 2048 ranks cannot split a global batch of 16 sequences: the error says which batch it tried and the fix
    rc = main(["--what-if", "--hardware", "h100", "--ranks", "2048", "--no-dry-run", *TINY])
    text = capsys.readouterr()
    line = (text.out + text.err).strip().splitlines()[-1]
    assert rc == 2 and line.startswith("error: ")
    assert "no valid layout of 2048 ranks" in line and "global batch 16 sequences" in line and "--global-batch" in line
