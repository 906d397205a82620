"""The equivalence matrix with tensor parallel (DESIGN §4, docs/tp.md): every layout with TP trains the same model
as one process, losses per step to fp32 relative 1e-5 and final parameters (each rank's TP slice, and its folded
experts, against the reference's). One launch per world size runs several layouts."""

import math

import pytest
import torch

from tests.helpers.mp import run_ranks
from tests.helpers.equivalence import B, base_args, bf16_bound, max_rel_dev
from tests.helpers.equivalence import check_tp_case, short_refs, train_tp
from tests.helpers.equivalence import BF16, CAP, DEEPSEEK, OPTIONS, short_layout


def _run_cases(rank, world, cases, corpus_dir, run_root):
    return [train_tp(base_args(corpus_dir, f"{run_root}/{world}_{i}") + short_layout(*case))
            for i, case in enumerate(cases)]


# OPTIONS with OLMoE's q/k norms over the whole projections (one all-reduce of sums of squares each under TP; 2 KV
# heads: split over TP2, replicated over TP4, where the k norm is whole on every rank) and its unnormalised top-k
OLMOE = (*("full" if f == "head" else f for f in OPTIONS), "--model.norm_topk", "false")


# The one-process references, by the model options their rows train
MODELS = {"fp32": (), "bf16": BF16, "options": OPTIONS, "deepseek": DEEPSEEK, "capacity": CAP, "olmoe": OLMOE}


@pytest.fixture(scope="module")
def refs(corpus_dir, tmp_path_factory):
    """refs(name): the reference of MODELS[name], run once, when a test first asks for it."""
    return short_refs(corpus_dir, tmp_path_factory, MODELS, "tp")


def model_of(extra) -> str:
    """The MODELS entry a row's extra flags train."""
    return ("bf16" if "bf16" in extra else "olmoe" if "full" in extra else "options" if OPTIONS[0] in extra
            else "deepseek" if DEEPSEEK[2] in extra
            else "capacity" if CAP[0] in extra else "fp32")


def tp_matrix(world: int, cases: list, corpus_dir, tmp_path, refs, timeout: float) -> None:
    """Every case of `cases` on one launch of `world` ranks, each held to the reference of its model (`model_of`):
    within the bf16 bound when it trains in bf16, else to fp32 relative 1e-5 (`check_tp_case`)."""
    want = {name: refs(name) for name in {model_of(case[4] if len(case) > 4 else ()) for case in cases}}
    per_rank = run_ranks(_run_cases, world, args=(cases, str(corpus_dir), str(tmp_path)), timeout=timeout,
                         pg_timeout=120)
    for case, ranks in zip(cases, zip(*per_rank)):
        extra = case[4] if len(case) > 4 else ()
        ref = want[model_of(extra)]
        print(f"TP row {case[:4]} {' '.join(extra)}: worst loss error "  # the closing note's figures (pytest -s)
              f"{max_rel_dev(ranks[0]['losses'], ref['losses']):.1e}")
        if "bf16" in extra:
            for r in ranks:
                assert not r["losses"] or max_rel_dev(r["losses"], ref["losses"]) <= bf16_bound(), case
            # the eval through the TP model: each TP rank of the last stage holds the same sum, counted once
            val = next(r["val_loss"] for r in ref["records"] if "val_loss" in r)
            assert abs(ranks[0]["val"] - val) <= bf16_bound() * abs(val), (case, ranks[0]["val"], val)
        else:
            check_tp_case(str(case), list(ranks), ref)
        if CAP[0] in extra:  # capacity drops under TP what one process drops: the same share, every step
            drops = [r.get("dropped_frac") for r in ref["records"]]
            print(f"  dropped_frac per step {[round(d, 4) for d in drops]}")
            assert ranks[0]["dropped"] == drops and all(drops), (case, ranks[0]["dropped"], drops)


@pytest.mark.timeout(900)
def test_world2_tp(corpus_dir, tmp_path, refs):
    """TP2 with and without SP (experts folded over the two TP ranks); with activation checkpointing, on the CAP
    model (capacity's all-gather recomputed in the backward) under parallel.ep_overlap's chunked trips (2 local
    experts a rank, 2 groups); the OPTIONS, OLMOE and DEEPSEEK (MTP, capacity) models; bf16."""
    cases = [(1, 1, 1, 2), (1, 1, 1, 2, ("--parallel.sp", "false")),
             (1, 1, 1, 2, (*CAP, "--train.activation_checkpointing", "true", "--parallel.ep_overlap", "true")),
             (1, 1, 1, 2, OPTIONS), (1, 1, 1, 2, DEEPSEEK), (1, 1, 1, 2, BF16), (1, 1, 1, 2, OLMOE)]
    tp_matrix(2, cases, corpus_dir, tmp_path, refs, timeout=900)


@pytest.mark.timeout(1200)
def test_world4_tp(corpus_dir, tmp_path, refs):
    """DP2*TP2 at zero 0, 1 and 3; PP2*TP2 with 1F1B, and with zb1 on the DEEPSEEK model (MTP on the last stage,
    its embedding replica vocab-sliced; deferred weight gradients); EP2*TP2 (experts over 4 ranks) on the CAP
    model; TP4 with the OLMOE model (OPTIONS' 2 KV heads replicated over 4 ranks, the k norm whole on each) and the
    DEEPSEEK one without SP (one MLA head a rank; MTP's padded tail on the last rank only)."""
    cases = [(2, 1, 1, 2), (2, 1, 1, 2, ("--parallel.zero", "1")), (2, 1, 1, 2, ("--parallel.zero", "3")),
             (1, 2, 1, 2, ("--parallel.schedule", "1f1b")), (1, 2, 1, 2, (*DEEPSEEK, "--parallel.schedule", "zb1")),
             (1, 1, 2, 2, CAP), (1, 1, 1, 4, OLMOE), (1, 1, 1, 4, (*DEEPSEEK, "--parallel.sp", "false"))]
    tp_matrix(4, cases, corpus_dir, tmp_path, refs, timeout=1200)


@pytest.mark.timeout(900)
def test_world8_tp(corpus_dir, tmp_path, refs):
    """DP2*PP2*TP2 at zero 1."""
    tp_matrix(8, [(2, 2, 1, 2, ("--parallel.zero", "1"))], corpus_dir, tmp_path, refs, timeout=900)


def test_capacity_ranking_across_tp_shards():
    """MoE._capacity_keep under TP keeps on each rank exactly its part of one process's kept set: rank r holds
    positions [r*S/N, (r+1)*S/N) of each sequence, MTP's tail (model/mtp.py) routes nothing, and its all-gather of
    (weight, id) pairs is played here by the pairs of every rank (checked to be what each rank sends). Ties of
    weight (one column equal) go to the lower token index across ranks, as in one process."""
    from nanotitan.model.moe import MoE, capacity_keep
    from nanotitan.parallel.tp import TPShard

    class Played(TPShard):  # rank r's token shard, its all-gather played by every rank's pairs
        def gather(self, t, dim):
            assert dim == 1 and torch.equal(t, pairs[:, self.rank * shard:(self.rank + 1) * shard]), "what a rank sends"
            return pairs

    g = torch.Generator().manual_seed(0)
    B, S, K, E, n, cf = 3, 8, 2, 4, 4, 0.75
    shard = S // n
    for tail in (0, 1, 3):
        whole = S - tail
        ids = torch.rand(B, whole, E, generator=g).argsort(-1)[..., :K]  # K distinct experts a token
        w = torch.rand(B, whole, K, generator=g)
        w[:, :, 1] = 0.25
        want = capacity_keep(ids.reshape(-1, K), w.reshape(-1, K), E, math.ceil(cf * B * whole * K / E))
        want = want.view(B, whole, K)
        assert (~want).any() and want.any()
        pairs = torch.zeros(B, S, K, 2)
        pairs[..., 1] = E
        pairs[:, :whole] = torch.stack([w, ids.float()], -1)
        for r in range(n):
            own = min(shard, max(0, whole - r * shard))
            moe = MoE(8, 8, E, K, True, 0, E, capacity_factor=cf, tokens=Played(None, r, n, True))
            moe.seq_tail = tail
            part = slice(r * shard, r * shard + own)
            got = moe._capacity_keep(ids[:, part].reshape(-1, K), w[:, part].reshape(-1, K), B, own, whole)
            assert torch.equal(got, want[:, part].reshape(-1, K)), (tail, r)
