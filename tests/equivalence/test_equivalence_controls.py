"""The everyday controls keep the equivalence rule (DESIGN §4): train.lr_schedule=wsd and a data.mix of two prepared
sources train on EP2 what one process trains with them (losses per step to fp32 relative 1e-5 over 4 steps: 2 of
warmup, 1 stable, 1 of decay; the lr is the same pure function of the step on every rank, so a short row suffices),
train.export_hf writes, from the EP2 run's sharded checkpoint, the weights one process exports, and `nanotitan eval`
of the one-process checkpoint on PP2 gives the val_loss the run logged at that step.

One 2-rank launch: each rank first evaluates the reference's checkpoint on PP2 (resharded from one process), then
trains the EP2 row through train.run (which exports on rank 0 once the ranks have left the process group).
Cost: ~20 s on a loaded 2-core machine (the reference and one 2-rank launch).
"""

import torch

from nanotitan.config.config import DataConfig, load_config
from nanotitan.data.prepare import prepare_mix
from tests.conftest import make_corpus
from tests.helpers.equivalence import LR, base_args, layout_args
from tests.helpers.hf import _tensors
from tests.helpers.mp import run_ranks

STEPS = 4  # warmup 2 (base_args), round(0.3 * 4) = 1 decay step: one stable step between
EVAL = ("--train.eval_every", str(STEPS), "--train.eval_batches", "1")


def _controls(mix: str, export_dir) -> tuple[str, ...]:
    return ("--train.steps", str(STEPS), "--data.mix", mix, "--train.lr_schedule", "wsd",
            "--train.lr_decay_frac", "0.3", *EVAL, "--train.export_hf", str(export_dir))


def _train(args: list[str]) -> dict:
    """nanotitan train's train.run on `args`: rank 0's records (empty elsewhere)."""
    from nanotitan.train import run

    return {"records": run(load_config(None, args))["history"]}


def _rank(rank, world, ref_run: str, args: list[str]):
    from nanotitan.evaluate import eval_config, evaluate_checkpoint

    cfg, path = eval_config(ref_run, None, ["--parallel.pp", "2", "--train.eval_batches", "1", "--train.threads", "1"])
    return evaluate_checkpoint(cfg, path), _train(args)  # the eval first: train.run leaves the process group


def test_wsd_mix_export_and_eval_match_one_process(corpus_dir, tmp_path):
    from nanotitan.evaluate import eval_config, evaluate_checkpoint

    other = make_corpus(tmp_path / "other", n_docs=12, words_per_doc=800, seed=1)
    mix = f"{corpus_dir}:0.7,{other}:0.3"
    prepare_mix(DataConfig(mix=mix, vocab_size=300), log=lambda line: None)  # as `nanotitan data prepare` does
    ref_run = tmp_path / "ref"
    torch.set_num_threads(1)
    ref = _train(base_args(corpus_dir, ref_run) + layout_args(1, 1, 1) + list(_controls(mix, tmp_path / "ref_hf")))
    row = base_args(corpus_dir, tmp_path / "ep2") + layout_args(1, 1, 2) + list(_controls(mix, tmp_path / "ep2_hf"))
    (evals, rank0), (evals1, _) = run_ranks(_rank, 2, args=(str(ref_run), row), timeout=300, pg_timeout=120)

    want, got = [r["loss"] for r in ref["records"]], [r["loss"] for r in rank0["records"]]
    assert len(want) == len(got) == STEPS
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step + 1}: EP2 loss {a} vs one process {b}"
    lrs = [r["lr"] for r in ref["records"]]  # warmup 2, stable 1, then the decay's 1 step at lr * 0.1
    assert lrs == [LR / 2, LR, LR, lrs[3]] and abs(lrs[3] - 0.1 * LR) < 1e-15
    val = ref["records"][-1]["val_loss"]
    assert abs(rank0["records"][-1]["val_loss"] - val) <= 1e-5 * val

    exported, reference = _tensors(tmp_path / "ep2_hf"), _tensors(tmp_path / "ref_hf")
    assert exported.keys() == reference.keys() and any(".experts." in k for k in exported)
    for k, t in reference.items():
        torch.testing.assert_close(exported[k], t, rtol=1e-4, atol=1e-3 * LR * STEPS, msg=lambda s: f"{k}: {s}")

    cfg, path = eval_config(ref_run, None, ["--train.eval_batches", "1"])
    alone = evaluate_checkpoint(cfg, path)
    assert alone["step"] == STEPS and abs(alone["val_loss"] - val) <= 1e-6 * val  # the eval training ran
    for e in (evals, evals1):  # PP2, resharded from one process: the same loss on every rank
        assert e["step"] == STEPS and abs(e["val_loss"] - alone["val_loss"]) <= 1e-5 * alone["val_loss"]
