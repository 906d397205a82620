"""At most K steps lost, even under lag (elastic/snapshot.py SnapshotWriter.settle, replicas.py): three loopback
nodes, one rank each (pp=3), K = 5. Node 1's pushes to node 2 are held back (a slow link: agent.PUSH_HOLD_ENV), so
its newest unit is on node 1 only for HOLD_S after each snapshot. The job waits for each copy before the step after
the snapshot counts: the steps reached never run more than K past node 1's newest copy on node 2. Then node 1 itself
is lost (its agent and ranks killed -9, its snapshot dir deleted) while its newest unit is on no other node: the job
goes on with nodes 0 and 2 from node 1's snapshot before, losing at most K steps (was: training ran on while the
copies lagged, and the loss went back to the newest copy that had arrived: more than K), and every logged loss
(replays included) is the single process's. A notice to node 0 ends the job once nodes 0 and 2 train: the test's
events, not a step count, set its length."""

import shutil
import signal

import pytest

from tests.helpers.elastic import (CONSTANT, LONG, K, _agent, _await, _changes, _kill_ranks, _records, agent_logs,
                                   elastic_args, end_by_notice, losses_match_one_process, reap, start_host)

HOLD_S = 4.0  # each of node 1's pushes held this long: many steps at this test's step times


def _units(root, node: int) -> set[int]:
    """The steps of generation 2's committed units of origin `node` under snapshot dir `root`."""
    return {int(d.parent.name[5:]) for d in root.glob(f"step_*/g2-node{node}")}


@pytest.mark.slow
@pytest.mark.timeout(900)  # several agents' jobs on the shared cores: 3-5 min under load
def test_a_lagging_node_lost_costs_no_more_than_k_steps(corpus_dir, tmp_path):
    from nanotitan.config.config import load_config
    from nanotitan.elastic.agent import PUSH_HOLD_ENV
    from nanotitan.elastic.rank import snapshot_root

    run = tmp_path / "elastic"
    args = elastic_args(corpus_dir, run, tmp_path, LONG, "2:3", "lag") + list(CONSTANT)
    cfg = load_config(None, args)
    root1, root2 = snapshot_root(cfg, 1), snapshot_root(cfg, 2)
    logs, files = agent_logs(tmp_path, 3)
    agents, lags = [], []

    def behind() -> bool:
        """Node 1 has 2 units of generation 2 (all three train), the newest on node 1 only; meanwhile, the steps
        reached against node 1's newest copy on node 2."""
        reached, copied = _records(run), _units(root2, 1)
        if reached and copied:
            lags.append(reached[-1]["step"] - max(copied))
        own = _units(root1, 1)
        return len(own) >= 2 and max(own) not in _units(root2, 1)

    try:
        start_host(args, agents, files, logs)
        agents.append(_agent(args, files[1], {PUSH_HOLD_ENV: str(HOLD_S)}))
        _await("node 1 in the job", lambda: "node 1 (joined" in logs[1].read_text(), agents, logs)
        agents.append(_agent(args, files[2]))
        _await("node 1's newest unit on node 1 only", behind, agents, logs, 400)
        _kill_ranks(agents[1])
        agents[1].send_signal(signal.SIGKILL)
        agents[1].wait()
        shutil.rmtree(root1)
        _await("nodes 0 and 2 alone", lambda: len(_changes(run)) >= 2, [agents[0], agents[2]], logs)
        end = end_by_notice(agents, run, logs, _changes(run)[1]["step"] + 3)
    finally:
        out = reap(agents, files, logs)
    assert [agents[0].returncode, agents[2].returncode] == [143, 143], out  # the job ended on node 0's notice
    changes = _changes(run)
    assert [(c["event"], c["nodes"]) for c in changes] == [("join", [2, 3]), ("failure", [3, 2])], (changes, out)
    assert 0 <= changes[1]["steps_lost"] <= K, changes[1]  # was 7: back to the join's checkpoint
    assert lags and max(lags) <= K, lags  # the job waited for node 1's copies
    losses_match_one_process(corpus_dir, tmp_path, run, end, CONSTANT)
