"""The planner's context parallel (plan/cp.py, issue 50 item 6): the activation memory CP saves, the ring's and the
all-to-all's bytes, the link a CP group crosses, and the search over DP x PP x EP x TP x CP."""

from __future__ import annotations

import dataclasses

import pytest

from nanotitan.config.config import load_config
from nanotitan.config.hardware import get_hardware
from nanotitan.plan import cp as cp_plan
from nanotitan.plan.cost import PlanOptions, predict
from nanotitan.plan.search import plan, refusal
from nanotitan.plan.shape import Layout, ModelShape, Precision

H100 = get_hardware("h100")


def _cfg(S: int, d: int = 1024, layers: int = 4, *extra: str):
    return load_config(None, ["--model.d_model", str(d), "--model.n_layers", str(layers), "--model.n_heads", "16",
                              "--model.n_kv_heads", "4", "--model.ffn_dim", str(d), "--model.num_experts", "16",
                              "--model.top_k", "2", "--train.seq_len", str(S), "--model.max_seq_len", str(S),
                              "--train.dtype", "bf16", *extra])


@pytest.mark.parametrize("impl", ["ring", "a2a"])
def test_activation_memory_falls_n_fold_with_cp(impl):
    """Each CP rank keeps its T/N tokens' activations: the activation bytes fall N-fold (beside them the weight
    copies autocast keeps per microbatch: the experts' fall with CP, folded over it, the dense ones' do not), and at
    a long sequence the whole peak nearly so."""
    cfg = _cfg(65536, 1024, 4, "--parallel.cp_impl", impl)
    one = predict(cfg, Layout(1, 1, 1, "1f1b", 1, 1), H100)
    for n in (2, 4):
        p = predict(cfg, Layout(1, 1, 1, "1f1b", 1, 1, cp=n), H100)
        ratio = one.mem_parts["activations"] / p.mem_parts["activations"]
        assert 0.97 * n <= ratio <= 1.03 * n, (n, ratio)
        peak = (one.peak_mem - one.mem_parts["reserved"]) / (p.peak_mem - p.mem_parts["reserved"])
        assert 0.7 * n <= peak <= 1.03 * n, (n, peak)
        # the experts fold over CP (fewer per rank), the dense parameters are replicated on every CP rank
        assert one.mem_parts["params"] / n < p.mem_parts["params"] < one.mem_parts["params"]
    # what CP's attention holds beside a block's backward: the ring's blocks in flight, or Ulysses' buffers
    shape, T = ModelShape.from_config(cfg), 65536 // 4
    ring, a2a = (cp_plan.buffer_bytes(shape, T, 4, 1, 2, i) for i in ("ring", "a2a"))
    assert ring == 3 * T * 512 * 2 + 2 * T * 512 * 4 + T * 1024 * 4 and a2a == 2 * T * (2 * 1024 + 512) * 2


def test_ring_and_a2a_bytes():
    """The ring carries the KV heads (GQA: never repeated copies; split over TP where they divide) N-1 times
    forward, N-2 times again (forward kept the first it received) and the fp32 dK/dV N-1 times backward; MLA
    carries its latent; Ulysses moves (N-1)/N of q, k, v and the output each way."""
    gqa = ModelShape.from_config(_cfg(4096))  # 16 heads of 64, 4 KV heads
    assert cp_plan.kv_elems(gqa, 1) == 4 * 2 * 64 and cp_plan.kv_elems(gqa, 2) == 2 * 2 * 64
    assert cp_plan.kv_elems(gqa, 8) == 4 * 2 * 64  # 4 KV heads over 8 TP ranks: replicated, all sent
    fwd, bwd = cp_plan.ring_bytes(gqa, 1000, 4, 1, 2)
    assert fwd == 3 * 1000 * 512 * 2 and bwd == 2 * 1000 * 512 * 2 + 3 * 1000 * 512 * 4
    assert cp_plan.ring_bytes(gqa, 1000, 1, 1, 2) == (0.0, 0.0)
    # the first received block, kept per attention layer for the backward: the ring's alone, and only under CP
    assert cp_plan.saved_bytes(gqa, 1000, 4, 1, 2, "ring") == 1000 * 512 * 2
    assert cp_plan.saved_bytes(gqa, 1000, 4, 1, 2, "a2a") == cp_plan.saved_bytes(gqa, 1000, 1, 1, 2, "ring") == 0.0
    fwd, bwd = cp_plan.a2a_bytes(gqa, 1000, 4, 1, 2)
    assert fwd == bwd == 1000 * (2 * 16 * 64 + 4 * 2 * 64) * 2 * 3 / 4
    assert cp_plan.a2a_elems(gqa, 1, 8) == 2 * 16 * 64 + 8 * 2 * 64  # 4 KV heads repeated to 8 for Ulysses
    mla = ModelShape.from_config(load_config(None, [
        "--model.d_model", "7168", "--model.n_heads", "128", "--model.kv_lora_rank", "512", "--model.q_lora_rank",
        "1536", "--model.qk_nope_head_dim", "128", "--model.qk_rope_head_dim", "64", "--model.v_head_dim", "128"]))
    assert cp_plan.kv_elems(mla, 1) == cp_plan.kv_elems(mla, 8) == 576  # the latent, whole on every TP rank
    assert cp_plan.whole_kv_elems(mla) == 128 * (192 + 128)  # what whole K/V would be: 71x the latent
    assert cp_plan.ring_bytes(mla, 1000, 8, 1, 2)[0] == 7 * 1000 * 576 * 2


def test_ring_overlap_and_link():
    """A K/V hop hides behind one block's attention, a dK/dV hop behind the next; the last dK/dV hop behind the own
    block's query chunk [0, c), a quarter of a backward block (exposed when there is nothing to hide behind). CP
    ranks are TP-strided: CP x TP inside a node stays on NVLink, beyond it the group crosses nodes."""
    # forward 3 K/V hops; backward K/V alone, dK/dV batched with the last K/V hop, two dK/dV alone
    assert cp_plan.ring_exposed(1.0, 2.0, 0.0, 4, 10.0) == (0.0, 3 * 1.0 + 1.0 + 3.0 + 2 * 2.0)
    assert cp_plan.ring_exposed(1.0, 2.0, 0.0, 4, 1.25) == (0.5, 11.0)  # the batched pair: 3.0 behind 2.5
    assert cp_plan.ring_exposed(1.0, 2.0, 0.0, 4, 0.0) == (11.0, 11.0)  # nothing to hide behind: all of it
    assert cp_plan.ring_exposed(1.0, 2.0, 0.5, 4, 0.0) == (11.0 + 7 * 0.5, 11.0 + 7 * 0.5)  # 7 messages
    assert cp_plan.ring_exposed(1.0, 2.0, 0.0, 2, 0.0) == (3.0, 3.0)  # cp 2: one K/V hop, one dK/dV hop
    lay = Layout(2, 1, 1, "1f1b", 1, 1, tp=2, cp=4)
    assert cp_plan.placement(lay, "cp", 8) == (False, 0.0)  # ranks 0, 2, 4, 6
    assert cp_plan.placement(dataclasses.replace(lay, tp=4), "cp", 8) == (True, 2 / 3)  # 0, 4 | 8, 12
    cfg = _cfg(65536, 1024, 4)
    intra = predict(cfg, Layout(1, 1, 1, "1f1b", 1, 1, tp=2, cp=4), H100)
    inter = predict(cfg, Layout(1, 1, 1, "1f1b", 1, 1, tp=4, cp=4), H100, PlanOptions(nodes=2))
    assert intra.links["cp"] == "intra" and inter.links["cp"] == "inter"
    # at 64k tokens the ring hides behind the attention on NVLink; on a CPU profile (gloo: host work) nothing hides
    assert intra.costs["cp"] < 0.01 * intra.costs["compute"]
    cpu = predict(cfg, Layout(1, 1, 1, "1f1b", 1, 1, cp=4), get_hardware("cpu"))
    link = get_hardware("cpu").intra
    shape = ModelShape.from_config(cfg)
    fwd, bwd = cp_plan.ring_bytes(shape, 65536 // 4, 4, 1, 2)
    assert cpu.costs["cp"] >= cfg.model.n_layers * (fwd + bwd) / link.p2p_bw


def test_search_picks_cp_where_the_sequence_does_not_fit_otherwise():
    """16 GPUs on 2 nodes, one 1.5M-token sequence a step: no layout keeping the sequence whole fits (TP stays in a
    node: at most 8 ways), CP splits it 16 ways (across nodes) and does. At 2k tokens and 16 sequences CP loses."""
    long = plan(_cfg(1572864, 4096, 8, "--train.activation_checkpointing", "true"), 16, H100,
                PlanOptions(global_batch=1))
    whole = [p for p in long if p.layout.cp == 1]
    assert whole and not any(p.fits for p in whole)
    assert long[0].fits and long[0].layout.cp > 1 and long[0].layout.cp * long[0].layout.tp == 16
    short = plan(_cfg(2048, 1024, 4, "--train.activation_checkpointing", "true"), 8, H100,
                 PlanOptions(global_batch=16))
    assert any(p.layout.cp > 1 for p in short) and short[0].fits and short[0].layout.cp == 1


def test_cp_degrees_and_refusals():
    """The search tries the CP degrees that cut the sequence into 2*cp equal chunks, and the runtime's rules refuse
    the rest (experts folded over ep*cp*tp; a2a needs cp to divide the heads)."""
    assert cp_plan.degrees(16, 48) == [1, 2, 4, 8]  # 48 % 32 != 0
    cfg = _cfg(4096)
    assert refusal(cfg, Layout(1, 1, 1, "1f1b", 1, 1, cp=4)) is None
    assert "num_experts" in refusal(cfg, Layout(1, 1, 8, "1f1b", 1, 1, cp=4))
    a2a = _cfg(4096, 1024, 4, "--parallel.cp_impl", "a2a", "--model.num_experts", "64")
    assert refusal(a2a, Layout(1, 1, 1, "1f1b", 1, 1, tp=2, cp=4)) is None  # 2 KV heads repeated to 4
    assert "cp_impl=a2a" in refusal(a2a, Layout(1, 1, 1, "1f1b", 1, 1, tp=2, cp=16))  # 8 heads a TP rank
    assert "seq_len" in refusal(_cfg(48), Layout(1, 1, 1, "1f1b", 1, 1, cp=16))


DEEPSEEK_V3_128K = ["--model.vocab_size", "129280", "--data.vocab_size", "129280", "--model.d_model", "7168",
                    "--model.n_layers", "61", "--model.n_heads", "128", "--model.ffn_dim", "2048",
                    "--model.num_experts", "256", "--model.top_k", "8", "--model.first_k_dense", "3",
                    "--model.dense_ffn_dim", "18432", "--model.shared_experts", "1", "--model.q_lora_rank", "1536",
                    "--model.kv_lora_rank", "512", "--model.qk_nope_head_dim", "128", "--model.qk_rope_head_dim",
                    "64", "--model.v_head_dim", "128", "--model.n_group", "8", "--model.topk_group", "4",
                    "--model.router_score", "sigmoid", "--model.mtp_layers", "1", "--train.seq_len", "131072",
                    "--model.max_seq_len", "131072", "--train.dtype", "bf16", "--parallel.pp_layers", "auto"]


def test_what_if_deepseek_v3_at_128k_splits_the_sequence():
    """docs/plans/deepseek-v3-128k-h800.md, its search narrowed to the plan's ZeRO-1, m 1 and TP 8 (the whole search:
    9,664 layouts, the same answer): 480 sequences of 128k tokens on 2,048 H800s. Whole sequences fit only at TP 8
    with 16 pipeline stages, a rank's 1F1B holding up to 16 microbatches of 128k tokens; CP shares each sequence's
    tokens over the ranks of 8 and wins by more than 30%, its ring (MLA's latent, over InfiniBand) hidden behind the
    attention."""
    from nanotitan.config.hf_config import resolve_model
    from nanotitan.plan.fit.interval import load_sigmas
    from nanotitan.plan.whatif import format_what_if, what_if

    cfg = resolve_model(load_config(None, DEEPSEEK_V3_128K))
    opts = PlanOptions(zero=1, micro_batch=1, tp=8, nodes=256, global_batch=480, activation_checkpointing=True)
    r = what_if(cfg, 2048, get_hardware("h800"), opts, load_sigmas(None), dry_run=False)
    best, whole = r["best"], r["without_cp"]
    assert r["fits"] and best["cp"] > 1 and whole is not None
    assert whole["tokens_per_sec"] < 0.77 * best["tokens_per_sec"]
    assert best["costs_s"]["cp"] < 0.01 * best["step_time_s"]  # the ring hides behind the attention
    assert "context parallel: the fastest layout with whole sequences" in format_what_if(r)


def test_dry_run_at_dp2_cp2_ep2_matches_the_planner():
    """`nanotitan plan --dry-run` builds a DP2·CP2·EP2 rank with the real CP code (the ring's P2P and the EP
    all-to-all on the fake process group, each CP rank's own chunks): parameters and gradients exact, the optimizer
    state but for AdamW's step counters (43 tensors: 172 bytes), the peak within 2% of the planner's, and about half the CP-free DP2·EP2 rank's activations."""
    from nanotitan.plan.dryrun import compare_with_planner, dry_run

    cpu = get_hardware("cpu")
    rows = {}
    for cp, world in ((2, 8), (1, 4)):
        cfg = load_config("configs/default.toml", ["--parallel.dp", "2", "--parallel.pp", "1", "--parallel.ep", "2",
                                                   "--parallel.cp", str(cp), "--train.seq_len", "1024",
                                                   "--model.max_seq_len", "1024"])
        (row,) = compare_with_planner(dry_run(cfg, world), cpu)
        assert row["ranks"] == world
        assert row["gap_param_bytes"] == row["gap_grad_bytes"] == 0.0
        assert 0 <= row["optim_bytes"] - row["planned_optim_bytes"] <= 4 * 64  # AdamW's step counters, no more
        assert abs(row["gap_peak_bytes"]) < 0.02, row
        rows[cp] = row
    assert 1.7 < rows[1]["peak_bytes"] / rows[2]["peak_bytes"] < 2.0


def test_measured_expert_load_prices_the_busiest_cp_rank():
    """PlanOptions.expert_load (a run's busiest rank's received assignments over the mean) replaces the skew
    model: 1.0 is the balanced router, and each extra mean's worth adds the rank's T tokens of received bytes
    (K (D + 4F) per token and MoE layer) to its activations (docs/cp.md "Long context": within 1.3% measured)."""
    cfg, cpu = _cfg(4096, 256, 4, "--train.dtype", "fp32"), get_hardware("cpu")
    lay = Layout(1, 1, 1, "1f1b", 1, 1, cp=4)
    act = lambda **o: predict(cfg, lay, cpu, PlanOptions(**o)).mem_parts["activations"]  # noqa: E731
    assert act(expert_load=1.0) == act(expert_skew=0.0)
    shape = ModelShape.from_config(cfg)
    fp32 = Precision(param=4, grad=4, master=0, moments=8, act=4)
    per_token = sum(shape.received_bytes(i, fp32) for i in range(cfg.model.n_layers))
    assert act(expert_load=2.0) - act(expert_load=1.0) == pytest.approx(4096 / 4 * per_token)
