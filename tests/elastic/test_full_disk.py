"""A full disk during a save costs at most K steps (elastic/snapshot.py SnapshotWriter._rescue): two loopback
nodes, one rank each, K = 5. Node 1's ranks cannot write (RLIMIT_FSIZE 1 KiB: EFBIG, as a full disk) when a snapshot
is due: its shard is sent to node 0's rank, which writes it into node 0's unit. Then node 1 gets a notice, and the
stop's checkpoint fails on node 1's disk: the generation fails, node 1 leaves (143), and node 0 goes on alone from
that rescued snapshot, losing at most K steps (was: `snapshot of step N not kept`, and the job went back to the
snapshot before it: more than K); a notice to node 0 ends the job once node 0 trains alone (the test's events, not a
step count, set its length). Every logged loss, replays included, is the single process's."""

import resource
import signal

import pytest

from tests.helpers.elastic import (CONSTANT, LONG, K, _agent, _await, _changes, agent_logs, elastic_args,
                                   end_by_notice, losses_match_one_process, reap, start_host)
from tests.helpers.sockets import tree


def _fsize(pid: int, soft: int) -> None:
    try:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, resource.prlimit(pid, resource.RLIMIT_FSIZE)[1]))
    except ProcessLookupError:
        pass  # a warm rank replaced meanwhile


@pytest.mark.slow
@pytest.mark.timeout(900)  # several agents' jobs on the shared cores: 3-5 min under load
def test_a_full_disk_during_a_save_with_a_notice_costs_at_most_k_steps(corpus_dir, tmp_path):
    run = tmp_path / "elastic"
    args = elastic_args(corpus_dir, run, tmp_path, LONG, "1:2", "disk") + list(CONSTANT)
    logs, files = agent_logs(tmp_path, 2)
    agents = []
    try:
        start_host(args, agents, files, logs)
        agents.append(_agent(args, files[1]))
        _await("node 1 in the job", lambda: _changes(run), agents, logs, 300)
        for pid in tree(agents[1].pid) - {agents[1].pid}:  # its ranks (the warm ones too), not its agent
            _fsize(pid, 1024)
        _await("a snapshot node 1 could not write", lambda: "rank 1 could not write its shard" in logs[0].read_text()
               or "not kept: rank 1" in logs[0].read_text(), agents, logs)
        agents[1].send_signal(signal.SIGTERM)
        _await("node 0 alone", lambda: len(_changes(run)) >= 2, agents[:1], logs)
        end = end_by_notice(agents, run, logs, _changes(run)[1]["step"] + 3)
    finally:
        out = reap(agents, files, logs)
    changes = _changes(run)
    codes = [a.returncode for a in agents]
    assert codes == [143, 143], (codes, out)  # each on its notice
    assert [c["event"] for c in changes] == ["join", "notice + failure"], (changes, out)
    assert "storage error" in out and 0 <= changes[1]["steps_lost"] <= K, (changes[1], out)
    losses_match_one_process(corpus_dir, tmp_path, run, end, CONSTANT)
