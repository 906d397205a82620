"""The equivalence matrix with context parallel (DESIGN §4, docs/cp.md): every layout with CP trains the same model as
one process, losses per step to fp32 relative 1e-5 and final parameters (replicated over CP: each CP rank's are the
reference's, its TP slice and folded experts under TP and EP). One launch per world size runs several layouts, on the
TP matrix's short runs (tests/helpers/equivalence.py: 4 steps, 16 sequences of 16 tokens a step)."""

import pytest

from tests.helpers.mp import run_ranks
from tests.helpers.equivalence import B, base_args, bf16_bound, max_rel_dev
from tests.helpers.equivalence import check_tp_case, short_refs, train_tp
from tests.helpers.equivalence import BF16, CAP, DEEPSEEK, OPTIONS, SHORT_STEPS, short_layout

# The one-process references, by the model options their rows train (OPTIONS: GQA with 2 KV heads, per-head q/k
# norms, a gated shared expert, the router bias; DEEPSEEK: MLA with a q latent, group-limited sigmoid routing with
# the sequence-wise balance loss, one MTP module, capacity; CAP: capacity 1.0, dropping in every step).
MODELS = {"fp32": (), "bf16": BF16, "options": OPTIONS, "deepseek": DEEPSEEK, "capacity": CAP,
          "deepseek-bf16": (*DEEPSEEK, *BF16)}


def cp(n: int, impl: str = "ring", *extra) -> tuple:
    return ("--parallel.cp", str(n), "--parallel.cp_impl", impl, *extra)


AC = ("--train.activation_checkpointing", "true")
CKPT2 = ("--train.ckpt_every", "2")  # a checkpoint at step 2 of the 4, which a later row of the launch resumes


@pytest.fixture(scope="module")
def refs(corpus_dir, tmp_path_factory):
    """refs(name): the reference of MODELS[name], run once, when a test first asks for it."""
    return short_refs(corpus_dir, tmp_path_factory, MODELS, "cp")


def _run_cases(rank, world, cases, corpus_dir, run_root):
    return [train_tp(base_args(corpus_dir, f"{run_root}/{world}_{i}") + short_layout(dp, pp, ep, tp, (*MODELS[model], *cp)))
            for i, (model, dp, pp, ep, tp, cp) in enumerate(cases)]


def cp_matrix(world: int, cases: list, corpus_dir, tmp_path, refs, timeout: float) -> None:
    """Every case (model, dp, pp, ep, tp, extra with the CP flags) on one launch of `world` ranks, each held to its
    model's reference: within the bf16 bound in bf16, else fp32 relative 1e-5 and the parameters (`check_tp_case`)."""
    want = {name: refs(name) for name in {case[0] for case in cases}}
    per_rank = run_ranks(_run_cases, world, args=(cases, str(corpus_dir), str(tmp_path)), timeout=timeout,
                         pg_timeout=120)
    for case, ranks in zip(cases, zip(*per_rank)):
        model, extra, ref = case[0], case[5], want[case[0]]
        start = 2 if "--train.resume" in extra else 0  # resumed at step 2 from an earlier row's checkpoint
        worst = max_rel_dev(ranks[0]["losses"], ref["losses"][start:])
        print(f"CP row {model} dp,pp,ep,tp={case[1:5]} {' '.join(extra)}: worst loss error {worst:.1e}")  # pytest -s
        if model.endswith("bf16"):
            for r in ranks:
                assert not r["losses"] or max_rel_dev(r["losses"], ref["losses"]) <= bf16_bound(), case
            val = next(r["val_loss"] for r in ref["records"] if "val_loss" in r)  # the eval: CP ranks' parts add up
            assert abs(ranks[0]["val"] - val) <= bf16_bound() * abs(val), (case, ranks[0]["val"], val)
        elif start:
            check_resumed(str(case), ranks, ref, start)
        else:
            check_tp_case(str(case), list(ranks), ref)
        if model in ("capacity", "deepseek"):  # capacity drops under CP what one process drops, every step
            drops = [r.get("dropped_frac") for r in ref["records"]]
            assert ranks[0]["dropped"] == pytest.approx(drops, rel=1e-6, abs=0) and all(drops), (case, drops)


@pytest.mark.timeout(900)
def test_world2_cp(corpus_dir, tmp_path, refs):
    """CP2 ring and a2a; with activation checkpointing (the ring's backward under a recompute); the OPTIONS model
    (GQA: the ring sends 2 KV heads; the router bias from counts summed over CP); the DEEPSEEK model (MLA's latent on
    the ring, MTP's shifted targets across the chunks, capacity ranked over the whole sequence) ring and a2a; bf16, on
    the plain model and on the DEEPSEEK one (MLA's latent expanded on the ring under bf16 autocast: the attention
    kernel once met an fp32 k beside autocast's bf16 v, found by `nanotitan verify --fuzz`)."""
    cases = [("fp32", 1, 1, 1, 1, cp(2)), ("fp32", 1, 1, 1, 1, cp(2, "a2a")),
             ("capacity", 1, 1, 1, 1, cp(2, "ring", *AC)), ("options", 1, 1, 1, 1, cp(2)),
             ("deepseek", 1, 1, 1, 1, cp(2)), ("deepseek", 1, 1, 1, 1, cp(2, "a2a")), ("bf16", 1, 1, 1, 1, cp(2)),
             ("deepseek-bf16", 1, 1, 1, 1, cp(2))]
    cp_matrix(2, cases, corpus_dir, tmp_path, refs, timeout=900)


@pytest.mark.timeout(1200)
def test_world4_cp(corpus_dir, tmp_path, refs):
    """CP4 ring (chunks of 2 tokens); DP2*CP2 at zero 1; EP2*CP2 (experts folded over EP x CP: one a rank) on the CAP
    model; TP2*CP2 with SP, on the plain and the DEEPSEEK models (the pair torchtitan refuses: MLA heads split over
    TP, its latent on the CP ring). Last, DP2*CP2's step-2 checkpoint (zero 1: Adam state sharded over DP x CP)
    resumes at CP4 (zero 0): steps 3-4 and the parameters are the reference's."""
    step2 = str(tmp_path / "4_1" / "checkpoints" / "step_2")  # row 1's checkpoint (_run_cases: RUN_ROOT/WORLD_I)
    cases = [("fp32", 1, 1, 1, 1, cp(4)), ("fp32", 2, 1, 1, 1, cp(2, "ring", "--parallel.zero", "1", *CKPT2)),
             ("capacity", 1, 1, 2, 1, cp(2)), ("fp32", 1, 1, 1, 2, cp(2)), ("deepseek", 1, 1, 1, 2, cp(2)),
             ("fp32", 1, 1, 1, 1, cp(4, "ring", "--train.resume", step2))]
    cp_matrix(4, cases, corpus_dir, tmp_path, refs, timeout=1200)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_world4_cp_more(corpus_dir, tmp_path, refs):
    """CP4 a2a on the OPTIONS model (2 KV heads for 4 ranks: each replicated twice before the exchange); DP2*CP2 at
    zero 3 (FSDP2 over DP x CP, the CP parts summed); PP2*CP2 with 1F1B and zb1 (deferred weight gradients)."""
    cases = [("options", 1, 1, 1, 1, cp(4, "a2a")), ("fp32", 2, 1, 1, 1, cp(2, "ring", "--parallel.zero", "3")),
             ("fp32", 1, 2, 1, 1, cp(2, "ring", "--parallel.schedule", "1f1b")),
             ("fp32", 1, 2, 1, 1, cp(2, "ring", "--parallel.schedule", "zb1"))]
    cp_matrix(4, cases, corpus_dir, tmp_path, refs, timeout=1200)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_world8_cp(corpus_dir, tmp_path, refs):
    """DP2*PP2*CP2 at zero 1."""
    cp_matrix(8, [("fp32", 2, 2, 1, 1, cp(2, "ring", "--parallel.zero", "1"))], corpus_dir, tmp_path, refs, 900)


def check_resumed(name: str, ranks, ref: dict, start: int) -> None:
    """A run resumed at step `start`: its losses are the reference's from step start+1 on, its final parameters the
    reference's (`check_tp_case` on the steps it trained)."""
    check_tp_case(name, list(ranks), dict(ref, losses=ref["losses"][start:]), steps=SHORT_STEPS - start)


def test_checkpoint_reshards_across_cp_degrees(corpus_dir, tmp_path, refs):
    """A checkpoint saved at CP2 (step 2) resumes at CP1·DP2 in the same launch (the data position and the Adam
    state move from one data rank read in chunks to two reading whole sequences), and in one process: steps 3-4
    train what the reference trains, losses and parameters (CP's parameters are replicated: any CP degree reads them
    as DP does). CP2·DP2 at zero 1 -> CP4: test_world4_cp's last row."""
    ref = refs("fp32")
    run = tmp_path / "cp2"
    step2 = str(run / "2_0" / "checkpoints" / "step_2")  # case 0's run dir (_run_cases: RUN_ROOT/WORLD_I)
    cases = [("fp32", 1, 1, 1, 1, cp(2, "ring", "--train.ckpt_every", "2")),
             ("fp32", 2, 1, 1, 1, cp(1, "ring", "--train.resume", step2))]
    per_rank = run_ranks(_run_cases, 2, args=(cases, str(corpus_dir), str(run)), timeout=600, pg_timeout=120)
    check_tp_case("CP2", [r[0] for r in per_rank], ref)
    check_resumed("CP2 -> DP2", [r[1] for r in per_rank], ref, 2)
    resumed = train_tp(base_args(corpus_dir, tmp_path / "one") + short_layout(1, 1, 1, 1, ("--train.resume", step2)))
    check_resumed("CP2 -> one process", [resumed], ref, 2)


def test_cp_layout_is_refused_in_one_line(tmp_path):
    """Bad CP input fails in validate with one line naming the field and the fix."""
    from nanotitan.config.config import ConfigError, load_config, validate

    base = ["--run.dir", str(tmp_path), "--model.n_heads", "4", "--train.seq_len", "16"]
    for extra, words in [(["--parallel.cp", "2", "--train.seq_len", "18"], "train.seq_len=18"),
                         (["--parallel.cp", "4", "--train.seq_len", "12"], "2*parallel.cp"),
                         (["--parallel.cp", "4", "--parallel.cp_impl", "a2a", "--model.n_heads", "6",
                           "--model.d_model", "48"], "parallel.cp_impl=a2a"),
                         (["--parallel.cp", "2", "--model.pos_emb", "learned"], "model.pos_emb=learned"),
                         (["--parallel.cp", "2", "--parallel.dp_impl", "torch_ddp"], "torch_ddp"),
                         (["--parallel.cp", "4", "--model.mtp_layers", "2"], "model.mtp_layers=2"),
                         (["--parallel.cp", "2", "--parallel.cp_split", "docs"], "parallel.cp_split=docs"),
                         (["--parallel.cp", "2", "--parallel.cp_split", "docs", "--model.attn_mask", "doc",
                           "--train.seq_len", "512", "--model.mtp_layers", "64"], "chunk of 64 tokens")]:
        with pytest.raises(ConfigError) as err:
            validate(load_config(None, base + extra))
        line = str(err.value)
        assert words in line and "\n" not in line and "--" in line, (extra, line)
