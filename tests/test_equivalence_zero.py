"""Sharded DP keeps the equivalence rule (DESIGN §4): every zero level trains what one process trains.

parallel.zero 1, 2 (ShardedReducer) and 3 (FSDP2) x DP2, DP4, DP2*EP2, DP2*PP2 and DP2*PP2*EP2 (both
schedules) run the real trainer on real gloo processes for 10 steps with clipping and are held to
tests/test_equivalence.py's bar against its single-process reference: losses per step to fp32 relative
1e-5, final parameters (each rank's full params: after the all-gather at zero 1/2, gathered from the
shards at zero 3), replicas bitwise identical. Activation checkpointing rides along in two cases.
One launch per world size runs all of its cases.
"""

from nanotitan.config import load_config
from nanotitan.model.transformer import is_expert_param
from tests.mp import run_ranks
from tests.test_equivalence import base_args, check_case, layout_args, reference  # noqa: F401 (fixture)

NO_CKPT = ("--train.ckpt_at_end", "false")


def train_zero(args: list[str]) -> dict:
    """tests/test_equivalence.train_once, reading the full params whatever the zero level."""
    from nanotitan.train import Trainer

    trainer = Trainer(load_config(None, args))
    res = trainer.train()
    full, _ = trainer.shard.full_state(None)  # zero 3: all-gathered from the DTensor shards
    start = trainer.shard.spec.expert_start
    params = {n: (t.detach().clone(), start if is_expert_param(n) else None) for n, t in full.items()}
    return {"losses": [r["loss"] for r in res["history"]], "params": params, "coords": trainer.dims.coords()}


def _run(rank, world, cases, corpus_dir, run_root):
    return [train_zero(base_args(corpus_dir, f"{run_root}/{world}_{i}") + layout_args(*case))
            for i, case in enumerate(cases)]


def _cases(layouts, ac_zero=None):
    out = []
    for zero in (1, 2, 3):
        for dp, pp, ep, schedule in layouts:
            extra = ("--parallel.zero", str(zero), *NO_CKPT)
            out.append((dp, pp, ep, schedule, extra))
    if ac_zero is not None:
        dp, pp, ep, schedule = layouts[-1]
        for zero in ac_zero:
            out.append((dp, pp, ep, schedule, ("--parallel.zero", str(zero), "--train.activation_checkpointing",
                                               "true", *NO_CKPT)))
    return out


def _matrix(world, cases, corpus_dir, tmp_path, reference, timeout):
    results = run_ranks(_run, world, args=(cases, str(corpus_dir), str(tmp_path)), timeout=timeout, pg_timeout=120)
    for i, case in enumerate(cases):
        check_case(f"{case}", [results[r][i] for r in range(world)], reference)


def test_zero_world2(corpus_dir, tmp_path, reference):
    _matrix(2, _cases([(2, 1, 1, "1f1b")], ac_zero=(3,)), corpus_dir, tmp_path, reference, timeout=300)


def test_zero_world4(corpus_dir, tmp_path, reference):
    layouts = [(4, 1, 1, "1f1b"), (2, 1, 2, "1f1b"), (2, 2, 1, "gpipe"), (2, 2, 1, "1f1b")]
    _matrix(4, _cases(layouts, ac_zero=(2,)), corpus_dir, tmp_path, reference, timeout=600)


def test_zero_world8(corpus_dir, tmp_path, reference):
    _matrix(8, _cases([(2, 2, 2, "gpipe"), (2, 2, 2, "1f1b")]), corpus_dir, tmp_path, reference, timeout=600)
