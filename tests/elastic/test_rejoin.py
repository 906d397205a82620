"""A node wrongly dropped comes back (elastic/liveness.py, agent.py, coordinator.py): node 1's agent is paused
(SIGSTOP) for 6 s, longer than elastic.silent_s (set to 3 s here), while both nodes train. Node 0 judges it lost
and the job shrinks to node 0 from the newest snapshot; when node 1's agent runs again it says in one line that it
was dropped and why, its Beater reconnects, it asks to join again, and the job grows back at the next generation
(was: node 1 sat idle for good, told only "the liveness connection to node 0 ended"). No step is lost beyond the
replay: every logged loss, replays included, is the single process's. A notice to node 0 ends the job once the
grown job trains: the test's events, not a step count, set its length."""

import signal
import time

import pytest

from tests.helpers.elastic import (CONSTANT, LONG, K, _agent, _await, _changes, _records, agent_logs, elastic_args,
                                   end_by_notice, losses_match_one_process, reap, start_host)

SILENT_S = 3.0
PAUSE_S = 6.0


@pytest.mark.slow
@pytest.mark.timeout(900)  # several agents' jobs on the shared cores: 3-5 min under load
def test_a_paused_agent_is_dropped_then_joins_again(corpus_dir, tmp_path):
    from nanotitan.config.config import load_config
    from nanotitan.elastic.rank import snapshot_root

    run = tmp_path / "elastic"
    args = elastic_args(corpus_dir, run, tmp_path, LONG, "1:2", "rejoin") + [
        "--elastic.silent_s", str(SILENT_S), *CONSTANT]
    root0 = snapshot_root(load_config(None, args), 0)
    logs, files = agent_logs(tmp_path, 2)
    agents = []
    try:
        start_host(args, agents, files, logs)
        agents.append(_agent(args, files[1]))
        _await("node 1's first replica on node 0", lambda: any(root0.glob("step_*/g2-node1")), agents, logs, 300)
        reached = _records(run)[-1]["step"]
        agents[1].send_signal(signal.SIGSTOP)
        time.sleep(PAUSE_S)
        agents[1].send_signal(signal.SIGCONT)
        _await("node 1 back in the job", lambda: len(_changes(run)) >= 3, agents, logs)
        end = end_by_notice(agents, run, logs, _changes(run)[2]["step"] + 3)
    finally:
        out = reap(agents, files, logs)
    changes = _changes(run)  # shrinks at the loss, grows back at the next generation
    codes = [a.returncode for a in agents]
    events = [(c["event"], c["nodes"]) for c in changes]
    assert codes == [143, 143] and events == [("join", [1, 2]), ("failure", [2, 1]), ("join", [1, 2])], (changes, out)
    failure = changes[1]
    assert failure["step"] >= reached - K and 0 <= failure["steps_lost"] <= K, (failure, reached)
    node1 = logs[1].read_text()
    dropped = [l for l in node1.splitlines() if "was dropped" in l]
    assert len(dropped) == 1 and dropped[0].startswith("nanotitan elastic: node 1 was dropped from the job at "
                                                       "generation 2: node 1 sent no beat for 3.") \
        and dropped[0].endswith("(frozen, or its network is down); it asks to join again"), node1
    assert "node 1 joined again" in node1 and "Traceback" not in node1, node1
    losses_match_one_process(corpus_dir, tmp_path, run, end, CONSTANT)
