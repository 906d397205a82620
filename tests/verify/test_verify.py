"""`nanotitan verify` end to end on real gloo ranks: a one-element error planted in one collective of each axis (a TP
all-reduce, an EP all-to-all, a CP ring hop, a DP gradient bucket, a PP send) is named by a tensor of that axis as
the first divergence; the command's exit codes (the same EP layout without the fault is equal), last line and JSON.

Cost: one one-process reference and one 2-rank world running the five cases one after another, two CLI runs of one
step each.
"""

import json

import pytest

from nanotitan import cli
from nanotitan.config.config import load_config
from nanotitan.verify.check import AXES, configs
from nanotitan.verify.compare import FP32, Layout, compare, verdict
from nanotitan.verify.fuzz import BASE
from nanotitan.verify.world import run_cases, run_world
from tests.helpers.mp import run_ranks

STEPS = 1  # every fault lands in the first step, the one compared tensor by tensor
# (layout, extra flags, the fault planted: AXIS[:CALL[:RANK]], the first divergence's name, its phase)
FAULTS = {
    # without SP a TP region's exit is an all-reduce: the vocab-parallel embedding's lookups are the first
    "tp": (dict(tp=2), ("--parallel.sp", "false"), "tp", "embed", "forward"),
    "ep": (dict(ep=2), (), "ep", "layers.0.moe", "forward"),  # layer 0's dispatch
    "cp": (dict(cp=2), (), "cp", "layers.0.attn", "forward"),  # layer 0's first ring hop
    "dp": (dict(dp=2), (), "dp", None, "backward"),  # the final backward's first bucket
    "pp": (dict(pp=2), (), "pp", "layers.2.attn", "forward"),  # the first activation into stage 1
}


def _args(corpus_dir, *extra) -> list[str]:
    return [*BASE, "--data.source", str(corpus_dir), "--parallel.microbatches", "8", *extra]


def test_a_planted_fault_is_named_by_a_tensor_of_its_axis(corpus_dir, tmp_path):
    ref_cfg, _ = configs(load_config(None, _args(corpus_dir)), dict(dp=2), str(tmp_path / "ref"))
    ref = run_world(ref_cfg, STEPS)[0]
    cases, layouts = [], []
    for name, (layout, extra, fault, _, _) in FAULTS.items():
        _, lay = configs(load_config(None, _args(corpus_dir, *extra)), layout, str(tmp_path / name))
        cases.append((lay, STEPS, fault))
        layouts.append(Layout({a: getattr(lay.parallel, a) for a in AXES}, set()))
    results = run_ranks(run_cases, 2, args=(cases,), timeout=300, pg_timeout=120)
    for i, (name, (_, _, fault, where, phase)) in enumerate(FAULTS.items()):
        ranks = [results[r][i] for r in range(2)]
        rows = compare(ref, ranks, FP32, layouts[i])
        first = next((r for r in rows if not r.ok), None)
        assert any(r["fault"] for r in ranks), f"{name}: the fault was never planted"
        assert first is not None and first.phase == phase and fault in first.axes, f"{name}: {verdict(rows)}"
        assert where is None or first.name == where, f"{name}: {verdict(rows)}"
        if phase == "backward":  # the forward was untouched
            assert all(r.ok for r in rows if r.phase == "forward"), name


@pytest.mark.parametrize("fault", ["", "ep"])
def test_the_command_exits_0_when_equal_1_when_diverged_and_writes_the_comparison(corpus_dir, tmp_path, capsys,
                                                                                   monkeypatch, fault):
    monkeypatch.setenv("NANOTITAN_VERIFY_FAULT", fault)
    out = tmp_path / "verify.json"
    code = cli.main(["verify", "--layout", "ep=2", "--steps", "1", "--json", str(out), *_args(corpus_dir)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    report = json.loads(out.read_text())
    if not fault:
        assert code == 0 and last.startswith("verify: equal (") and report["result"] == "equal", last
        assert all(r["ok"] for r in report["rows"]) and report["layout"]["ep"] == 2
    else:
        assert code == 1 and last.startswith("verify: first divergence: layers.0.moe (rel "), last
        assert report["first"]["name"] == "layers.0.moe" and report["fault"].startswith("all-to-all")


def test_a_config_error_exits_2_before_any_rank_starts(corpus_dir, capsys):
    assert cli.main(["verify", "--layout", "dp=3", *_args(corpus_dir)]) == 2  # B = 16 over dp 3
    assert "not a multiple of dp*ep*train.micro_batch" in capsys.readouterr().err
    assert cli.main(["verify", "--layout", "dp=1", *_args(corpus_dir)]) == 2


def test_one_process_keeps_the_fp8_recipe_of_the_wire(corpus_dir, tmp_path):
    """parallel.fp8_comm is part of the FP8 recipe (it rounds the experts' operands and gradients as the wire
    carries them, in every layout): one process runs with it, else an fp8_comm layout diverges by that rounding."""
    args = _args(corpus_dir, "--train.fp8", "rowwise", "--parallel.fp8_comm", "true")
    ref, lay = configs(load_config(None, args), dict(ep=2), str(tmp_path / "fp8"))
    assert ref.parallel.fp8_comm and lay.parallel.fp8_comm and ref.world_size == 1
    ref, _ = configs(load_config(None, args[:-1] + ["false"]), dict(ep=2), str(tmp_path / "off"))
    assert not ref.parallel.fp8_comm
