"""The equivalence matrix with tensor parallel (DESIGN §4, docs/tp.md): every layout with TP trains the same model
as one process, losses per step to fp32 relative 1e-5 and final parameters (each rank's TP slice, and its folded
experts, against the reference's). One launch per world size runs several layouts."""

import math

import pytest
import torch

from tests.helpers.mp import run_ranks
from tests.helpers.equivalence import LR, B, base_args, one_process
from tests.helpers.equivalence import EVAL, bf16_bound, max_rel_dev
from tests.helpers.equivalence import tp_layout


# Shorter than the main matrix (4 steps, microbatches of 4: 4 per step in one process), so the ~20 TP rows fit the
# suite's time; every TP collective still runs forward and backward in each microbatch of each step.
STEPS, m = 4, 4
SHORT = ("--train.steps", str(STEPS), "--train.micro_batch", str(m), "--train.ckpt_at_end", "false")
REF = (*SHORT, "--parallel.microbatches", str(B // m))  # the one-process reference: the same B sequences a step


def short_layout(dp=1, pp=1, ep=1, tp=2, extra=()) -> list[str]:
    return tp_layout(dp, pp, ep, tp, (*SHORT, *extra), micro_batch=m)


def train_tp(args: list[str]) -> dict:
    """train_once's result (helpers/mp.py) plus, per param, the dim its TP slice is cut along and the rank's tp place."""
    from nanotitan.config.config import load_config
    from nanotitan.model.transformer import is_expert_param
    from nanotitan.parallel.tp import tp_shard_dim
    from nanotitan.train import Trainer
    from tests.helpers.whole_state import whole_state

    trainer = Trainer(load_config(None, args))
    try:
        records = trainer.train()["history"]
        full, _ = whole_state(trainer.shard.sync)
        start = trainer.shard.spec.expert_start
        live = dict(trainer.shard.model.named_parameters())
        params = {n: (t.detach().clone(), start if is_expert_param(n) else None, tp_shard_dim(live[n]))
                  for n, t in full.items()}
    finally:
        trainer.shard.close()
    d = trainer.dims
    val = next((r["val_loss"] for r in records if "val_loss" in r), None)  # rank 0's final eval, if any
    return {"losses": [r["loss"] for r in records], "val": val, "params": params, "tp": (d.tp_rank, d.tp),
            "dropped": [r.get("dropped_frac") for r in records]}


def _run_cases(rank, world, cases, corpus_dir, run_root):
    return [train_tp(base_args(corpus_dir, f"{run_root}/{world}_{i}") + short_layout(*case))
            for i, case in enumerate(cases)]


def check_tp_case(name, ranks: list[dict], ref: dict, rel: float = 1e-5):
    for r in ranks:
        for step, (a, b) in enumerate(zip(r["losses"], ref["losses"])):
            assert abs(a - b) <= rel * abs(b), f"{name}: step {step + 1} loss {a} vs reference {b}"
        assert not r["losses"] or len(r["losses"]) == STEPS
        t_rank, n = r["tp"]
        for pname, (t, expert_start, dim) in r["params"].items():
            want = ref["params"][pname][0]
            if expert_start is not None:
                want = want[expert_start:expert_start + t.shape[0]]
            if dim is not None:
                want = want.chunk(n, dim=dim)[t_rank]
            torch.testing.assert_close(t, want, rtol=1e-4, atol=1e-3 * LR * STEPS,
                                       msg=lambda s: f"{name}: {pname} {s}")
        assert n == 1 or any(dim is not None for _, _, dim in r["params"].values()), f"{name}: nothing TP-split"
    assert ranks[0]["losses"], f"{name}: rank 0 logged nothing"


# A second model exercising what the plain one does not: GQA (2 KV heads: split over TP2, replicated over TP4),
# per-head q/k norms, a gated shared expert, the router bias (buffer updated from the TP-summed counts).
OPTIONS = ("--model.n_kv_heads", "2", "--model.qk_norm", "head", "--model.shared_experts", "1",
           "--model.shared_ffn_dim", "16", "--model.shared_expert_gate", "true", "--model.bias_update_rate", "1e-3")
# DeepSeek-V3's shapes in small: MLA with a q latent, sigmoid group-limited routing with the sequence-wise balance
# loss, a dense first layer, a shared expert, one MTP module (model/mtp.py: its MoE block leaves out the padded last
# position; 3 layers + the MTP block cost what the others' 4 layers do); with capacity, so the ranking across TP
# ranks meets that tail too.
DEEPSEEK = ("--model.n_layers", "3", "--model.kv_lora_rank", "16", "--model.q_lora_rank", "12", "--model.qk_nope_head_dim", "8",
            "--model.qk_rope_head_dim", "4", "--model.v_head_dim", "6", "--model.router_score", "sigmoid",
            "--model.n_group", "2", "--model.topk_group", "1", "--model.aux_scope", "sequence",
            "--model.first_k_dense", "1", "--model.shared_experts", "1", "--model.mtp_layers", "1",
            "--model.capacity_factor", "1.0")
# OPTIONS with OLMoE's q/k norms over the whole projections (one all-reduce of sums of squares each under TP; 2 KV
# heads: split over TP2, replicated over TP4, where the k norm is whole on every rank) and its unnormalised top-k
OLMOE = (*("full" if f == "head" else f for f in OPTIONS), "--model.norm_topk", "false")
# Capacity (model/moe.py): 1.0 on the plain model drops assignments in every step (asserted: `tp_matrix`)
CAP = ("--model.capacity_factor", "1.0")
BF16 = ("--train.dtype", "bf16", *EVAL, "--train.eval_every", str(STEPS))


# The one-process references, by the model options their rows train
MODELS = {"fp32": (), "bf16": BF16, "options": OPTIONS, "deepseek": DEEPSEEK, "capacity": CAP, "olmoe": OLMOE}


@pytest.fixture(scope="module")
def refs(corpus_dir, tmp_path_factory):
    """refs(name): the reference of MODELS[name], run once, when a test first asks for it."""
    done = {}

    def get(name: str) -> dict:
        if name not in done:
            done[name] = one_process(corpus_dir, tmp_path_factory, f"ref_tp_{name}", (*REF, *MODELS[name]))
        return done[name]
    return get


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
