"""The equivalence matrix with packed documents (DESIGN §4, docs/packed.md): under model.attn_mask=doc every layout
trains what one process trains, losses per step to fp32 relative 1e-5 and final parameters. The corpus packs many
short documents (1 to 12 words), so a 16-token window holds several and their boundaries fall across microbatches,
CP chunks and SP shards. One launch per world size runs several layouts, on the short runs of the TP matrix
(tests/helpers/equivalence.py: 4 steps, 16 sequences of 16 tokens a step)."""

import pytest

from tests.helpers.data import short_docs, write_sft
from tests.helpers.equivalence import DEEPSEEK, base_args, check_tp_case, max_rel_dev, short_refs, short_layout
from tests.helpers.equivalence import train_tp
from tests.helpers.mp import run_ranks

DOC = ("--model.attn_mask", "doc")
SFT_FILE = "sft.jsonl"  # in the corpus fixture's directory, beside the short documents


def models(corpus) -> dict:
    """The rows' models by name: plain causal training, documents, DeepSeek-V3's shapes with documents, and SFT
    (prompt/response records, whose uneven response counts weigh each microbatch: parallel/step.py)."""
    sft = ("--data.source", f"{corpus}/{SFT_FILE}", "--data.format", "sft", *DOC)
    return {"causal": (), "doc": DOC, "deepseek-doc": (*DEEPSEEK, *DOC), "sft": sft, "deepseek-sft": (*DEEPSEEK, *sft)}


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory):
    d = short_docs(tmp_path_factory.mktemp("short_docs"))
    sft = d.parent / f"{d.name}_sft"
    sft.mkdir()
    write_sft(sft / SFT_FILE, n=200, long_every=25)
    return d


@pytest.fixture(scope="module")
def refs(docs_dir, tmp_path_factory):
    return short_refs(docs_dir, tmp_path_factory, models(f"{docs_dir}_sft"), "packed")


def _run_cases(rank, world, cases, corpus_dir, run_root):
    rows = models(f"{corpus_dir}_sft")
    return [train_tp(base_args(corpus_dir, f"{run_root}/{world}_{i}") + short_layout(dp, pp, ep, tp,
                                                                                     (*rows[model], *extra)))
            for i, (model, dp, pp, ep, tp, extra) in enumerate(cases)]


def packed_matrix(world: int, cases: list, docs_dir, tmp_path, refs, timeout: float) -> None:
    want = {name: refs(name) for name in {case[0] for case in cases}}
    per_rank = run_ranks(_run_cases, world, args=(cases, str(docs_dir), str(tmp_path)), timeout=timeout,
                         pg_timeout=120)
    for case, ranks in zip(cases, zip(*per_rank)):
        worst = max_rel_dev(ranks[0]["losses"], want[case[0]]["losses"])
        print(f"packed row {case[0]} dp,pp,ep,tp={case[1:5]} {' '.join(case[5])}: worst loss error {worst:.1e}")
        check_tp_case(str(case), list(ranks), want[case[0]])


CP = ("--parallel.cp", "2")
BALANCED = (*CP, "--parallel.cp_split", "docs")  # each microbatch's chunks given out by its documents' work


@pytest.mark.timeout(1200)
def test_world2_packed(docs_dir, tmp_path, refs):
    """DP2 at zero 1 and 3, PP2 with 1F1B and zb1, EP2, TP2 with SP, CP2 ring and a2a (documents across the chunks:
    the ring's rectangles per document, the skipped peers, Ulysses' whole sequence), and the DeepSeek-V3-shaped model
    (MLA's latent on the ring, YaRN-free rope restarting per document, MTP) at CP2; the ring, Ulysses and the
    DeepSeek-V3 shape also on the document-balanced split (parallel.cp_split=docs: each microbatch's own chunks per
    rank, not zigzag's; Ulysses' zigzag with documents runs in the SFT rows)."""
    cases = [("doc", 2, 1, 1, 1, ("--parallel.zero", "1")), ("doc", 2, 1, 1, 1, ("--parallel.zero", "3")),
             ("doc", 1, 2, 1, 1, ("--parallel.schedule", "1f1b")), ("doc", 1, 2, 1, 1, ("--parallel.schedule", "zb1")),
             ("doc", 1, 1, 2, 1, ()), ("doc", 1, 1, 1, 2, ()), ("doc", 1, 1, 1, 1, CP),
             ("doc", 1, 1, 1, 1, BALANCED), ("doc", 1, 1, 1, 1, (*BALANCED, "--parallel.cp_impl", "a2a")),
             ("deepseek-doc", 1, 1, 1, 1, CP), ("deepseek-doc", 1, 1, 1, 1, BALANCED)]
    packed_matrix(2, cases, docs_dir, tmp_path, refs, timeout=1200)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_world2_sft(docs_dir, tmp_path, refs):
    """SFT's masked targets, counted over the global batch (uneven counts per microbatch, data rank and CP chunk; the
    weighting itself: tests/parallel/test_step.py): DP2 at zero 1 and 3, PP2 with 1F1B and zb1, EP2, TP2 with SP, CP2
    ring and a2a (a chunk may hold no response at all). The DeepSeek-V3-shaped model with SFT: `test_deepseek_sft`."""
    cases = [("sft", 2, 1, 1, 1, ("--parallel.zero", "1")), ("sft", 2, 1, 1, 1, ("--parallel.zero", "3")),
             ("sft", 1, 2, 1, 1, ("--parallel.schedule", "1f1b")),
             ("sft", 1, 2, 1, 1, ("--parallel.schedule", "zb1")), ("sft", 1, 1, 2, 1, ()), ("sft", 1, 1, 1, 2, ()),
             ("sft", 1, 1, 1, 1, CP), ("sft", 1, 1, 1, 1, (*CP, "--parallel.cp_impl", "a2a"))]
    packed_matrix(2, cases, docs_dir, tmp_path, refs, timeout=1200)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_world4_deepseek_tp2_cp2(docs_dir, tmp_path, refs):
    """The DeepSeek-V3-shaped model (MLA's latent on the ring, MTP) at TP2*CP2 with documents."""
    packed_matrix(4, [("deepseek-doc", 1, 1, 1, 2, CP)], docs_dir, tmp_path, refs, timeout=1200)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp=2", "tp=2,cp=2"])
def test_deepseek_sft(docs_dir, tmp_path, layout, capsys):
    """SFT on the DeepSeek-V3-shaped model, its MTP depth reading the prompts' tokens as inputs and learning only the
    responses (model/tokens.py MASKED), at CP2 and TP2*CP2, checked by `nanotitan verify` at its bars: forward
    outputs, gradients and losses per tensor within 1e-5, parameters and optimizer state within 1e-4. (The matrix's
    element-wise parameter bar trips here on single weights whose gradient is ~0, where AdamW turns a last-bit
    difference of the gradient into a visible move; verify's gradients agree to ~4e-7.)"""
    from nanotitan import cli

    args = base_args(docs_dir, tmp_path / "run") + short_layout(1, 1, 1, 1, models(f"{docs_dir}_sft")["deepseek-sft"])
    assert cli.main(["verify", "--layout", layout, "--steps", "4", *args]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("verify: equal")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_world8_packed(docs_dir, tmp_path, refs):
    """DP2*PP2*EP2 with documents."""
    packed_matrix(8, [("doc", 2, 2, 2, 1, ())], docs_dir, tmp_path, refs, timeout=1200)


def test_documents_change_the_training(refs):
    """The mask is on: the reference with documents differs from plain causal training of the same data."""
    assert max_rel_dev(refs("doc")["losses"], refs("causal")["losses"]) > 1e-4
