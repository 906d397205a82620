"""The equivalence matrix under train.optimizer=muon (issue 51, DESIGN §4): Muon's orthogonalization needs whole
matrices, so every layout that slices them (ZeRO 1/2 flat shards, FSDP2 rows, TP slices) gathers each on an owner
(optim/owners.py); every layout trains what one process running Muon trains: losses per step to fp32 relative 1e-5
over 10 steps, final parameters (each rank's TP slice and experts against the reference's), replicas bitwise.
Every row also checks that the geometry each rank computes from the sharding rules (optim/geometry.py), and the
owner plan made of it, are the all-gathered ones (`same_geometry_as_gathered`).

Two launches: 2 ranks run DP2 at zero 0/1/2/3, TP2, EP2, PP2 under 1F1B and zb1, and TP2 resumed from the
zero-1 run's step-5 checkpoint (the momentum resharded from flat shards into TP slices); 8 ranks run DP2·PP2·EP2
(zero 1), DP2·TP2·EP2 at zero 3, and a DeepSeek-V3-shaped model (MLA with a q latent, a dense first layer, a shared expert,
sigmoid routing with the aux-free bias, MTP) at DP2·PP2·EP2 under zb1 at zero 2 with QK-clip (only MLA's
head-specific parts scaled); the 2-rank launch also runs QK-clip under TP2 and DP2 zero 3, and DP2 zero 1 with
Newton-Schulz in bf16 (train.muon_ns_dtype, at its own bound: NS_BF16_BOUND). A clipped row is also held
to the reference's per-step qk_max, and must differ from the unclipped run.
"""

import pytest
import torch

from tests.helpers.equivalence import B, LR, STEPS, base_args, max_rel_dev, one_process
from tests.helpers.mp import run_ranks

m = 4  # microbatches of 4 (the main matrix's 2): half the microbatches a step, the same B sequences
# ZeRO buckets of 3 attention matrices, so flat shards cut matrices (25 MiB ones split this model between layers)
MUON = ("--train.optimizer", "muon", "--train.muon_lr", "0.01", "--train.ckpt_at_end", "false",
        "--train.micro_batch", str(m), "--parallel.bucket_mb", "0.012")
DEEPSEEK = ("--model.n_layers", "3", "--model.first_k_dense", "1", "--model.shared_experts", "1",
            "--model.kv_lora_rank", "16", "--model.q_lora_rank", "12", "--model.qk_nope_head_dim", "8",
            "--model.qk_rope_head_dim", "4", "--model.v_head_dim", "8", "--model.router_score", "sigmoid",
            "--model.bias_update_rate", "1e-3", "--model.mtp_layers", "1", "--model.mtp_coef", "0.3")
Z = "--parallel.zero"
# QK-clip at a TAU the tiny models' logits top from step 1 (their max is ~0.05 at init): every step rescales heads
QK = ("--train.qk_clip", "0.03")
QK_DS = ("--train.qk_clip", "0.02")
# Newton-Schulz in bf16 (train.muon_ns_dtype): its rounding of each gathered momentum turns the layouts' fp32
# reduction-order differences (~1e-7) into whole bf16 steps of the update, so its row is held to the loss bound
# below against one process running bf16 NS too (measured 1.1-1.3e-5 over 10 steps, docs/optim.md). Like the bf16
# matrix (test_equivalence_bf16.py) it is held on its losses, not element-wise on its parameters: a flipped bf16
# rounding moves an orthogonalized update's entries by whole bf16 steps (measured up to 7e-4 absolute, 2% of
# LR x STEPS, where fp32 NS holds 1e-3 of it); its replicas must still be bitwise equal
NS_BF16, NS_BF16_BOUND = ("--train.muon_ns_dtype", "bf16"), 1e-4

# (name, dp, pp, ep, tp, schedule, extra)
CKPT = 5
WORLD2 = [("dp2_zero0", 2, 1, 1, 1, "1f1b", ()), ("dp2_zero1", 2, 1, 1, 1, "1f1b", (Z, "1", "--train.ckpt_every", "5")),
          ("dp2_zero2", 2, 1, 1, 1, "1f1b", (Z, "2")), ("dp2_zero3", 2, 1, 1, 1, "1f1b", (Z, "3")),
          ("tp2", 1, 1, 1, 2, "1f1b", ()), ("ep2", 1, 1, 2, 1, "1f1b", ()),
          ("pp2_1f1b", 1, 2, 1, 1, "1f1b", ()), ("pp2_zb1", 1, 2, 1, 1, "zb1", ()),
          ("tp2_from_dp2_zero1", 1, 1, 1, 2, "1f1b", ()),
          ("tp2_qkclip", 1, 1, 1, 2, "1f1b", QK), ("dp2_zero3_qkclip", 2, 1, 1, 1, "1f1b", (Z, "3", *QK)),
          ("dp2_zero1_ns_bf16", 2, 1, 1, 1, "1f1b", (Z, "1", *NS_BF16))]
# a row resumed from another's step-CKPT checkpoint: Muon's momentum, saved as flat ZeRO-1 shards, read into TP slices
RESUMES = {"tp2_from_dp2_zero1": "dp2_zero1"}
WORLD8 = [("dp2pp2ep2_zero1", 2, 2, 2, 1, "1f1b", (Z, "1")), ("dp2tp2ep2_zero3", 2, 1, 2, 2, "1f1b", (Z, "3")),
          ("deepseek_qkclip_dp2pp2ep2_zb1_zero2", 2, 2, 2, 1, "zb1", (Z, "2", *DEEPSEEK, *QK_DS))]


def layout(dp=1, pp=1, ep=1, tp=1, schedule="1f1b", extra=()) -> list[str]:
    return ["--parallel.dp", str(dp), "--parallel.pp", str(pp), "--parallel.ep", str(ep), "--parallel.tp", str(tp),
            "--parallel.microbatches", str(B // (dp * ep * m)), "--parallel.schedule", schedule, *MUON, *extra]


def train_muon(args: list[str]) -> dict:
    """One run: rank 0's losses, this rank's params {name: (tensor, first expert or None, TP dim or None)}, the
    rank's TP place, and its last step's Newton-Schulz seconds."""
    from nanotitan.config.config import load_config
    from nanotitan.model.transformer import is_expert_param
    from nanotitan.parallel.tp import tp_shard_dim
    from nanotitan.train import Trainer
    from tests.helpers.whole_state import whole_state

    trainer = Trainer(load_config(None, args))
    try:
        history = trainer.train()["history"]
        losses, qk = [r["loss"] for r in history], [r.get("qk_max") for r in history]
        live, start = dict(trainer.shard.model.named_parameters()), trainer.shard.spec.expert_start
        held, _ = whole_state(trainer.shard.sync)
        params = {n: (t.detach().clone(), start if is_expert_param(n) else None, tp_shard_dim(live[n]))
                  for n, t in held.items()}
        traffic = trainer.optimizer.orthogonalizer.plan.traffic
        same_geometry_as_gathered(trainer.optimizer)
    finally:
        trainer.shard.close()
    d = trainer.dims
    return {"losses": losses, "qk_max": qk, "params": params, "tp": (d.tp_rank, d.tp), "coords": d.coords(),
            "traffic": traffic}


def same_geometry_as_gathered(opt) -> None:
    """The geometry every rank computed from the sharding rules (optim/geometry.py) is the all-gathered one, and so
    is the plan made of it: the same owners, the same traffic, box for box (collective: every rank calls it)."""
    from nanotitan.optim.owners import Orthogonalizer

    ours = opt.orthogonalizer
    gathered = Orthogonalizer(opt.pieces(opt), opt._momenta(), opt.group, opt.ns_steps)  # geometry None: exchanged
    rows = [[{k: sorted(v) for k, v in row.items() if v} for row in o.geometry[1]] for o in (ours, gathered)]
    assert ours.geometry[0] == gathered.geometry[0] and rows[0] == rows[1], "computed geometry is not the gathered"
    assert ours.plan == gathered.plan and ours.batches == gathered.batches, "computed geometry: another plan"


def _cases(rank, world, cases, corpus_dir, run_root):
    resume = {n: ["--train.resume", f"{run_root}/{src}/checkpoints/step_{CKPT}"] for n, src in RESUMES.items()}
    return [train_muon(base_args(corpus_dir, f"{run_root}/{name}") + layout(*case) + resume.get(name, []))
            for name, *case in cases]


def _held_part(whole: torch.Tensor, t: torch.Tensor, start, dim, tp) -> torch.Tensor:
    """The part of the reference's `whole` a rank holds as `t`: its experts from `start`, its TP slice along `dim`."""
    part = whole if start is None else whole[start:start + t.shape[0]]
    return part if dim is None else part.chunk(tp[1], dim=dim)[tp[0]]


def check(name: str, ranks: list[dict], ref: dict, bound: float = 1e-5, params: bool = True) -> float:
    """The row's worst relative loss error, after every check of the bar."""
    want = ref["losses"][CKPT:] if name in RESUMES else ref["losses"]
    assert ranks[0]["losses"] and len(ranks[0]["losses"]) == len(want), f"{name}: rank 0 logged {ranks[0]['losses']}"
    worst = max_rel_dev(ranks[0]["losses"], want)
    assert worst <= bound, f"{name}: worst relative loss error {worst:.2e} > {bound:.0e}"
    replicas = {}
    for r in ranks:
        _, p, e = r["coords"]
        for pname, (t, start, dim) in r["params"].items():
            if params:
                torch.testing.assert_close(t, _held_part(ref["params"][pname][0], t, start, dim, r["tp"]),
                                           rtol=1e-4, atol=1e-3 * LR * STEPS, msg=lambda s: f"{name}: {pname} {s}")
            key = (pname, p, e if start is not None else None, r["tp"][0])
            assert key not in replicas or torch.equal(replicas[key], t), f"{name}: replicas of {pname} differ"
            replicas.setdefault(key, t)
    return worst


@pytest.fixture(scope="module")
def refs(corpus_dir, tmp_path_factory):
    ref = {"plain": layout(), "plain_qk": layout(extra=QK), "deepseek_qk": layout(extra=(*DEEPSEEK, *QK_DS)),
           "plain_nsbf16": layout(extra=NS_BF16)}
    runs = {k: one_process(corpus_dir, tmp_path_factory, f"ref_muon_{k}", v[6:]) for k, v in ref.items()}
    return {k: {**r, "qk_max": [x.get("qk_max") for x in r["records"]]} for k, r in runs.items()}


def model_of(extra) -> str:
    return (("deepseek" if "--model.kv_lora_rank" in extra else "plain") + ("_qk" if QK[0] in extra else "")
            + ("_nsbf16" if NS_BF16[0] in extra else ""))


def _matrix(world, cases, corpus_dir, tmp_path, refs, timeout):
    per_rank = run_ranks(_cases, world, args=(cases, str(corpus_dir), str(tmp_path)), timeout=timeout,
                         pg_timeout=120)
    for (name, *case), ranks in zip(cases, zip(*per_rank)):
        extra = case[-1]
        ref = refs[model_of(extra)]
        bf16_ns = NS_BF16[0] in extra
        worst = check(name, list(ranks), ref, *((NS_BF16_BOUND, False) if bf16_ns else (1e-5, True)))
        assert not bf16_ns or ref["losses"] != refs["plain"]["losses"], f"{name}: bf16 NS trained fp32's losses"
        if QK[0] in extra:  # the clip acted (logits over TAU), the same maxima on every layout, and changed training
            tau = float(extra[extra.index(QK[0]) + 1])
            assert ranks[0]["qk_max"][0] > tau and max_rel_dev(ranks[0]["qk_max"], ref["qk_max"]) <= 1e-5, name
            if "plain" in model_of(extra):  # logits ~0.05 barely move the loss; the q/k weights show the clip
                q = "layers.0.attn.q_proj.weight"
                a, b = ref["params"][q][0], refs["plain"]["params"][q][0]
                assert (a - b).norm() > 0.05 * b.norm(), f"{name}: the clip did nothing to {q}"
        print(f"muon row {name}: worst loss error {worst:.1e}, owner traffic {any(r['traffic'] for r in ranks)}")
        sliced = case[3] > 1 or Z in extra and extra[extra.index(Z) + 1] != "0"  # TP, or ZeRO's shards
        assert not sliced or any(r["traffic"] for r in ranks), f"{name}: slices orthogonalized with no gather"


@pytest.mark.timeout(900)
def test_world2_muon(corpus_dir, tmp_path, refs):
    """DP2 at zero 0-3, TP2, EP2, PP2 (1F1B, zb1) under Muon."""
    _matrix(2, WORLD2, corpus_dir, tmp_path, refs, timeout=600)


@pytest.mark.slow  # the longest launches: CI's second tier (make test-slow)
@pytest.mark.timeout(900)
def test_world8_muon(corpus_dir, tmp_path, refs):
    """DP2·PP2·EP2, DP2·TP2·EP2 at zero 3, and the DeepSeek-V3-shaped model, under Muon."""
    _matrix(8, WORLD8, corpus_dir, tmp_path, refs, timeout=800)
