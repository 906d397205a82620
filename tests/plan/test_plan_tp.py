"""The planner's TP terms (plan/tp.py): collectives per layer with and without SP, memory falling with TP, the search
over DP x PP x EP x TP, and --parallel.auto's pick of TP when the dense part does not fit without it."""

from __future__ import annotations

import dataclasses

from nanotitan.config.config import Config, validate
from nanotitan.config.hardware import Link, get_hardware
from nanotitan.plan import Layout, ModelShape, PlanOptions, layout_config, plan, predict
from nanotitan.plan import tp as tp_plan
from nanotitan.plan.search import best_layout

H100 = get_hardware("h100-sxm")


def tiny(n_layers=2, moe_every=1, num_experts=4, sp=True, B=8, seq=64) -> Config:
    c = Config()
    mo = c.model
    mo.vocab_size, mo.d_model, mo.n_heads, mo.ffn_dim, mo.n_layers = 512, 64, 4, 128, n_layers
    mo.num_experts, mo.top_k, mo.moe_every, mo.max_seq_len = num_experts, 2, moe_every, seq
    c.data.vocab_size, c.train.seq_len, c.train.micro_batch, c.parallel.sp = 512, seq, B, sp
    validate(c)
    return c


def test_collectives_per_layer_with_and_without_sp():
    """Megatron's count: a dense block sends 2 all-reduces each way without SP, 2 all-gathers + 2 reduce-scatters
    each way with SP; an MoE block's FFN half is routed over EP x TP (SP: nothing on the TP link; without SP its
    tokens are split and gathered back)."""
    shape = ModelShape.from_config(tiny(n_layers=2, moe_every=2))  # layer 0 MoE, layer 1 dense
    assert not shape.is_moe(1) and shape.is_moe(0)
    assert tp_plan.block_collectives(shape, 1, sp=False) == {"all-reduce": 4, "all-gather": 0, "reduce-scatter": 0}
    assert tp_plan.block_collectives(shape, 1, sp=True) == {"all-reduce": 0, "all-gather": 4, "reduce-scatter": 4}
    assert tp_plan.block_collectives(shape, 0, sp=True) == {"all-reduce": 0, "all-gather": 2, "reduce-scatter": 2}
    assert tp_plan.block_collectives(shape, 0, sp=False) == {"all-reduce": 2, "all-gather": 2, "reduce-scatter": 0}
    shared = dataclasses.replace(shape, n_shared_experts=1)  # a shared expert is a dense FFN split column/row-wise
    assert tp_plan.block_collectives(shared, 0, sp=True)["all-gather"] == 4
    # SP moves the same bytes as the all-reduce (an all-reduce is an RS + an AG), TP1 moves none
    args = dict(first=True, last=True, tp=4, T=512, elem_bytes=2, bw=100e9, lat=0.0)
    dense = dataclasses.replace(shape, first_dense=2)  # no MoE layer: no balance-loss all-reduces
    t_sp, calls_sp = tp_plan.tp_comm_s(dense, [0, 1], sp=True, **args)
    t_ar, calls_ar = tp_plan.tp_comm_s(dense, [0, 1], sp=False, **args)
    assert abs(t_sp - t_ar) / t_ar < 0.05 and calls_sp > calls_ar
    assert tp_plan.tp_comm_s(dense, [0, 1], sp=True, **(args | {"tp": 1})) == (0.0, 0)
    # OLMoE's full q/k norms: 2 all-reduces of T floats each way a layer (the q one only over replicated KV heads)
    for kv, more in [(4, 8), (2, 4)]:  # 2 layers x 2 ways x (q, k) when tp=4 splits the KV heads, x q alone else
        olmoe = dataclasses.replace(dense, qk_norm="full", n_kv_heads=kv)
        t_qk, calls_qk = tp_plan.tp_comm_s(olmoe, [0, 1], sp=False, **args)
        assert calls_qk == calls_ar + more and t_qk > t_ar


def test_tp_collectives_ride_the_intra_node_link():
    """A TP group stays inside a node: its time is the NVLink's whatever the network, and TP never exceeds a node."""
    cfg = tiny()
    lay = Layout(1, 1, 1, "1f1b", 1, 8, 0, tp=4)
    slow_net = dataclasses.replace(H100, inter=Link.uniform(1e6, 1e-3))
    a, b = predict(cfg, lay, H100), predict(cfg, lay, slow_net)
    assert a.costs["tp"] > 0 and a.costs["tp"] == b.costs["tp"]
    slow_nvlink = dataclasses.replace(H100, intra=dataclasses.replace(H100.intra, allreduce_bw=1e8))
    assert predict(cfg, lay, slow_nvlink).costs["tp"] > 10 * a.costs["tp"]
    assert tp_plan.degrees(16, 8) == [1, 2, 4, 8]


def test_memory_falls_with_tp_and_sp_shards_the_activations():
    """Parameters, gradients and optimizer state of a rank fall ~N-fold (dense part / N, experts folded onto EP),
    activations too; without SP the norms' and residuals' activations stay whole."""
    cfg = tiny(num_experts=4)
    parts = {tp: predict(cfg, Layout(1, 1, 1, "1f1b", 1, 8, 0, tp=tp), H100).mem_parts for tp in (1, 2, 4)}
    for k in ("params", "grads", "optimizer", "activations"):
        assert parts[1][k] > parts[2][k] > parts[4][k], k
    assert 1.8 < parts[1]["params"] / parts[2]["params"] <= 2.0  # norms and routers stay whole
    no_sp = predict(tiny(sp=False), Layout(1, 1, 1, "1f1b", 1, 8, 0, tp=2), H100).mem_parts
    assert parts[2]["activations"] < no_sp["activations"] < parts[1]["activations"]
    assert no_sp["params"] == parts[2]["params"]
    # FLOPs fall N-fold too: the compute of a TP2 rank is half a TP1 rank's (less GEMM efficiency: none at m*S rows).
    # Balanced routing: under TP2 the experts fold over 2 ranks, and a skewed router's busiest rank would add its excess.
    c1, c2 = (predict(cfg, Layout(1, 1, 1, "1f1b", 1, 8, 0, tp=t), H100, PlanOptions(expert_skew=0.0)).costs["compute"]
              for t in (1, 2))
    assert abs(c1 / c2 - 2) < 0.05


def test_search_covers_dp_pp_ep_tp():
    """The layout search enumerates every TP degree a node holds, and only what the runtime accepts
    (config.validate, which asks config/tp_rules.py: here 2 heads cannot split 4 ways)."""
    cfg = tiny(n_layers=2)
    preds = plan(cfg, 4, H100)
    tps = {p.layout.tp for p in preds}
    assert tps == {1, 2, 4}
    for p in preds:
        validate(layout_config(cfg, p.layout), world_size=4)
    cfg.model.n_heads = 2
    assert {p.layout.tp for p in plan(cfg, 4, H100)} == {1, 2}
    cfg.model.n_heads = 4
    assert any(p.layout.tp == 2 and p.layout.ep == 2 for p in preds)  # EP x TP: 4 experts folded over 4 ranks
    assert {p.layout.tp for p in plan(cfg, 4, H100, PlanOptions(tp=2))} == {2}
    assert {p.layout.tp for p in plan(cfg, 4, H100, PlanOptions(nodes=2))} == {1, 2}  # 2 ranks a node


def test_auto_picks_tp_when_the_dense_part_does_not_fit():
    """Two sequences per step on 2 ranks, one layer (no pipeline): DP2 and EP2 keep the whole dense part on every
    rank; when it does not fit one device, the planner picks TP2, and with memory to spare it weighs speed only."""
    cfg = tiny(n_layers=1, num_experts=2, B=2, seq=256)
    cfg.model.vocab_size = cfg.data.vocab_size = 4096
    preds = plan(cfg, 2, H100)
    need = {tp: min(p.peak_mem for p in preds if p.layout.tp == tp) for tp in (1, 2)}
    assert need[2] < need[1]
    small = dataclasses.replace(H100, mem_bytes=(need[1] + need[2]) / 2)
    best = best_layout(cfg, 2, small)
    assert best.tp == 2 and predict(cfg, best, small).fits
    assert best_layout(cfg, 2, H100).tp in (1, 2)  # with memory to spare it is a question of speed only


def test_bench_tp_side_by_side_runs_at_tiny_shapes(tmp_path):
    """`nanotitan bench tp --part torch sp` at tiny shapes (so it cannot rot): ours and torch's parallelize_module
    both train a step on 2 gloo ranks, SP keeps fewer activation bytes than no SP, as the planner says, and the
    planner prices exactly the TP collectives the code sends (the emulator's held link time)."""
    import json

    from nanotitan.cli import main as cli_main

    out = tmp_path / "tp.json"  # the defaults (no config file) at these shapes
    assert cli_main(["bench", "tp", "--part", "torch", "sp", "--config", "", "--repeats", "1", "--out", str(out),
                     "--model.d_model", "32", "--model.n_heads", "4", "--model.ffn_dim", "64", "--model.n_layers", "2",
                     "--model.max_seq_len", "16", "--data.vocab_size", "300", "--train.seq_len", "16",
                     "--train.micro_batch", "2"]) == 0
    res = json.loads(out.read_text())["side_by_side"]
    assert all(res["time"][k]["min_s"] > 0 for k in ("ours", "torch"))
    saved, planned = res["saved_bytes"], res["planned_act_bytes"]
    assert saved["sp"] < saved["no_sp"] and planned["sp"] < planned["no_sp"]
    # the planner's TP link time is what the network emulator holds the code's TP calls for: the same collectives
    for sp in ("sp", "no_sp"):
        held, priced = res["tp_link_s"]["emulator"][sp], res["tp_link_s"]["planner"][sp]
        assert held > 0 and abs(held / priced - 1) < 1e-6


def test_dry_run_builds_tp_ranks_and_matches_the_planner():
    """`nanotitan plan --dry-run` builds a TP rank from the real code (fake process group, fake tensors), with and
    without SP, and with MTP, and its bytes match the planner's TP terms: parameters exactly, the step's peak within
    3%."""
    from nanotitan.config.config import load_config
    from nanotitan.plan.dryrun import compare_with_planner, dry_run

    base = ["--model.d_model", "32", "--model.n_heads", "4", "--model.ffn_dim", "64", "--model.n_layers", "2",
            "--model.num_experts", "4", "--data.vocab_size", "300", "--train.seq_len", "16",
            "--model.max_seq_len", "16", "--train.micro_batch", "2", "--parallel.tp", "2"]
    peaks = {}
    for sp in ("true", "false"):
        rows = compare_with_planner(dry_run(load_config(None, base + ["--parallel.sp", sp]), 2),
                                    get_hardware("cpu-gloo"))
        assert [r["ranks"] for r in rows] == [2]
        assert abs(rows[0]["gap_param_bytes"]) < 1e-9 and abs(rows[0]["gap_peak_bytes"]) < 0.03
        peaks[sp] = rows[0]["peak_bytes"]
    assert peaks["true"] < peaks["false"]
    # GQA with fewer KV heads than TP ranks: k and v (and a full k norm) whole on every rank (plan/tp.py)
    for norm in ("none", "full"):
        gqa = base[:-1] + ["4", "--model.n_kv_heads", "2", "--model.qk_norm", norm, "--model.attn_bias", "true"]
        rows = compare_with_planner(dry_run(load_config(None, gqa), 4), get_hardware("cpu-gloo"))
        assert abs(rows[0]["gap_param_bytes"]) < 1e-9, (norm, rows[0]["gap_param_bytes"])
    # MTP under TP: its block split as the others, its norms and eh_proj whole (plan/tp.py: shard_stages)
    rows = compare_with_planner(dry_run(load_config(None, base + ["--model.mtp_layers", "1"]), 2),
                                get_hardware("cpu-gloo"))
    assert abs(rows[0]["gap_param_bytes"]) < 1e-9 and abs(rows[0]["gap_peak_bytes"]) < 0.03
