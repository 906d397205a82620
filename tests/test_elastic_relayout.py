"""Re-layout on the fly (issue 24) with loopback "nodes": each node is one `nanotitan train --elastic.*` command.

Two nodes start (world 2: dp=2), a third joins at about step 10 (world 3: pp=3), the second gets a SIGTERM notice
at about step 30 (world 2 again), and the job finishes. Planned changes lose nothing: every step is logged once,
and every loss and the final parameters equal an uninterrupted single-process run at the same global batch
(the equivalence rule, DESIGN §4)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.mp import free_port
from tests.test_equivalence import LR, B, base_args, layout_args

STEPS = 60
AGENT_TIMEOUT_S = 400


def _agent(args: list[str], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nanotitan.cli", "train", *args], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def _records(run) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def _changes(run) -> list[dict]:
    path = run / "elastic.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def _await(what: str, cond, agents, logs, timeout_s: float = 240.0) -> None:
    """Poll until cond() holds; fail with every agent's output if one exits first or time runs out."""
    end = time.monotonic() + timeout_s
    while not cond():
        ended = [i for i, a in enumerate(agents) if a.poll() is not None]
        if ended or time.monotonic() > end:
            out = "\n".join(f"--- agent {i} ---\n{p.read_text()}" for i, p in enumerate(logs))
            pytest.fail(f"waiting for {what}: agents {ended} exited / timed out\n{out}")
        time.sleep(0.1)


@pytest.mark.slow
def test_join_and_notice_lose_nothing(corpus_dir, tmp_path):
    from nanotitan.config import load_config
    from nanotitan.train import Trainer

    run = tmp_path / "elastic"
    args = base_args(corpus_dir, run) + [
        "--train.steps", str(STEPS), "--train.global_batch", str(B), "--parallel.auto", "true",
        "--parallel.timeout_s", "60", "--elastic.nodes", "2:3", "--elastic.nproc_per_node", "1",
        "--elastic.endpoint", f"127.0.0.1:{free_port()}", "--elastic.id", "relayout",
        "--elastic.join_timeout_s", "120"]
    logs = [tmp_path / f"agent{i}.log" for i in range(3)]
    files = [open(p, "w") for p in logs]
    agents: list[subprocess.Popen] = []
    try:
        agents.append(_agent(args, files[0]))  # node 0: the first to bind the endpoint hosts the store
        _await("node 0's store", lambda: "hosting the store" in logs[0].read_text(), agents, logs)
        agents.append(_agent(args, files[1]))
        _await("step 10", lambda: len(_records(run)) >= 10, agents, logs)
        agents.append(_agent(args, files[2]))  # joins
        _await("the join's re-layout", lambda: len(_changes(run)) >= 1, agents, logs)
        _await("step 30", lambda: len(_records(run)) >= 30, agents, logs)
        agents[1].send_signal(signal.SIGTERM)  # a preemption notice to node 1's agent
        for a in agents:
            a.wait(timeout=AGENT_TIMEOUT_S)
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
        for f in files:
            f.close()
    out = "\n".join(f"--- agent {i} ---\n{p.read_text()}" for i, p in enumerate(logs))
    assert [a.returncode for a in agents] == [0, 0, 0], out

    # Two changes, each to the planner's layout for its world, nothing lost.
    changes = _changes(run)
    assert [(c["event"], c["nodes"], c["steps_lost"]) for c in changes] == [("join", [2, 3], 0), ("notice", [3, 2], 0)], out
    assert [c["new"].split(" M=")[0] for c in changes] == ["dp=1 pp=3 ep=1", "dp=2 pp=1 ep=1"], changes
    assert 10 <= changes[0]["step"] < changes[1]["step"] < STEPS, changes

    # Every step logged once, each loss the single process's.
    torch.set_num_threads(1)
    ref = Trainer(load_config(None, base_args(corpus_dir, tmp_path / "ref") + layout_args(1, 1, 1)
                              + ["--train.steps", str(STEPS)]))
    full = {r["step"]: r["loss"] for r in ref.train()["history"]}
    steps = [r["step"] for r in _records(run)]
    assert steps == list(range(1, STEPS + 1)), steps
    for r in _records(run):
        assert abs(r["loss"] - full[r["step"]]) <= 1e-5 * abs(full[r["step"]]), (r["step"], r["loss"], full[r["step"]])

    # The final checkpoint, loaded into one process, holds the single process's parameters.
    final = Trainer(load_config(None, base_args(corpus_dir, tmp_path / "load") + layout_args(1, 1, 1)
                                + ["--train.steps", str(STEPS), "--train.resume", str(run / "checkpoints" / f"step_{STEPS}")]))
    assert final.start_step == STEPS
    want = dict(ref.model.named_parameters())
    for name, t in final.model.named_parameters():
        torch.testing.assert_close(t, want[name], rtol=1e-4, atol=1e-3 * LR * STEPS, msg=lambda s: f"{name}: {s}")
