"""Resume through the trainer: exactly on the same layout, resharded onto other DP x PP x EP layouts, and
after a rank is killed with torchrun restarts. Every case compares against an uninterrupted run."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers.mp import run_ranks
from tests.helpers.equivalence import B, STEPS, base_args, m
from tests.helpers.checkpoint import CKPT, _args, _close, _run_jobs, _train


@pytest.fixture(scope="module")
def uninterrupted(corpus_dir, tmp_path_factory):
    """The single-process run (checkpoints every 5 steps) every resumed run must continue."""
    run = tmp_path_factory.mktemp("full")
    torch.set_num_threads(1)
    return run, dict(_train(_args(corpus_dir, run, (1, 1, 1))))


def test_same_layout_resume_is_exact(corpus_dir, tmp_path, uninterrupted):
    run, full = uninterrupted
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / f"step_{CKPT}", resumed / "checkpoints" / f"step_{CKPT}")
    hist = _train(_args(corpus_dir, resumed, (1, 1, 1), resume="auto"))
    assert [s for s, _ in hist] == list(range(CKPT + 1, STEPS + 1))
    for step, loss in hist:
        assert _close(loss, full[step], 1e-6), (step, loss, full[step])


def test_resharded_resume(corpus_dir, tmp_path, uninterrupted):
    """(1,1,1)->(2,1,2), (2,2,1)->(1,1,1), (1,2,2)->(2,2,1), (2,2,2)->(1,2,2), same global batch."""
    run111, full = uninterrupted
    d = tmp_path
    # Train the source layouts (8 ranks, then 4), each writing checkpoints at steps 5 and 10.
    src222 = run_ranks(_run_jobs, 8, args=([_args(corpus_dir, d / "a222", (2, 2, 2))],), timeout=300)[0][0]
    ck = lambda r: str(r / "checkpoints" / f"step_{CKPT}")  # noqa: E731
    jobs4 = [_args(corpus_dir, d / "a221", (2, 2, 1)), _args(corpus_dir, d / "a122", (1, 2, 2)),
             _args(corpus_dir, d / "b212", (2, 1, 2), resume=ck(run111)),
             _args(corpus_dir, d / "b221", (2, 2, 1), resume=ck(d / "a122")),
             _args(corpus_dir, d / "b122", (1, 2, 2), resume=ck(d / "a222"))]
    res4 = run_ranks(_run_jobs, 4, args=(jobs4,), timeout=400)[0]
    torch.set_num_threads(1)
    b111 = _train(_args(corpus_dir, d / "b111", (1, 1, 1), resume=ck(d / "a221")))
    for hist in [src222, res4[0], res4[1]]:  # the sources themselves follow the reference
        assert all(_close(loss, full[s]) for s, loss in hist)
    for name, hist in [("(1,1,1)->(2,1,2)", res4[2]), ("(1,2,2)->(2,2,1)", res4[3]),
                       ("(2,2,2)->(1,2,2)", res4[4]), ("(2,2,1)->(1,1,1)", b111)]:
        assert [s for s, _ in hist] == list(range(CKPT + 1, STEPS + 1)), name
        for step, loss in hist:
            assert _close(loss, full[step]), f"{name}: step {step} loss {loss} vs uninterrupted {full[step]}"


def test_kill9_with_restarts_finishes_like_uninterrupted(corpus_dir, tmp_path):
    """kill -9 of one rank: torchrun restarts all ranks, they resume from the newest complete checkpoint,
    and the final loss equals the uninterrupted run's. The kill comes within a few steps of step 10's checkpoint
    (polled every 20 ms): 60 steps leave ~50 to resume into."""
    steps = 60
    common = [sys.executable, "-m", "nanotitan.cli", "train", *base_args(corpus_dir, "X"), "--train.steps", str(steps),
              "--parallel.dp", "2", "--parallel.microbatches", str(B // (2 * m)), "--train.ckpt_every", "10",
              "--train.resume", "auto"]
    run_dir_arg = common.index("X")

    def launch(run_dir, extra=()):
        cmd = list(common)
        cmd[run_dir_arg] = str(run_dir)
        return subprocess.Popen(cmd + list(extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

    faulty = launch(tmp_path / "faulty", ["--train.max_restarts", "2"])
    try:
        deadline = time.monotonic() + 180
        ck = tmp_path / "faulty" / "checkpoints"
        while not (ck / "step_10" / "COMPLETE").exists():
            assert time.monotonic() < deadline and faulty.poll() is None, "no checkpoint before the kill"
            time.sleep(0.02)
        workers = subprocess.run(["pgrep", "-f", f"nanotitan.cli train .*{tmp_path}/faulty"], capture_output=True,
                                 text=True).stdout.split()
        workers = [int(w) for w in workers if int(w) != faulty.pid]
        assert workers
        os.kill(max(workers), signal.SIGKILL)
        out, _ = faulty.communicate(timeout=300)
    finally:
        if faulty.poll() is None:
            os.killpg(faulty.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-9", "-f", f"nanotitan.cli train .*{tmp_path}/"], check=False)
    assert faulty.returncode == 0, out
    assert "resumed from" in out
    clean = launch(tmp_path / "clean")
    out_clean, _ = clean.communicate(timeout=300)
    assert clean.returncode == 0, out_clean
    last = lambda p: [json.loads(l) for l in (p / "metrics.jsonl").read_text().splitlines()][-1]  # noqa: E731
    a, b = last(tmp_path / "faulty"), last(tmp_path / "clean")
    assert a["step"] == b["step"] == steps
    assert _close(a["loss"], b["loss"], 1e-6), (a["loss"], b["loss"])
