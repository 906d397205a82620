"""The equivalence matrix with tensor parallel (DESIGN §4, docs/tp.md): every layout with TP trains the same model
as one process, losses per step to fp32 relative 1e-5 and final parameters (each rank's TP slice, and its folded
experts, against the reference's). One launch per world size runs several layouts."""

import pytest
import torch

from tests.mp import run_ranks
from tests.test_equivalence import LR, STEPS, B, base_args, m, one_process


def tp_layout(dp=1, pp=1, ep=1, tp=2, extra=()) -> list[str]:
    return ["--parallel.dp", str(dp), "--parallel.pp", str(pp), "--parallel.ep", str(ep), "--parallel.tp", str(tp),
            "--parallel.microbatches", str(B // (dp * ep * m)), *extra]


def train_tp(args: list[str]) -> dict:
    """train_once's result (tests/mp.py) plus, per param, the dim its TP slice is cut along and the rank's tp place."""
    from nanotitan.config.config import load_config
    from nanotitan.model.transformer import is_expert_param
    from nanotitan.parallel.tp import tp_shard_dim
    from nanotitan.train import Trainer
    from tests.whole_state import whole_state

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
    return {"losses": [r["loss"] for r in records], "params": params, "tp": (d.tp_rank, d.tp)}


def _run_cases(rank, world, cases, corpus_dir, run_root):
    return [train_tp(base_args(corpus_dir, f"{run_root}/{world}_{i}") + tp_layout(*case))
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


@pytest.fixture(scope="module")
def reference(corpus_dir, tmp_path_factory):
    return one_process(corpus_dir, tmp_path_factory, "ref_tp")


def tp_matrix(world: int, cases: list, corpus_dir, tmp_path, reference, timeout: float) -> None:
    """Every case of `cases` on one launch of `world` ranks, each held to the reference."""
    per_rank = run_ranks(_run_cases, world, args=(cases, str(corpus_dir), str(tmp_path)), timeout=timeout,
                         pg_timeout=120)
    for case, ranks in zip(cases, zip(*per_rank)):
        check_tp_case(str(case), list(ranks), reference)


def test_world2_tp(corpus_dir, tmp_path, reference):
    """TP2 with and without SP (experts folded over the two TP ranks)."""
    cases = [(1, 1, 1, 2), (1, 1, 1, 2, ("--parallel.sp", "false"))]
    tp_matrix(2, cases, corpus_dir, tmp_path, reference, timeout=300)
