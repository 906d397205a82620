"""Exit codes that tell the truth (elastic/agent.py, docs/reliability.md):

- SIGTERM to node 0 alone while node 1 trains: node 0 never leaves before its coordinator's `done` (was: exit 0,
  "node 0 left the job", in 1 of 2 runs, and node 1 then exited 1 with 162 lines of tracebacks when the store went
  away under it). Every node exits 143 with the line that names the checkpoint and how to resume, no traceback,
  and nothing left in RAM or /tmp. Run 5 times; in 3 of them node 1's agent is held (SIGSTOP, 2 s, below
  elastic.silent_s) over the SIGTERM, which opened the race every time on the old tree.
- Ctrl-C to a one-node job: one line, exit 130 (was: an 18-line traceback), nothing left behind.
- An agent whose store is gone (node 0 killed -9): one line, exit 1, never a traceback nor torch's C++ frames; its
  snapshot dir freed, and the temp dir of the killed node 0 swept.
- A node leaving on its notice while the job goes on: exit 143 with one line, its snapshot dir freed (was: left in
  RAM); the job finishes (0) without it."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.elastic import _agent, _changes, _kill_ranks, _records, agent_logs, agent_tmp, elastic_args, leftovers, reap

RUNS = 5
HELD = (0, 2, 4)  # the runs whose node 1 agent is held over the SIGTERM


def _job(corpus_dir, tmp_path, i: int, nodes: str, steps: int = 100000) -> dict:
    base = tmp_path / f"job{i}"
    base.mkdir()
    run = base / "run"
    args = elastic_args(corpus_dir, run, base, steps, nodes, f"end{i}")
    logs, files = agent_logs(base, int(nodes.split(":")[-1]))
    return {"base": base, "run": run, "args": args, "logs": logs, "files": files, "agents": [], "t": None}


def _trained(job, n: int) -> bool:
    recs = _records(job["run"])
    return len(recs) >= n


@pytest.mark.slow
@pytest.mark.timeout(900)  # several agents' jobs on the shared cores: 3-5 min under load
def test_sigterm_to_node_0_alone_ends_every_node_truthfully_and_ctrl_c_in_one_line(corpus_dir, tmp_path):
    jobs = [_job(corpus_dir, tmp_path, i, "2") for i in range(RUNS)]
    ctrl_c = _job(corpus_dir, tmp_path, RUNS, "1")
    gone = _job(corpus_dir, tmp_path, RUNS + 1, "2")  # node 0 killed -9: node 1's store is gone
    leave = _job(corpus_dir, tmp_path, RUNS + 2, "1:2", steps=60)  # node 1 leaves on its notice, the job goes on
    everyone = jobs + [ctrl_c, gone, leave]
    held_until: dict[int, float] = {}  # job -> when its node 1's agent runs again
    try:
        for job in everyone:  # every node 0 at once: they import side by side
            job["agents"].append(_agent(job["args"], job["files"][0], agent_tmp(job["base"])))
        end = time.monotonic() + 240
        for job in everyone:  # then each joiner, once its node 0 hosts the store
            while "hosting the store" not in job["logs"][0].read_text():
                assert job["agents"][0].poll() is None and time.monotonic() < end, job["logs"][0].read_text()
                time.sleep(0.1)
            if job is not ctrl_c:
                job["agents"].append(_agent(job["args"], job["files"][1], agent_tmp(job["base"])))
        pending = list(everyone)
        end = time.monotonic() + 600
        while pending or held_until:  # each job, once it trains: its signal
            assert time.monotonic() < end, [j["base"].name for j in pending]
            for i, t in list(held_until.items()):
                if time.monotonic() >= t:
                    jobs[i]["agents"][1].send_signal(signal.SIGCONT)
                    del held_until[i]
            for i, job in enumerate(list(pending)):
                assert all(a.poll() is None for a in job["agents"]), reap(job["agents"], [], job["logs"])
                if not _trained(job, 3):
                    continue
                pending.remove(job)
                if job is ctrl_c:
                    job["agents"][0].send_signal(signal.SIGINT)
                    continue
                if job is gone:
                    _kill_ranks(job["agents"][0])
                    job["agents"][0].kill()
                    continue
                if job is leave:
                    if not _changes(job["run"]):  # node 1 is a member (generation 2) first
                        pending.append(job)
                        continue
                    job["agents"][1].send_signal(signal.SIGTERM)
                    continue
                if jobs.index(job) in HELD:  # held 2 s over the SIGTERM (the loop goes on with the other jobs)
                    job["agents"][1].send_signal(signal.SIGSTOP)
                    held_until[jobs.index(job)] = time.monotonic() + 2.0
                job["agents"][0].send_signal(signal.SIGTERM)
            time.sleep(0.1)
        for job in everyone:
            for a in job["agents"]:
                a.wait(timeout=300)
    finally:
        outs = [reap(job["agents"], job["files"], job["logs"]) for job in everyone]
    outs = outs[:len(jobs) + 2]

    for job, out in zip(jobs, outs):
        codes = [a.returncode for a in job["agents"]]
        assert codes == [143, 143], (codes, out)
        for log in job["logs"]:
            text = log.read_text()
            lines = [l for l in text.splitlines() if "stopped by SIGTERM on node 0 at step" in l]
            assert len(lines) == 1 and f"newest checkpoint {job['run']}/checkpoints/step_" in lines[0] \
                and lines[0].endswith("start the job again with --train.resume auto"), (log.name, text)
            assert "Traceback" not in text and "left the job" not in text, (log.name, text)
        assert leftovers(job["base"]) == [], leftovers(job["base"])
    text = ctrl_c["logs"][0].read_text()
    assert ctrl_c["agents"][0].returncode == 130, outs[-2]
    assert text.count("interrupted (SIGINT) on node 0 at step") == 1 and "Traceback" not in text, text
    assert leftovers(ctrl_c["base"]) == [], leftovers(ctrl_c["base"])

    text = gone["logs"][1].read_text()  # node 1, after node 0's kill -9
    assert gone["agents"][1].returncode == 1, outs[-1]
    assert text.count("node 0's store does not answer") == 1 and "Traceback" not in text and "frame #" not in text, text
    # node 0 could clean nothing (killed -9): its snapshot dir stays (the machine's memory), its temp dir was swept
    assert [p for p in leftovers(gone["base"]) if not p.endswith("-node0")] == [], leftovers(gone["base"])

    assert [a.returncode for a in leave["agents"]] == [0, 143], reap(leave["agents"], [], leave["logs"])
    text = leave["logs"][1].read_text()
    assert text.count("node 1 left the job on its notice (SIGTERM); the job goes on without it") == 1, text
    assert "Traceback" not in text and leftovers(leave["base"]) == [], leftovers(leave["base"])


def test_an_agent_whose_store_is_gone_ends_in_one_line(corpus_dir, tmp_path, capfd):
    """Node 0 (here: the process hosting the store) killed -9: the agent's next write fails; it ends with exit 1 and
    one line naming why, and frees its snapshot dir (was: a traceback out of the agent's tick)."""
    from datetime import timedelta

    import torch.distributed as dist

    from nanotitan.elastic.agent import Agent
    from nanotitan.elastic.auth import SignedStore
    from tests.helpers.elastic import _coordinator

    coord, _, _ = _coordinator(corpus_dir, tmp_path, "1:2")
    coord.close()
    host = subprocess.Popen([sys.executable, "-c", "import sys, time; from nanotitan.run.loopback import loopback_store; "
                             "s = loopback_store(); print(s.port, flush=True); time.sleep(600)"],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        port = int(host.stdout.readline())
        raw = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))
        agent = Agent(coord.cfg, [], SignedStore(raw, b"k" * 32, "bad", "launch"), bind="127.0.0.1")
        agent.node, agent.files.root = 1, tmp_path / "snapshots"
        agent.files.root.mkdir()
        agent.beat = time.monotonic()  # (no liveness connection here: node 0's `live` is not in this store)
        assert agent.tick() is None
        host.kill()
        host.wait()
        capfd.readouterr()
        agent.beat = 0.0  # its next beat is due
        assert agent.run() == 1
    finally:
        host.kill()
        host.wait()
    err = capfd.readouterr().err  # (torch's C++ warnings of the failed writes: silenced in the CLI's agent, not here)
    lines = [l for l in err.splitlines() if l.startswith("nanotitan") and "liveness" not in l]  # (no `live` here)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[-1].startswith("nanotitan elastic: node 1: node 0's store does not answer (") and \
        lines[-1].endswith("the job ended without its coordinator's word; start it again on every node with "
                           "--train.resume auto"), lines
    assert not agent.files.root.exists()
