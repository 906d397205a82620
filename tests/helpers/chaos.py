"""The chaos run (docs/reliability.md, "A chaos run"): a 3-node one-host elastic job under random faults, and what
each cost. Driven from outside the job, as a scheduler and a failing machine would: the job's own network is private
(run/netns.py), so everything is read from its files (RUN_DIR/elastic.jsonl, metrics.jsonl, the agents' output).

The job: the test model, one rank per node, `--elastic.nodes 2:3`, K = elastic.snapshot_every, every collective
paced by the network emulator (an H800 cluster with one rank per node, dilated: the links between nodes are slow),
train.max_restarts 3 (progress refunds them). Node 0 hosts the store and is never a victim until the end. Faults,
one at a time on a random member node other than node 0, each once the job trains steadily:

    sigterm    a notice: the node leaves after the step in flight (exit 143); planned: no step lost
    kill9      the whole node lost: its agent and ranks killed -9, its snapshot dir deleted; at most K steps lost
    pause      its agent stopped 2-8 s (SIGSTOP): past elastic.silent_s it is dropped (at most K steps lost) and
               joins again; below it, nothing happens
    full_disk  its ranks' writes fail (RLIMIT_FSIZE 1 KiB, as a full disk) while another node's notice makes the
               job save: the save fails, the generation restarts from a snapshot, at most K steps lost
    join       a new node joins (planned, no step lost); one in three joins over a slow link (its snapshot pushes
               held 8 s: agent.PUSH_HOLD_ENV)

A node that left or was lost is replaced by a join. At the end node 0 gets SIGTERM: every node still in the job must
exit 143. Reported: each fault with the change it caused (event, steps lost against K, pause), each agent's exit
code against the truthful one, and what was left behind (processes, snapshot dirs in RAM, temp dirs: the agents
share one TMPDIR, as one host's do, and each dir is put down to the agent its owner file names).
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from nanotitan.elastic.tempdirs import OWNER, start_ticks  # a pid seen with another start: another process
from tests.conftest import make_corpus
from tests.helpers.elastic import _agent, _changes, _records, elastic_args
from tests.helpers.sockets import tree

FAULTS = {"sigterm": 2, "kill9": 2, "pause": 2, "full_disk": 1}  # weights; joins refill the job to 3 nodes
EMULATE = ["--parallel.emulate", "h800", "--parallel.emulate_node_size", "1", "--parallel.emulate_dilation", "0.01"]
HOLD_S = 8.0  # a slow link's hold on each snapshot push
SETTLE_S = 240.0  # a fault's effect (a change record, a node's exit) is awaited this long


@dataclass
class Node:
    i: int  # the driver's count (its log)
    proc: subprocess.Popen
    log: Path
    slow: bool = False
    node: int | None = None  # the job's node id, once its agent said it
    expect: int | None = None  # the exit code that would be the truth; None: still in the job
    why: str = ""


@dataclass
class Fault:
    kind: str
    node: int
    t: float
    detail: str = ""
    changes: list = field(default_factory=list)  # the change records it caused
    verdict: str = ""


class Chaos:
    def __init__(self, out: Path, minutes: float, seed: int = 0, k: int = 5, log=lambda line: print(line, flush=True)):
        self.out, self.end, self.k, self.say = out, time.monotonic() + 60 * minutes, k, log
        self.rng = random.Random(seed)
        out.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("NANOTITAN_CACHE", str(out / "cache"))
        self.run = out / "run"
        self.args = elastic_args(make_corpus(out / "corpus"), self.run, out, 10 ** 7, "2:3", "chaos") + EMULATE + [
            "--train.max_restarts", "3", "--elastic.snapshot_every", str(k), "--run.log_every", "1"]
        self.nodes: list[Node] = []
        self.faults: list[Fault] = []
        self.seen: dict[int, int | None] = {}  # every process of the job seen: pid -> its start time
        self.files = []

    # --- the nodes -------------------------------------------------------------------------------------------
    def start(self, slow: bool = False) -> Node:
        i = len(self.nodes)
        log, tmp = self.out / f"agent{i}.log", self.out / "tmp"  # one host: the agents share its temp dir
        tmp.mkdir(parents=True, exist_ok=True)
        f = open(log, "w")  # noqa: SIM115 - closed in finish()
        self.files.append(f)
        env = {"TMPDIR": str(tmp), **({"NANOTITAN_PUSH_HOLD_S": str(HOLD_S)} if slow else {})}
        n = Node(i, _agent(self.args, f, env), log, slow)
        self.nodes.append(n)
        return n

    def _ids(self) -> None:
        import re

        for n in self.nodes:
            if n.node is None and (m := re.search(r"nanotitan elastic: node ([0-9]+) \((?:hosting|joined)",
                                                  n.log.read_text())):
                n.node = int(m.group(1))

    def _by_id(self, node: int) -> Node:
        return next(n for n in self.nodes if n.node == node and n.expect is None)

    def members(self) -> list[int]:
        """The current generation's members, from the newest change record (or node 0's first line)."""
        ch = _changes(self.run)
        if ch:
            return ch[-1]["members"]
        import re

        m = re.search(r"generation 1: nodes \[([0-9, ]+)\]", self.nodes[0].log.read_text())
        return [int(x) for x in m.group(1).split(",")] if m else []

    def _watch(self) -> None:
        """Every process of the job seen so far (its leftovers are counted at the end); an exit nobody expected."""
        for n in self.nodes:
            if n.proc.poll() is None:
                self.seen.update({pid: start_ticks(pid) for pid in tree(n.proc.pid) if pid not in self.seen})
            elif n.expect is None:
                n.expect, n.why = 143 if n.proc.returncode == 143 else -1, "exited on its own"

    def steady(self, timeout_s: float = SETTLE_S) -> bool:
        """Until the job trains steadily: 2 steps past its newest change, and every started node in it or gone."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            self._watch()
            self._ids()
            recs, ch = _records(self.run), _changes(self.run)
            if recs and (not ch or recs[-1]["step"] >= ch[-1]["step"] + 2) and len(self.members()) >= 2:
                live = {n.node for n in self.nodes if n.expect is None and n.node is not None}
                if live <= set(self.members()) or len(self.members()) == 3:
                    return True
            time.sleep(0.5)
        return False

    # --- faults ----------------------------------------------------------------------------------------------
    def inject(self) -> None:
        victims = [m for m in self.members() if m != 0]
        kind = self.rng.choices(list(FAULTS), weights=list(FAULTS.values()))[0]
        if kind == "full_disk" and len(victims) < 2:
            kind = "kill9"
        victim = self.rng.choice(victims)
        n = self._by_id(victim)
        fault = Fault(kind, victim, time.time())
        self.faults.append(fault)
        before = len(_changes(self.run))
        if kind == "sigterm":
            n.proc.send_signal(signal.SIGTERM)
            n.expect, n.why = 143, "SIGTERM (a notice)"
            self._await_exit(n)
            self._await_changes(fault, before, 1)
        elif kind == "kill9":
            for pid in sorted(tree(n.proc.pid), reverse=True):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            n.proc.wait()
            n.expect, n.why = -9, "killed -9"
            from nanotitan.config.config import load_config
            from nanotitan.elastic.rank import snapshot_root

            shutil.rmtree(snapshot_root(load_config(None, self.args), victim), ignore_errors=True)  # the machine's RAM
            self._await_changes(fault, before, 1)
        elif kind == "pause":
            pause = self.rng.uniform(2.0, 8.0)
            fault.detail = f"{pause:.1f} s"
            n.proc.send_signal(signal.SIGSTOP)
            time.sleep(pause)
            n.proc.send_signal(signal.SIGCONT)
            self._await_changes(fault, before, 2 if pause > 4.5 else 0)  # past elastic.silent_s (4): dropped, back
            if any("failure" in c["event"] for c in fault.changes) and len(fault.changes) < 2:
                self._await_changes(fault, before, 2)  # at the threshold, dropped after all: back too
        else:  # full_disk: the victim's ranks cannot write while another node's notice makes the job save
            other = self._by_id(self.rng.choice([v for v in victims if v != victim]))
            ranks = [p for p in tree(n.proc.pid) if p != n.proc.pid]
            for pid in ranks:
                _fsize(pid, 1024)
            fault.detail = f"with node {other.node}'s notice"
            other.proc.send_signal(signal.SIGTERM)
            other.expect, other.why = 143, "SIGTERM (the notice that made the job save)"
            self._await_exit(other)
            self._await_changes(fault, before, 1)
            for pid in tree(n.proc.pid):
                _fsize(pid, resource.RLIM_INFINITY)
        self.say(f"chaos: {fault.kind} node {fault.node} {fault.detail}: {fault.changes}")

    def _await_exit(self, n: Node) -> None:
        try:
            n.proc.wait(timeout=SETTLE_S)
        except subprocess.TimeoutExpired:
            pass

    def _await_changes(self, fault: Fault, before: int, want: int) -> None:
        end = time.monotonic() + SETTLE_S
        while len(_changes(self.run)) < before + want and time.monotonic() < end:
            self._watch()
            time.sleep(0.5)
        if want == 0:
            time.sleep(2 * 4.0)  # a loss would show within the silence threshold and a tick
        fault.changes = _changes(self.run)[before:]

    def join(self) -> None:
        slow = self.rng.random() < 1 / 3
        before = len(_changes(self.run))
        n = self.start(slow)
        fault = Fault("join", -1, time.time(), "over a slow link" if slow else "")
        self.faults.append(fault)
        self._await_changes(fault, before, 1)
        self._ids()
        fault.node = n.node if n.node is not None else -1
        self.say(f"chaos: join node {fault.node} {fault.detail}: {fault.changes}")

    # --- the run -----------------------------------------------------------------------------------------------
    def go(self) -> dict:
        try:
            self.start()
            end = time.monotonic() + 300
            while "hosting the store" not in self.nodes[0].log.read_text():
                assert self.nodes[0].proc.poll() is None and time.monotonic() < end, self.nodes[0].log.read_text()
                time.sleep(0.2)
            self.start()
            self.start()
            while time.monotonic() < self.end:
                if not self.steady():
                    self.say("chaos: the job did not settle")
                    break
                if len([n for n in self.nodes if n.expect is None]) < 3:
                    self.join()
                else:
                    self.inject()
            self.nodes[0].proc.send_signal(signal.SIGTERM)  # the end: node 0's notice ends the job
            for n in self.nodes:
                if n.expect is None:
                    n.expect, n.why = 143, "in the job when node 0 got SIGTERM"
            for n in self.nodes:
                try:
                    n.proc.wait(timeout=SETTLE_S)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            self.finish()
        return self.report()

    def finish(self) -> None:
        for n in self.nodes:
            if n.proc.poll() is None:
                n.proc.send_signal(signal.SIGCONT)
                os.killpg(n.proc.pid, signal.SIGKILL)
                n.proc.wait()
        for f in self.files:
            f.close()

    def report(self) -> dict:
        time.sleep(2.0)  # a rank's death with its parent (PR_SET_PDEATHSIG) is asynchronous
        alive = sorted(p for p, start in self.seen.items() if start is not None and start_ticks(p) == start)
        shm = self.out / "shm" / f"nanotitan-{os.getuid()}"
        in_ram = sorted(str(p) for p in shm.iterdir()) if shm.is_dir() else []
        temp = {}  # agent (by the pid in the dir's owner file; "?" without one) -> its temp dirs left
        by_pid = {n.proc.pid: n.i for n in self.nodes}
        for p in sorted((self.out / "tmp").iterdir()):
            if not p.name.startswith("torchinductor_"):  # torch's compile cache, shared on purpose
                temp.setdefault(by_pid.get(_owner(p), "?"), []).append(str(p))
        faults = []
        for f in self.faults:
            lost = [c["steps_lost"] for c in f.changes if "failure" in c["event"]]
            planned = [c["steps_lost"] for c in f.changes if "failure" not in c["event"]]
            ok = all(x <= self.k for x in lost) and all(x == 0 for x in planned)
            faults.append({"kind": f.kind, "node": f.node, "detail": f.detail,
                           "changes": [(c["event"], c["nodes"], c["steps_lost"], round(c["pause_s"], 1)) for c in f.changes],
                           "steps_lost": max(lost + planned, default=0), "within_k": ok})
        exits = [{"agent": n.i, "node": n.node, "exit": n.proc.returncode, "truth": n.expect, "why": n.why,
                  "truthful": n.proc.returncode == n.expect} for n in self.nodes]
        out = {"k": self.k, "faults": faults, "exits": exits, "processes_left": alive, "snapshot_dirs_left": in_ram,
               "temp_dirs_left": {i: t for i, t in temp.items() if t}}
        (self.out / "chaos.json").write_text(json.dumps(out, indent=1))
        (self.out / "chaos.md").write_text(table(out))
        return out


def _fsize(pid: int, soft: int) -> None:
    """Process `pid`'s soft RLIMIT_FSIZE set to `soft` (RLIM_INFINITY: back to its hard limit): a write past it fails
    with EFBIG, as a full disk's does (tests/run/test_faults.py's way to a full disk)."""
    try:
        hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)[1]
        if soft == resource.RLIM_INFINITY or (hard != resource.RLIM_INFINITY and soft > hard):
            soft = hard
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))
    except (ProcessLookupError, PermissionError):
        pass


def _owner(d: Path) -> int | None:
    """The pid an agent's temp dir names as its owner (elastic/tempdirs.py), or None."""
    try:
        return int((d / OWNER).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def table(r: dict) -> str:
    lines = [f"| # | fault | node | detail | changes (event, nodes, steps lost, pause s) | steps lost (K = {r['k']}) | ok |",
             "|---|---|---|---|---|---|---|"]
    for i, f in enumerate(r["faults"], 1):
        lines.append(f"| {i} | {f['kind']} | {f['node']} | {f['detail']} | {f['changes']} | {f['steps_lost']} | "
                     f"{'yes' if f['within_k'] else 'NO'} |")
    lines += ["", "| agent | node | exit | truthful exit | why | ok |", "|---|---|---|---|---|---|"]
    for e in r["exits"]:
        lines.append(f"| {e['agent']} | {e['node']} | {e['exit']} | {e['truth']} | {e['why']} | "
                     f"{'yes' if e['truthful'] else 'NO'} |")
    lines += ["", f"left behind: processes {r['processes_left']}, snapshot dirs {r['snapshot_dirs_left']}, "
              f"temp dirs {r['temp_dirs_left']}"]
    return "\n".join(lines) + "\n"
