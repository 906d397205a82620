"""The elastic re-layout chooses context parallel (issue 50 item 4): loopback "nodes" of one rank each share one
host's memory, which the planner's CPU profile divides among the ranks on it. The test model at a sequence of 128
tokens, on a host whose memory holds one process's step but, split between two ranks, only a layout that splits the
sequence: node 0 starts alone (world 1: cp=1), node 1 joins (world 2: the planner's choice has cp=2, the step-N
checkpoint of the one-process layout resharded onto it), then node 1 gets a notice (world 1 again: cp=1, from the
CP2 layout's checkpoint), and a notice to node 0 ends the job once that layout trains: the test's events, not a
step count, set the job's length (a joiner's imports take longer on a loaded machine). Both changes are planned,
so no step is lost, and every logged loss and the final parameters equal an uninterrupted single-process run at the
same global batch (DESIGN §4)."""

import dataclasses
import json
import math
import signal
import subprocess

import pytest

from tests.helpers.equivalence import B, m
from tests.helpers.elastic import CONSTANT, LONG, _agent, _await, _changes, _records, elastic_args, end_by_notice
from tests.helpers.elastic import agent_logs, final_params_match, losses_match_one_process, reap, start_host

S = 128
# 2 sequences of 128 tokens a microbatch: activations outweigh the weights
LONG_SEQ = ("--train.seq_len", str(S), *CONSTANT)


def capped_host(cfg, path) -> float:
    """Write a profile (the calibrated CPU one, with less memory) under which 2 ranks fit only by splitting the
    sequence: the host's memory is twice the geometric middle between the smallest peak per rank of a cp=2 layout
    and the smallest of any cp=1, tp=1 layout of 2 ranks (DP, PP, EP, zero 0-3 keep a microbatch's activations
    whole). TP2 with SP would fit too (it cuts them as well); the planner prefers CP2 by its speed. Returns the
    host's bytes."""
    from nanotitan.config.hardware import get_hardware
    from nanotitan.config.hf_config import resolve_model
    from nanotitan.plan.cost import PlanOptions
    from nanotitan.plan.search import plan

    hw = get_hardware("cpu-gloo")
    preds = plan(resolve_model(cfg), 2, hw, PlanOptions(global_batch=B, micro_batch=m))  # as resolve.py plans
    split = min(p.peak_mem for p in preds if p.layout.cp > 1)
    whole = min(p.peak_mem for p in preds if p.layout.cp == 1 and p.layout.tp == 1)
    assert split < whole, (split, whole)  # CP saves what no other axis of 2 ranks does
    host = 2 * math.sqrt(split * whole)
    path.write_text(json.dumps(dataclasses.asdict(dataclasses.replace(hw, mem_bytes=host))))
    return host


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_join_chooses_cp_and_notice_leaves_it(corpus_dir, tmp_path, monkeypatch):
    from nanotitan.config.config import load_config

    run = tmp_path / "elastic"
    args = elastic_args(corpus_dir, run, tmp_path, LONG, "1:2", "cp") + list(LONG_SEQ)
    capped_host(load_config(None, args), tmp_path / "host.json")
    monkeypatch.setenv("NANOTITAN_HARDWARE", str(tmp_path / "host.json"))  # the agents' planner reads it
    logs, files = agent_logs(tmp_path, 2)
    agents: list[subprocess.Popen] = []
    try:
        start_host(args, agents, files, logs)
        agents.append(_agent(args, files[1]))  # joins once its warm rank has imported
        _await("the join's re-layout", lambda: len(_changes(run)) >= 1, agents, logs, 300)
        # past a snapshot at CP2 (K = 5), then a preemption notice to node 1's agent
        at = _changes(run)[0]["step"] + 6
        _await(f"step {at}", lambda: _records(run)[-1]["step"] >= at, agents, logs)
        agents[1].send_signal(signal.SIGTERM)
        _await("the notice's re-layout", lambda: len(_changes(run)) >= 2, agents[:1], logs)
        end = end_by_notice(agents, run, logs, _changes(run)[1]["step"] + 3)
    finally:
        out = reap(agents, files, logs)
    assert [a.returncode for a in agents] == [143, 143], out  # each left on its notice (SIGTERM): 143
    assert f"stopped by SIGTERM on node 0 at step {end}" in out, out

    # The join re-lays the job out with CP (the sequence split over both ranks), the notice without it; nothing lost.
    changes = _changes(run)
    assert [(c["event"], c["nodes"]) for c in changes] == [("join", [1, 2]), ("notice", [2, 1])], out
    assert [c["new"].split(" M=")[0] for c in changes] == ["dp=1 pp=1 ep=1 tp=1 cp=2",
                                                           "dp=1 pp=1 ep=1 tp=1 cp=1"], changes
    assert [c["steps_lost"] for c in changes] == [0, 0] and changes[0]["step"] < changes[1]["step"] < end, changes
    by_step = {r["step"]: r["cp"] for r in _records(run)}
    assert {by_step[s] for s in range(changes[0]["step"] + 1, changes[1]["step"] + 1)} == {2}, by_step

    # Every step logged once, each loss the single process's.
    ref, steps = losses_match_one_process(corpus_dir, tmp_path, run, end, LONG_SEQ)
    assert len(steps) == end, steps

    # The stop's checkpoint, loaded into one process, holds the single process's parameters.
    final_params_match(corpus_dir, tmp_path, run, ref, end, LONG_SEQ)
