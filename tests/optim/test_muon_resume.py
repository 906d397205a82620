"""Muon's state in checkpoints (one process): a resume continues the uninterrupted run exactly (the momentum is
saved), and resuming under the other optimizer is refused in one line unless train.reset_optimizer asks for fresh
state. Resharding the momentum across layouts and zero levels rides in tests/equivalence/test_equivalence_muon.py."""

import pytest
import torch

from nanotitan.state.checkpoint import CheckpointError
from tests.helpers.equivalence import base_args, layout_args
from tests.helpers.mp import train_once

STEPS = ("--train.steps", "4", "--train.warmup_steps", "1", "--parallel.microbatches", "2",
         "--train.ckpt_at_end", "false")
MUON = ("--train.optimizer", "muon", "--train.muon_lr", "0.01")


def _run(corpus_dir, run_dir, *extra) -> dict:
    return train_once(base_args(corpus_dir, run_dir) + layout_args(1, 1, 1) + [*STEPS, *extra])


def test_muon_resume_exact_and_optimizer_switch_refused(corpus_dir, tmp_path):
    torch.set_num_threads(1)
    full = _run(corpus_dir, tmp_path / "full", *MUON, "--train.ckpt_every", "2")
    ck = str(tmp_path / "full" / "checkpoints" / "step_2")
    resumed = _run(corpus_dir, tmp_path / "resumed", *MUON, "--train.resume", ck)
    assert [r["step"] for r in resumed["records"]] == [3, 4]
    assert resumed["losses"] == full["losses"][2:]  # the same bits: weights, momentum and AdamW's moments read back
    fresh = _run(corpus_dir, tmp_path / "fresh", *MUON, "--train.resume", ck, "--train.reset_optimizer", "true")
    assert fresh["losses"][0] == full["losses"][2]  # step 3's loss is the saved weights' ...
    assert fresh["losses"][1] != full["losses"][3]  # ... and step 4 moved without the saved momentum
    refused = r"holds muon optimizer state but train.optimizer=adamw .*reset_optimizer"
    with pytest.raises(CheckpointError, match=refused):
        _run(corpus_dir, tmp_path / "adamw", "--train.resume", ck)
    switched = _run(corpus_dir, tmp_path / "switched", "--train.resume", ck, "--train.reset_optimizer", "true")
    assert [r["step"] for r in switched["records"]] == [3, 4]
