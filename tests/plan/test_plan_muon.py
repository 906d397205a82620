"""The planner prices train.optimizer = muon from optim/cost.py's figures (docs/planner.md "Muon"): one momentum
buffer where AdamW keeps two, the Newton-Schulz FLOPs of a rank's share at the matmul peak, and the owner
gathers/scatters on the dense matrices' and the experts' links."""

import pytest

from nanotitan.optim.cost import muon_costs
from nanotitan.plan import Layout, predict
from nanotitan.plan.cost import build_context
from nanotitan.plan.shape import layout_config
from nanotitan.plan.steptime import gemm_eff, muon_time
from tests.helpers.plan import CPU, tiny


def _cfg(opt: str, pos_emb: str = "rope"):
    c = tiny(pos_emb=pos_emb)
    c.train.optimizer = opt
    return c


@pytest.mark.parametrize("lay", [Layout(1, 1, 1, "1f1b", 1, 8), Layout(1, 1, 2, "1f1b", 1, 8),
                                 Layout(2, 1, 2, "1f1b", 1, 8, zero=1), Layout(2, 1, 1, "1f1b", 1, 8, zero=2)])
def test_muon_state_is_one_buffer_for_its_matrices(lay):
    """AdamW's optimizer bytes less Muon's = 4 bytes per Muon element a rank keeps state for, exactly cost.py's
    dense and expert elements (experts split over EP; both sharded over their DP groups at zero >= 1)."""
    adam, muon = (predict(_cfg(o), lay, CPU).mem_parts["optimizer"] for o in ("adamw", "muon"))
    m = muon_costs(layout_config(_cfg("muon"), lay))
    ne, ex = (lay.dp * lay.ep, lay.dp) if lay.zero else (1, 1)
    assert adam - muon == pytest.approx(4 * (m["dense_elems"] / ne + m["expert_elems"] / lay.ep / ex))
    assert 0 < muon < adam


@pytest.mark.parametrize("pos_emb", ["rope", "learned"])
def test_stages_split_the_muon_elements_between_them(pos_emb):
    """Under PP the embedding (and a learned position table) stays AdamW's on stage 0, the head on the last: the
    stages' Muon elements add up to the model's, and two stages of two equal blocks each hold the same."""
    lay = Layout(1, 2, 1, "1f1b", 2, 4)
    c = build_context(_cfg("muon", pos_emb), lay, CPU)
    per = [c.muon_elements(st) for st in c.stages]
    assert sum(per) == pytest.approx(c.muon["dense_elems"] + c.muon["expert_elems"])
    assert per[0] == pytest.approx(per[1]) and c.stages[0].n_ne != c.stages[1].n_ne
    assert build_context(_cfg("adamw"), lay, CPU).muon_elements(c.stages[0]) == 0


def test_muon_step_time_is_cost_py_ns_flops_at_the_matmul_peak_plus_owner_traffic():
    """muon_time is cost.py's NS FLOPs per rank over peak x GEMM efficiency, plus its gather/scatter bytes on the
    right link; zero 1 at DP2 halves the busiest rank's NS FLOPs and adds traffic, and the optimizer's critical-path
    seconds rise over AdamW's by it less the one moment Muon does not stream."""
    one, z1 = Layout(1, 1, 1, "1f1b", 1, 8), Layout(2, 1, 1, "1f1b", 1, 8, zero=1)
    c1, c2 = (build_context(_cfg("muon"), lay, CPU) for lay in (one, z1))
    for c in (c1, c2):
        m = muon_costs(layout_config(_cfg("muon"), c.layout))
        t_ns = m["ns_flops_rank"] / (c.peak * gemm_eff(CPU, c.shape.d_model))
        link = c.links["non_expert_dp"][0] if c.zero else CPU.intra
        traffic = m["traffic_bytes_rank_dense"] / link.allreduce_bw + 2 * link.latency_s if c.zero else 0.0
        ex = c.links["expert_dp"][0]
        traffic += m["traffic_bytes_rank_expert"] / ex.allreduce_bw + 2 * ex.latency_s if c.zero else 0.0
        assert muon_time(c) == pytest.approx(t_ns + traffic)
    assert c2.muon["ns_flops_rank"] == pytest.approx(c1.muon["ns_flops_rank"] / 2)
    assert c1.muon["traffic_bytes_rank"] == 0 < c2.muon["traffic_bytes_rank"]
    for lay, c in ((one, c1), (z1, c2)):
        adam, muon = (predict(_cfg(o), lay, CPU) for o in ("adamw", "muon"))
        less = c.muon_elements(c.stages[0]) * 8 / CPU.mem_bw  # one fp32 buffer read and written, not two
        assert muon.costs["optimizer"] - adam.costs["optimizer"] == pytest.approx(muon_time(c) - less)
        assert muon.step_time_s > adam.step_time_s


@pytest.mark.parametrize("dtype, ns_dtype", [("bf16", "fp32"), ("fp32", "bf16"), ("bf16", "bf16")])
def test_newton_schulz_is_priced_at_the_peak_of_its_own_dtype(dtype, ns_dtype):
    """Newton-Schulz runs in train.muon_ns_dtype whatever train.dtype is (optim/newton_schulz.py): on an H100, whose
    bf16 peak is 15x its fp32 one, fp32 NS under bf16 training is priced at the fp32 peak and bf16 NS under fp32
    training at the bf16 one (both were priced at train.dtype's: the first 15x too fast, the second 15x too slow)."""
    from nanotitan.config.hardware import get_hardware

    hw, cfg = get_hardware("h100"), _cfg("muon")
    cfg.train.dtype, cfg.train.muon_ns_dtype = dtype, ns_dtype
    c = build_context(cfg, Layout(1, 1, 1, "1f1b", 1, 8), hw)
    assert c.muon["traffic_bytes_rank"] == 0 < c.muon["ns_flops_rank"]  # one rank: Newton-Schulz alone
    assert hw.peak_flops("bf16") > 10 * hw.peak_flops("fp32")
    want = c.muon["ns_flops_rank"] / (hw.peak_flops(ns_dtype, c.ranks_on_node) * gemm_eff(hw, c.shape.d_model))
    assert muon_time(c) == pytest.approx(want)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_dry_run_builds_muon_and_holds_the_planners_bytes(zero):
    """The dry run builds Muon (optim/geometry.py: every rank's pieces of every matrix from the sharding rules,
    nothing exchanged, so its fake ranks can): at DP2 its optimizer bytes (one momentum buffer per Muon matrix) are
    the planner's, fewer than AdamW's, and its peak, Newton-Schulz step included, is the planner's within 1%."""
    from nanotitan.plan.dryrun import compare_with_planner, dry_run

    rows = {}
    for opt in ("adamw", "muon"):
        c = tiny(dp=2)
        c.train.optimizer, c.parallel.zero = opt, zero
        (rows[opt],) = compare_with_planner(dry_run(c, 2), CPU)
    m = rows["muon"]
    assert m["optim_bytes"] == pytest.approx(m["planned_optim_bytes"], rel=1e-3), m
    assert m["optim_bytes"] < rows["adamw"]["optim_bytes"] and abs(m["gap_peak_bytes"]) < 0.01, (m, rows["adamw"])


def test_what_if_runs_its_dry_run_under_muon(tmp_path):
    """`plan --what-if` with train.optimizer=muon builds the best layout's heaviest ranks (it refused before)."""
    import json

    from nanotitan.plan.cli import main
    from tests.helpers.tiny import tiny_args

    tiny_job = tiny_args("seq_len", "micro_batch", data_vocab_size=288, vocab_size=288, n_layers=2, n_heads=2,
                         ffn_dim=64, max_seq_len=16) + ["--parallel.microbatches", "2", "--global-batch", "16"]
    out = tmp_path / "whatif.json"
    assert main(["--what-if", "--hardware", "h100", "--nodes", "1", "--json", str(out), *tiny_job,
                 "--train.optimizer", "muon"]) == 0
    w = json.loads(out.read_text())["worst_rank"]
    assert w is not None and w["peak_bytes"] > 0 and abs(w["gap"]) < 0.2, w
