"""The equivalence matrix's DeepSeek-V3 rows (issue 40, DESIGN §4): a tiny DeepSeek-V3-shaped model trains in every
layout what one process trains.

The model: MLA with a query low rank and YaRN, 1 dense + 2 MoE layers (first_k_dense) with a shared expert,
group-limited routing (4 experts in 2 groups, 1 group kept), sigmoid scores with the aux-free selection bias, a
sequence-wise balance loss and one multi-token-prediction module (model/mtp.py; its block is MoE too).
One 8-rank launch runs DP2·PP2·EP2 under 1F1B with activation checkpointing, and under zb1 (deferred weight
gradients) with EP lanes (parallel.ep_overlap_microbatches); DP4·EP2 at zero 1; DP4·EP2 at zero 3 resumed from
the 1F1B run's step-5 checkpoint (PP's two embedding copies -> one sharded table); and DeepSeek-V3's own layout,
DP2·PP2·EP2 with ZeRO DP, at zero 1 (1F1B), zero 2 (zb1) and zero 3 (1F1B), the two embedding copies' gradient
shards summed by pair; then one process resumes from the zero-3 run's step-7 checkpoint. (Rows share runs to keep
the suite's time: each option rides with another.) Each is held to tests/helpers/equivalence.py's bar
against the single-process reference: losses per step to fp32 relative 1e-5, final parameters, replicas bitwise
identical, router biases bitwise; the last stage's embedding replica (parallel/tied.py) bitwise stage 0's table.
"""

import pytest
import torch

from tests.helpers.mp import run_ranks, train_once
from tests.helpers.equivalence import STEPS, base_args, check_case, layout_args

CKPT, CKPT2 = 5, 7
DEEPSEEK = ["--model.n_layers", "3", "--model.first_k_dense", "1", "--model.shared_experts", "1",
            "--model.kv_lora_rank", "16", "--model.q_lora_rank", "12", "--model.qk_nope_head_dim", "8",
            "--model.qk_rope_head_dim", "4", "--model.v_head_dim", "8", "--model.n_group", "2", "--model.topk_group", "1",
            "--model.router_score", "sigmoid", "--model.routed_scale", "2.5", "--model.bias_update_rate", "1e-3",
            "--model.aux_scope", "sequence", "--model.aux_coef", "0.01", "--model.rope_scaling", "yarn",
            "--model.rope_factor", "2", "--model.rope_original_max_len", "8", "--model.rope_mscale_all_dim", "1",
            "--model.mtp_layers", "1", "--model.mtp_coef", "0.3"]
NO_CKPT = ("--train.ckpt_at_end", "false")
LANES = ("--parallel.ep_overlap_microbatches", "true")
AC = ("--train.activation_checkpointing", "true")


def _args(corpus_dir, run_dir, case, resume="") -> list[str]:
    dp, pp, ep, schedule, extra = case
    more = ["--train.resume", resume] if resume else []
    return base_args(corpus_dir, run_dir) + DEEPSEEK + layout_args(dp, pp, ep, schedule, extra) + more


def _ck(run_dir, step=CKPT) -> str:
    return f"{run_dir}/checkpoints/step_{step}"


# (name, (dp, pp, ep, schedule, extra), resume from the run named)
CASES = [
    ("222_1f1b_ac", (2, 2, 2, "1f1b", (*AC, "--train.ckpt_every", str(CKPT), *NO_CKPT)), None),
    ("222_zb1_lanes", (2, 2, 2, "zb1", (*LANES, *NO_CKPT)), None),
    ("412_zero1", (4, 1, 2, "1f1b", ("--parallel.zero", "1", *NO_CKPT)), None),
    ("412_zero3_from_222", (4, 1, 2, "1f1b", ("--parallel.zero", "3", "--train.ckpt_every", str(CKPT2), *NO_CKPT)),
     "222_1f1b_ac"),
    # DeepSeek-V3's own layout, PP with ZeRO DP, MTP's embedding tied across the stages at every zero level
    ("222_zero1", (2, 2, 2, "1f1b", ("--parallel.zero", "1", *NO_CKPT)), None),
    ("222_zb1_zero2", (2, 2, 2, "zb1", ("--parallel.zero", "2", *NO_CKPT)), None),
    ("222_zero3", (2, 2, 2, "1f1b", ("--parallel.zero", "3", *NO_CKPT)), None),
]


def _run(rank, world, cases, corpus_dir, run_root):
    return [train_once(_args(corpus_dir, f"{run_root}/{name}", case,
                             resume=_ck(f"{run_root}/{src}") if src else "")) for name, case, src in cases]


def _worst(ranks: list[dict], ref: dict) -> float:
    """The row's largest relative loss difference from the reference (printed: the closing notes quote it)."""
    recs = next(r["records"] for r in ranks if r["records"])
    want = {r["step"]: r["loss"] for r in ref["records"]}
    return max(abs(r["loss"] - want[r["step"]]) / abs(want[r["step"]]) for r in recs)


def _check_tied(name, ranks: list[dict]):
    """The MTP's embedding replica on the last stage is bitwise stage 0's table."""
    tables = {r["coords"]: r["params"]["tok_emb.weight"][0] for r in ranks if "tok_emb.weight" in r["params"]}
    first = [t for (d, p, e), t in tables.items() if p == 0]
    last = [t for (d, p, e), t in tables.items() if p > 0]
    assert first and all(torch.equal(t, first[0]) for t in first + last), f"{name}: embedding copies differ"
    return len(last)


def _check_resumed(name, ranks: list[dict], ref: dict, start: int):
    """A run resumed at step `start`: steps start+1..STEPS against the reference's, and its final params
    (check_case, with the reference's own losses standing in for the steps before the resume)."""
    recs = next(r["records"] for r in ranks if r["records"])
    assert [r["step"] for r in recs] == list(range(start + 1, STEPS + 1)), f"{name}: logged {len(recs)} steps"
    losses = ref["losses"][:start] + [r["loss"] for r in recs]
    check_case(name, [{**r, "losses": losses if r["records"] else []} for r in ranks], ref)


@pytest.mark.timeout(1200)
def test_deepseek_matrix(corpus_dir, tmp_path):
    torch.set_num_threads(1)
    ref = train_once(_args(corpus_dir, tmp_path / "ref", (1, 1, 1, "1f1b", NO_CKPT)))
    recs = ref["records"]
    assert all("mtp_loss" in r and r["mtp_loss"] > 0 for r in recs), "the reference logs its MTP loss"
    assert "3" in ref["biases"] and any(".attn.kv_b_proj." in n for n in ref["params"])  # MTP's MoE block, MLA
    results = run_ranks(_run, 8, args=(CASES, str(corpus_dir), str(tmp_path)), timeout=800, pg_timeout=120)
    for i, (name, case, src) in enumerate(CASES):
        ranks = [results[r][i] for r in range(8)]
        print(f"{name}: worst relative loss difference {_worst(ranks, ref):.2e}")
        if src:
            _check_resumed(name, ranks, ref, CKPT)
        else:
            check_case(name, ranks, ref)
            rec = next(r["records"] for r in ranks if r["records"])
            for a, b in zip(rec, recs):  # the MTP loss is the reference's too
                assert abs(a["mtp_loss"] - b["mtp_loss"]) <= 1e-5 * b["mtp_loss"], f"{name}: mtp_loss"
        for r in ranks:
            for key, bias in r["biases"].items():
                assert torch.equal(bias, ref["biases"][key]), f"{name} rank {r['coords']}: layer {key} bias"
        if case[1] > 1:
            assert _check_tied(name, ranks) == 4, f"{name}: every last-stage rank holds the replica"
    # One process reads the zero-3 DP4·EP2 checkpoint (sharded table, sharded experts) and finishes the run.
    resumed = train_once(_args(corpus_dir, tmp_path / "111_from_412", (1, 1, 1, "1f1b", NO_CKPT),
                               resume=_ck(tmp_path / "412_zero3_from_222", CKPT2)))
    _check_resumed("111_from_412_zero3", [resumed], ref, CKPT2)
    print(f"111_from_412_zero3: worst relative loss difference {_worst([resumed], ref):.2e}")
