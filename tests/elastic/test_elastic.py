"""Elastic re-planning: a job on 4 ranks with --parallel.auto is stopped and restarted on 2 ranks; the
planner picks a layout for the new world at the same global batch, the newest checkpoint is resharded
onto it, and the loss continues the uninterrupted single-process curve within the equivalence tolerance."""

import json
import os
import signal
import subprocess
import sys
import time

import torch

from tests.helpers.equivalence import B, base_args, layout_args

STEPS = 60


def _torchrun(nproc, run_dir, corpus_dir):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "nanotitan.cli", "train", *base_args(corpus_dir, run_dir), "--train.steps", str(STEPS),
           "--train.global_batch", str(B), "--parallel.auto", "true", "--train.ckpt_every", "5",
           "--train.resume", "auto", "--parallel.timeout_s", "60"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_restart_on_fewer_ranks_replans_and_continues(corpus_dir, tmp_path):
    from nanotitan.state.manifest import latest_checkpoint
    from nanotitan.config.config import load_config
    from nanotitan.train import Trainer

    torch.set_num_threads(1)
    ref = Trainer(load_config(None, base_args(corpus_dir, tmp_path / "ref") + layout_args(1, 1, 1)
                              + ["--train.steps", str(STEPS)])).train()
    full = {r["step"]: r["loss"] for r in ref["history"]}

    run = tmp_path / "elastic"
    first = _torchrun(4, run, corpus_dir)
    try:
        deadline = time.monotonic() + 240
        while (latest_checkpoint(run) is None or int(latest_checkpoint(run).name.split("_")[1]) < 10):
            assert time.monotonic() < deadline and first.poll() is None, first.stdout.read() if first.poll() else ""
            time.sleep(0.05)
    finally:
        # The whole 4-rank job goes away at once: the agent and its workers (which torchrun puts in
        # sessions of their own, so killing the agent's group is not enough).
        subprocess.run(["pkill", "-9", "-f", f"nanotitan.cli train .*{run}"], check=False)
        os.killpg(first.pid, signal.SIGKILL)
        out_first = first.communicate(timeout=60)[0]
    assert "planner: world 4" in out_first

    second = _torchrun(2, run, corpus_dir)
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out
    assert "planner: world 2" in out and "resumed from" in out
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    start = int(out.split("resumed from")[1].split(" at step ")[1].split()[0])
    assert 10 <= start < STEPS
    after = {r["step"]: r for r in recs[-(STEPS - start):]}
    assert sorted(after) == list(range(start + 1, STEPS + 1))
    assert after[STEPS]["dp"] * after[STEPS]["pp"] * after[STEPS]["ep"] == 2
    for step, r in after.items():
        assert abs(r["loss"] - full[step]) <= 1e-5 * abs(full[step]), (step, r["loss"], full[step])
