"""How fast an elastic job notices a dead or frozen node, and what the kill costs (issue 49, item 8). Runs against
any tree (PYTHONPATH picks it): two loopback "nodes" of one rank each (the test model, K = 5, collectives paced
by the link emulation so the job outlasts the slowest detection), node 1 joins, and once its first snapshot unit
is on node 0 and node 0's next rank is warm (imported), one event hits node 1:

    node     kill -9 of node 1's agent and ranks (the whole node, as tests/elastic/test_elastic_replica.py;
             a rank dies with its agent anyway: cli.warm_rank's parent-death signal)
    freeze   SIGSTOP of node 1's agent and rank (a frozen node, a pulled cable)

Printed per event, as this script sees node 0's output (polled every 20 ms): for `node`, `detect_s` = the kill to
node 0's `node 1 lost` line (a tree before issue 49 prints none: node 0's own rank fails first on the closed
connection, and the wait for node 1's beat is the change's `rendezvous` part), `change_seen_s` = the kill to the
change record, and the record's pause, parts and steps lost; for `freeze`, `detect_s` = the stop to node 0's
line naming node 1's failure.

    PYTHONPATH=TREE/src:. python scripts/experiments/elastic_detect.py [node freeze] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.helpers, from the repository root

from tests.conftest import make_corpus  # noqa: E402
from tests.helpers.elastic import _agent, _changes, _records, elastic_args  # noqa: E402

STEPS = 3000


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return out


def _warm_ready(agent_pid: int) -> bool:
    """Whether an agent's next ranks (started ahead: elastic/agent.py's warm ranks) have imported: each touches
    the file its $NANOTITAN_WARM_READY names. A node dies long after the last change as a rule; the pause then
    holds no imports."""
    ready, var = [], b"NANOTITAN_WARM_READY="
    for pid in _children(agent_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ready += [Path(os.fsdecode(v[len(var):])).exists() for v in env if v.startswith(var)]
    return len(ready) >= 2 and all(ready)  # the running rank (once warm itself) and the next one


def _wait(what: str, cond, agents, logs, timeout_s: float = 300.0, poll_s: float = 0.02) -> float:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end or any(a.poll() is not None for a in agents):
            tail = "\n".join(f"--- agent {i} ---\n{p.read_text()[-3000:]}" for i, p in enumerate(logs))
            raise SystemExit(f"waiting for {what}: an agent exited or timed out\n{tail}")
        time.sleep(poll_s)
    return time.monotonic()


def one(event: str, corpus: Path, tmp: Path) -> dict:
    run = tmp / "run"
    args = elastic_args(corpus, run, tmp, STEPS, "1:2", f"detect{event}") + [
        "--parallel.emulate", "h800", "--parallel.emulate_node_size", "1", "--parallel.emulate_dilation", "0.002"]
    logs = [tmp / f"agent{i}.log" for i in range(2)]
    files = [open(p, "w") for p in logs]
    agents: list[subprocess.Popen] = []
    victims: list[int] = []
    try:
        agents.append(_agent(args, files[0]))
        _wait("node 0's store", lambda: "hosting the store" in logs[0].read_text(), agents, logs)
        agents.append(_agent(args, files[1]))
        _wait("the join", lambda: len(_changes(run)) >= 1, agents, logs)
        # a snapshot of generation 2 on both nodes (the kill then resumes from it)
        since = _changes(run)[0]["step"]
        _wait("a snapshot after the join", lambda: _records(run) and _records(run)[-1]["step"] >= since + 7,
              agents, logs)
        _wait("node 0's warm rank", lambda: _warm_ready(agents[0].pid), agents, logs)
        ranks = _children(agents[1].pid)
        victims = ranks + [agents[1].pid]
        before = logs[0].read_text()
        t0 = time.monotonic()
        if event == "node":
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
        else:
            for pid in victims:
                os.kill(pid, signal.SIGSTOP)
        rest = agents[:1]
        if event == "node":
            seen = {}

            def changed():
                if "lost" not in seen and "node 1 lost" in logs[0].read_text()[len(before):]:
                    seen["lost"] = time.monotonic()
                return len(_changes(run)) >= 2

            t1 = _wait("the change", changed, rest, logs)
            rec = _changes(run)[1]
            new = logs[0].read_text()[len(before):]
            lost = re.search(r"node 1 lost[^\n]*", new)
            return {"event": event, "detect_s": round(seen["lost"] - t0, 2) if "lost" in seen else None,
                    "change_seen_s": round(t1 - t0, 2), "pause_s": round(rec["pause_s"], 2),
                    "steps_lost": rec["steps_lost"], "parts_s": {k: round(v, 2) for k, v in rec["parts_s"].items()},
                    "line": lost.group(0) if lost else ""}
        t1 = _wait("node 0's failure line", lambda: re.search(r"failed on node 1|node 1 lost",
                                                               logs[0].read_text()[len(before):]), rest, logs)
        line = re.search(r"[^\n]*(failed on node 1|node 1 lost)[^\n]*", logs[0].read_text()[len(before):]).group(0)
        return {"event": event, "detect_s": round(t1 - t0, 2), "line": line.strip()}
    finally:
        _end(victims, agents, files)


def _end(victims: list[int], agents: list[subprocess.Popen], files) -> None:
    """Every process this run started, gone (a stopped one included), and the logs closed."""
    groups = [a.pid for a in agents if a.poll() is None]
    for pid, kill in [(p, os.kill) for p in victims] + [(g, os.killpg) for g in groups]:
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    [a.wait() for a in agents]
    [f.close() for f in files]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("events", nargs="*", default=["node", "freeze"])
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="elastic-detect-") as d:
        corpus = make_corpus(Path(d) / "corpus")
        os.environ.setdefault("NANOTITAN_CACHE", str(Path(d) / "cache"))
        for i in range(a.repeat):
            for j, event in enumerate(a.events):
                tmp = Path(d) / f"{event}{i}_{j}"
                tmp.mkdir()
                print(json.dumps(one(event, corpus, tmp)), flush=True)


if __name__ == "__main__":
    main()
