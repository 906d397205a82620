"""No checkpoint is deleted before its replacement is complete (state/swap.py): a re-save of a step sets the old copy
aside, moves the new one into place, writes COMPLETE, then deletes the old one. A process killed (SIGKILL) at every
line of that swap leaves a step that resumes and loads (the old copy or the new one, whole), and the next owner of
the run dir puts things back in order. The same for a snapshot unit's commit. And no end save runs when nothing was
trained since the resume (it was the re-save that lost a run's only checkpoint)."""

from __future__ import annotations

import os
import shutil
import signal
import sys

import torch

from nanotitan.state import checkpoint as ckpt
from nanotitan.run.rundir import clean_stale_saves
from nanotitan.state import manifest, swap
from tests.helpers.checkpoint import SAVE_KS, build, perturb, tiny_cfg
from tests.helpers.specs import build_shard_spec


def _killed_at_line(k: int, fn, *args) -> bool:
    """Run fn(*args) in a forked child that SIGKILLs itself at the k-th line swap_in executes; whether it got that
    far (False: the swap finished with fewer lines)."""
    pid = os.fork()
    if pid == 0:  # the child: file operations only, then gone (no teardown of the parent's state)
        lines = 0

        def trace(frame, event, arg):
            nonlocal lines
            if frame.f_code is swap.swap_in.__code__:
                if event == "line":
                    lines += 1
                    if lines == k:
                        os.kill(os.getpid(), signal.SIGKILL)
                return trace
            return None

        sys.settrace(trace)
        try:
            fn(*args)
        finally:
            sys.settrace(None)
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _first_param(model) -> torch.Tensor:
    return next(model.parameters()).detach().clone()


def test_a_kill_at_every_line_of_a_resave_leaves_a_loadable_step(tmp_path):
    cfg = tiny_cfg()
    model, opt = build(cfg, build_shard_spec(cfg, 0, 0))
    perturb(model, opt, SAVE_KS)
    old_run, new_run = tmp_path / "old", tmp_path / "new"
    ckpt.save_checkpoint(old_run, 2, model, opt, None, cfg, {"samples_consumed": 32})
    old_w = _first_param(model)
    perturb(model, opt, (9,))
    new_w = _first_param(model)
    ckpt.save_checkpoint(new_run, 2, model, opt, None, cfg, {"samples_consumed": 32})  # the re-save's bytes
    fresh, fresh_opt = build(cfg, build_shard_spec(cfg, 0, 0))

    k, seen, loaded = 0, set(), {}
    while True:
        k += 1
        run = tmp_path / f"kill{k}"
        root = manifest.checkpoint_dir(run)
        shutil.copytree(old_run, run)
        tmp = root / "step_2.tmp"
        shutil.copytree(manifest.checkpoint_dir(new_run) / "step_2", tmp)
        (tmp / manifest.COMPLETE).unlink()  # as the ranks leave it: written, not yet committed
        if not _killed_at_line(k, swap.swap_in, tmp, root / "step_2", "step 2\n"):
            break
        # resumed as it is (every reader falls back to the copy set aside) ...
        lines = []
        path = manifest.resolve_resume("auto", run, log=lines.append)  # verified: every file against its manifest
        assert path is not None and path.parent == root, (k, sorted(os.listdir(root)), lines)
        assert manifest.latest_checkpoint(run) == path, k
        resumed = (path / manifest.MANIFEST).read_bytes()
        if resumed not in loaded:  # each of the two copies loaded once (the others: the same bytes, verified)
            extra = ckpt.load_checkpoint(path, fresh, fresh_opt, None)
            w = _first_param(fresh)
            assert extra["step"] == 2 and (torch.equal(w, old_w) or torch.equal(w, new_w)), k
            loaded[resumed] = "new" if torch.equal(w, new_w) else "old"
        seen.add(loaded[resumed])
        # ... and once the next owner of the run dir has put things back in order
        clean_stale_saves(run)
        assert sorted(os.listdir(root)) == ["step_2"], (k, sorted(os.listdir(root)))
        assert manifest.resolve_resume("auto", run) == root / "step_2"
        assert (root / "step_2" / manifest.MANIFEST).read_bytes() == resumed, k  # the copy that was whole stays
    assert k > 5 and seen == {"old", "new"}, (k, seen)  # every line was a kill point; both copies were the answer
    assert sorted(os.listdir(root)) == ["step_2"] and torch.equal(
        (ckpt.load_checkpoint(root / "step_2", fresh, fresh_opt, None), _first_param(fresh))[1], new_w)


def test_a_kill_at_every_line_of_a_unit_commit_leaves_a_whole_unit(tmp_path):
    from nanotitan.elastic import snapshot

    k = 0
    while True:
        k += 1
        root = tmp_path / f"kill{k}"
        unit, tmp = root / "step_5" / "g1-node0", root / "step_5" / "g1-node0.tmp"
        unit.mkdir(parents=True)
        (unit / "a").write_text("old")
        tmp.mkdir()
        (tmp / "a").write_text("new")
        if not _killed_at_line(k, snapshot.commit, tmp, unit):
            break
        swap.settle(unit.parent, marked=False)
        assert (unit / "a").read_text() in ("old", "new") and sorted(os.listdir(unit.parent)) in (
            ["g1-node0"], ["g1-node0", "g1-node0.tmp"]), (k, sorted(os.listdir(unit.parent)))
    assert k > 3


def test_no_end_save_when_nothing_was_trained_since_the_resume(corpus_dir, tmp_path):
    from nanotitan.config.config import load_config
    from nanotitan.train import Trainer
    from tests.helpers.equivalence import base_args, layout_args

    torch.set_num_threads(1)
    args = base_args(corpus_dir, tmp_path / "run") + layout_args(1, 1, 1) + ["--train.steps", "2"]
    Trainer(load_config(None, args)).train()
    step_2 = manifest.checkpoint_dir(tmp_path / "run") / "step_2"
    before = os.stat(step_2).st_ino
    again = Trainer(load_config(None, args + ["--train.resume", "auto"]))
    assert again.start_step == 2
    again.train()
    assert os.stat(step_2).st_ino == before  # not written again (was: removed, then a new one renamed into place)
