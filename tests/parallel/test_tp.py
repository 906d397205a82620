"""Tensor parallel's rank identity, its config rules, and checkpoints across TP degrees (docs/tp.md).

The checkpoint test: one single-process reference (checkpoints at steps 5 and 10), one 4-rank launch of three
runs, one single-process resume, two exports. DP2*TP2 at zero 1 writes a checkpoint at step 5 that TP4 and TP1
resume, and PP2*TP2 resumes the reference's TP1 checkpoint: every resumed step matches the uninterrupted reference
to fp32 relative 1e-5, every checkpoint holds the same keys with the same whole shapes as the reference's, and
`export` of the TP checkpoint writes the reference's weights."""

import pytest
import torch

from nanotitan.config.config import ConfigError, load_config
from nanotitan.parallel.dims import ParallelDims
from tests.helpers.mp import run_ranks
from nanotitan import cli
from tests.helpers.equivalence import LR, STEPS, base_args
from tests.helpers.equivalence import tp_layout
from tests.helpers.hf import _tensors
from tests.helpers.checkpoint import CKPT, _close, _run_jobs, _train
from tests.helpers.checkpoint import _keys


def test_rank_identity_tp_fastest():
    """rank = ((dp*PP + pp)*EP + ep)*TP + tp; each group a slice of the (DP, PP, EP, TP) grid."""
    d = ParallelDims(2, 2, 2, rank=0, tp=2)
    assert d.world_size == 16
    for r in range(16):
        x = ParallelDims(2, 2, 2, rank=r, tp=2)
        assert x.rank_of(*x.coords(), x.tp_rank) == r and x.tp_rank == r % 2
        assert x.moe_ep_rank == x.ep_rank * 2 + x.tp_rank and x.data_rank == x.dp_rank * 2 + x.ep_rank
    assert d.all_group_ranks("tp")[:2] == [[0, 1], [2, 3]]
    assert d.all_group_ranks("ep")[0] == [0, 1, 2, 3]  # experts fold over EP x TP
    assert d.all_group_ranks("pp")[0] == [0, 4] and d.all_group_ranks("expert_dp")[0] == [0, 8]
    assert d.all_group_ranks("non_expert_dp")[0] == [0, 2, 8, 10]  # fixed (pp, tp)
    assert d.all_group_ranks("stage")[0] == [0, 1, 2, 3, 8, 9, 10, 11]
    for kind in ("tp", "ep", "pp", "expert_dp", "non_expert_dp", "stage"):
        groups = d.all_group_ranks(kind)
        assert sorted(r for g in groups for r in g) == list(range(16)), kind
    assert ParallelDims(2, 2, 2, rank=5).rank_of(1, 0, 1) == 5  # tp = 1: DESIGN §3's identity


def test_bytes_per_rank_fall_with_tp():
    """A rank's params at TP 1/2/4, built as parallelize builds them (no groups needed to slice): the experts (folded
    over TP) and every split weight fall by N; only the norms and the router (replicated, under 1%) do not."""
    from nanotitan.model.spec import build_chunk_specs
    from nanotitan.model.transformer import Transformer
    from nanotitan.parallel.tp import apply_tp, tp_shard

    sizes = {}
    for tp in (1, 2, 4):
        cfg = load_config(None, ["--model.d_model", "64", "--model.n_heads", "4", "--model.num_experts", "4",
                                 "--model.vocab_size", "512", "--data.vocab_size", "512", "--parallel.tp", str(tp)])
        for rank in range(tp):
            dims = ParallelDims(1, 1, 1, rank=rank, tp=tp)
            model = Transformer(cfg.model, build_chunk_specs(cfg, 0, dims.moe_ep_rank)[0], seed=0,
                                tokens=tp_shard(dims, sp=True))
            apply_tp(model)
            sizes[tp, rank] = sum(p.numel() for p in model.parameters())
    assert all(sizes[tp, r] == sizes[tp, 0] for tp in (2, 4) for r in range(tp))
    for tp in (2, 4):
        assert sizes[1, 0] / tp <= sizes[tp, 0] <= 1.01 * sizes[1, 0] / tp


@pytest.mark.parametrize("flags, field", [
    (["--parallel.tp", "3"], "model.n_heads"),
    (["--parallel.tp", "2", "--model.n_kv_heads", "3", "--model.n_heads", "6", "--model.d_model", "48"],
     "model.n_kv_heads"),
    (["--parallel.tp", "4", "--parallel.ep", "2"], "model.num_experts"),
    (["--parallel.tp", "2", "--parallel.ep", "2", "--parallel.microbatches", "2", "--parallel.ep_overlap_microbatches",
      "true"], "two lanes would interleave the TP collectives"),
    (["--parallel.tp", "2", "--model.pos_emb", "learned"], "model.pos_emb"),
    (["--parallel.tp", "2", "--parallel.dp_impl", "torch_ddp"], "parallel.dp_impl"),
])
def test_tp_config_refusals(tmp_path, flags, field):
    with pytest.raises(ConfigError) as e:  # load_config validates
        load_config(None, ["--model.n_heads", "4", "--model.num_experts", "4", "--data.vocab_size", "300",
                           "--train.seq_len", "16", "--model.ffn_dim", "48", "--run.dir", str(tmp_path), *flags])
    assert field in str(e.value) and "\n" not in str(e.value)


def _job(corpus_dir, run_dir, layout, resume="", extra=()):
    more = ["--train.ckpt_every", str(CKPT), "--train.keep_last", "3", *extra]
    if resume:
        more += ["--train.resume", str(resume)]
    return base_args(corpus_dir, run_dir) + tp_layout(*layout) + more


def test_checkpoints_across_tp_degrees(corpus_dir, tmp_path):
    d = tmp_path
    ck = lambda run: d / run / "checkpoints" / f"step_{CKPT}"  # noqa: E731
    torch.set_num_threads(1)
    ref = dict(_train(_job(corpus_dir, d / "ref", (1, 1, 1, 1))))
    jobs = [_job(corpus_dir, d / "a_dp2tp2", (2, 1, 1, 2), extra=("--parallel.zero", "1")),
            _job(corpus_dir, d / "x_tp4", (1, 1, 1, 4), resume=ck("a_dp2tp2")),
            _job(corpus_dir, d / "x_pp2tp2", (1, 2, 1, 2), resume=ck("ref"))]
    # the TP4 run resumes a checkpoint its launch wrote: jobs run one after another on every rank
    a, x4, xpp = run_ranks(_run_jobs, 4, args=(jobs,), timeout=900, pg_timeout=120)[0]
    x1 = _train(_job(corpus_dir, d / "x_tp1", (1, 1, 1, 1), resume=ck("a_dp2tp2")))

    want = _keys(ck("ref"))
    assert _keys(ck("a_dp2tp2")) == want  # whole shapes under the same keys, whatever the TP degree
    assert [s for s, _ in a] == list(range(1, STEPS + 1))
    assert all(_close(loss, ref[s]) for s, loss in a), "DP2*TP2 zero 1 follows the reference"
    for name, hist in [("TP2 zero 1 -> TP4", x4), ("TP2 zero 1 -> TP1", x1), ("TP1 -> PP2*TP2", xpp)]:
        assert [s for s, _ in hist] == list(range(CKPT + 1, STEPS + 1)), name
        for step, loss in hist:
            assert _close(loss, ref[step]), f"{name}: step {step} loss {loss} vs uninterrupted {ref[step]}"
    # `export` gathers a TP checkpoint (DP2*TP2 zero 1, step 10) into the same transformers weights as one process's
    for run in ("a_dp2tp2", "ref"):
        assert cli.main(["export", "--run.dir", str(d / run), "--out", str(d / f"hf_{run}")]) == 0
    got, want = _tensors(d / "hf_a_dp2tp2"), _tensors(d / "hf_ref")
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-3 * LR * STEPS, msg=lambda s: f"{k}: {s}")
