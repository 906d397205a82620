"""The equivalence rule (DESIGN §4) with every router/balancing option on at once: sigmoid scores, aux-loss-free
bias updates, the sequence-wise balance loss, the z-loss and capacity factor 1.0 (assignments do drop).

DP2 (with activation checkpointing: recomputes must not count twice), EP2, PP2 under both schedules and
DP2 x PP2 x EP2 each train 10 steps on real gloo processes at the reference's global batch and must match the
single process: losses to 1e-5 relative per step, final parameters (each rank against its slice), replicas
bitwise, and the router biases after 10 steps bitwise equal to the reference's on every rank (the update is
from the step's global counts: all data ranks, all microbatches, each layer on its own stage). The records
(tokens per expert, dropped fraction, bias) must match too. Two launches (2 and 8 ranks); their run dirs
also feed `nanotitan plot`.
"""

import torch

from nanotitan import cli
from tests.helpers.mp import run_ranks, train_once
from tests.helpers.equivalence import base_args, check_case, layout_args

OPTIONS = ["--model.router_score", "sigmoid", "--model.routed_scale", "1.5", "--model.bias_update_rate", "0.01",
           "--model.aux_scope", "sequence", "--model.z_loss_coef", "1e-3", "--model.capacity_factor", "1.0"]
RECORD_KEYS = ("expert_load", "dropped_frac", "router_bias")


def _run_cases(rank, world, cases, corpus_dir, run_root):
    return [train_once(base_args(corpus_dir, f"{run_root}/{world}_{i}") + layout_args(*case) + OPTIONS)
            for i, case in enumerate(cases)]


def _records(out: dict) -> list[dict]:
    return [{k: r[k] for k in RECORD_KEYS} for r in out["records"]]


def _check(world, cases, corpus_dir, tmp_path, ref, timeout):
    results = run_ranks(_run_cases, world, args=(cases, str(corpus_dir), str(tmp_path)), timeout=timeout,
                        pg_timeout=120)
    for i, case in enumerate(cases):
        ranks = [results[r][i] for r in range(world)]
        check_case(f"{case}", ranks, ref)
        for r in ranks:
            for key, bias in r["biases"].items():
                assert torch.equal(bias, ref["biases"][key]), f"{case} rank {r['coords']}: layer {key} bias " \
                                                              f"{bias.tolist()} vs {ref['biases'][key].tolist()}"
        assert _records(ranks[0]) == _records(ref), f"{case}: load / dropped / bias records differ"


def test_router_options_every_layout(corpus_dir, tmp_path):
    torch.set_num_threads(1)
    ref = train_once(base_args(corpus_dir, tmp_path / "ref") + layout_args(1, 1, 1) + OPTIONS)
    # The options must be live, or the comparison proves nothing: the biases moved, assignments dropped.
    assert all(any(any(rec["router_bias"][layer]) for rec in ref["records"]) for layer in range(len(ref["biases"])))
    assert all(r["dropped_frac"] > 0 for r in ref["records"])
    _check(2, [(2, 1, 1, "1f1b", ("--train.activation_checkpointing", "true")), (1, 1, 2),
               (1, 2, 1, "gpipe"), (1, 2, 1, "1f1b")], corpus_dir, tmp_path / "w2", ref, timeout=300)
    _check(8, [(2, 2, 2, "1f1b")], corpus_dir, tmp_path / "w8", ref, timeout=300)

    # `nanotitan plot` on two of these runs (no launch of its own): every picture written, a bad dir refused.
    out = tmp_path / "plots"
    assert cli.main(["plot", str(tmp_path / "ref"), str(tmp_path / "w8" / "8_0"), "--out", str(out)]) == 0
    names = {"loss.png", "throughput.png", "expert_load_ref.png", "expert_load_8_0.png"}
    assert {p.name for p in out.iterdir()} == names
    for name in names:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(["plot", str(tmp_path)]) == 2  # no metrics.jsonl there
