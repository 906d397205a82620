"""At most K steps lost, even under lag (elastic/replicas.py): three loopback nodes, one rank each (pp=3), K = 5.
Node 1's pushes to node 2 are held back (a slow link: agent.PUSH_HOLD_ENV), so node 2's copies of node 1's units
are at least 3 snapshots behind; then node 2 is lost (its agent and ranks killed -9, its snapshot dir deleted). The
job goes on with nodes 0 and 1 from the newest step whose units are on nodes that answer (node 0's own and its
copy of node 2's, node 1's own), losing at most K steps, and every logged loss (replays included) is the single
process's. Replicas are kept per origin node, so node 2's lagging copies of node 1's units were kept as they
arrived (checked before the kill)."""

import shutil
import signal

import pytest

from tests.helpers.elastic import (AGENT_TIMEOUT_S, K, _agent, _await, _changes, _kill_ranks, _records, agent_logs,
                                   elastic_args, losses_match_one_process, reap, start_host)

STEPS = 200
HOLD_S = 10.0  # each of node 1's pushes held this long: several snapshots at this test's step times


def _newest(root, node: int) -> int:
    steps = [int(d.parent.name[5:]) for d in root.glob(f"step_*/g*-node{node}") if not d.name.endswith(".tmp")]
    return max(steps, default=-1)


@pytest.mark.slow
@pytest.mark.timeout(900)  # several agents' jobs on the shared cores: 3-5 min under load
def test_a_lagging_node_costs_no_more_than_k_steps_when_another_is_lost(corpus_dir, tmp_path):
    from nanotitan.config.config import load_config
    from nanotitan.elastic.agent import PUSH_HOLD_ENV
    from nanotitan.elastic.rank import snapshot_root

    run = tmp_path / "elastic"
    args = elastic_args(corpus_dir, run, tmp_path, STEPS, "2:3", "lag")
    cfg = load_config(None, args)
    root2 = snapshot_root(cfg, 2)
    logs, files = agent_logs(tmp_path, 3)
    agents = []
    try:
        start_host(args, agents, files, logs)
        agents.append(_agent(args, files[1], {PUSH_HOLD_ENV: str(HOLD_S)}))
        _await("node 1 in the job", lambda: "node 1 (joined" in logs[1].read_text(), agents, logs)
        agents.append(_agent(args, files[2]))
        # all three train (generation 2), and node 2's copies of node 1's units lag 3 snapshots behind
        _await("node 1's first unit on node 2", lambda: _newest(root2, 1) >= 0, agents, logs, 400)
        _await("3 snapshots of lag", lambda: _records(run)[-1]["step"] >= _newest(root2, 1) + 3 * K, agents, logs, 400)
        lag = _records(run)[-1]["step"] - _newest(root2, 1)
        _kill_ranks(agents[2])
        agents[2].send_signal(signal.SIGKILL)
        agents[2].wait()
        shutil.rmtree(root2)
        for a in agents[:2]:
            a.wait(timeout=AGENT_TIMEOUT_S)
    finally:
        out = reap(agents, files, logs)
    assert [a.returncode for a in agents[:2]] == [0, 0], out
    assert lag >= 3 * K, lag

    changes = _changes(run)
    assert [(c["event"], c["nodes"]) for c in changes] == [("join", [2, 3]), ("failure", [3, 2])], (changes, out)
    assert 0 <= changes[1]["steps_lost"] <= K, (changes[1], lag)
    losses_match_one_process(corpus_dir, tmp_path, run, STEPS)
