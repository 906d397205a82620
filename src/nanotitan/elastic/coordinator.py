"""Elastic jobs: nodes join and leave a running job, which re-plans its layout and goes on (docs/elastic.md).

    nanotitan train --config C --elastic.nodes MIN:MAX --elastic.nproc_per_node N \\
                    --elastic.endpoint HOST:PORT --elastic.id JOB          # the same command on every node

Each such command is its node's agent; node 0 (the one at HOST) also hosts the job's store and coordinates.
torchrun's own re-rendezvous deadlocks when an agent joins late (torch 2.13; pytorch #123678, #147064), so the
membership is ours. A job runs in generations: a fixed set of member nodes, a world of members * N ranks, and
the planner's layout for that world at the same global batch and micro-batch (resolve.py, parallel.auto).

    join      a new agent registers; the coordinator asks the running generation to stop
    notice    SIGTERM to an agent (a scheduler's preemption notice): same, without that node
    stop      rank 0 sees `gen/G/stop` at a step boundary; every rank finishes that step, saves a checkpoint
              and exits 0 (elastic_rank.py); nothing is lost
    next      the coordinator plans the new world and publishes `gen/G+1`; each member agent starts its ranks
              with the planned layout and `--train.resume auto`, which load that checkpoint resharded
    failure   a rank that dies ends its generation (the others are killed); the next one starts from the newest
              checkpoint or snapshot that verifies, within train.max_restarts, and the steps since it are lost
    snapshot  every elastic.snapshot_every steps the ranks write their state to their node's memory; each agent
              serves its node's snapshot files (snapshot.FileServer) and pushes its node's to the next member
              node, so a lost node's shards are still on another; node 0 assembles a resume from them

Each change prints one line on node 0 and appends it to RUN_DIR/elastic.jsonl: old layout -> new layout, steps
lost, and the pause from the change to the first completed step of the new generation, split into its parts.

The ranks are restarted at each change (a fresh process per generation), not kept alive with rebuilt groups:
a new layout rebuilds every group, shard and optimizer state anyway, and a joiner's ranks have to start from
nothing. docs/elastic.md measures what that costs.

Store keys (prefix nanotitan/elastic/JOB), written by the agents (A), the coordinator (C) and rank 0 (R):
    joined        A  counter: node ids in arrival order (node 0 registers first: it hosts the store)
    node/I        A  {"host", "pid", "hash", "files"}: the hash of the code and config, which must match node 0's;
                     files: HOST:PORT of its snapshot.FileServer
    refused/I     C  why node I may not join (it prints it and exits 2)
    beat/I        A  the time, every second: a node whose agent stops beating is lost
    leave/I       A  SIGTERM: node I leaves after the step in flight
    gen, gen/G    C  counter of generations; plan of G: {"members", "flags", "layout", "resume", "snapshot"}
                     (snapshot: the step of node 0's assembled snapshot that `resume` names, which each member
                     fetches into its own snapshot dir, or null)
    gen/G/stop    C  stop after the step in flight        gen/G/abort  C  kill the ranks (a failure elsewhere)
    gen/G/exit/I  A  {"code", "line"} once all of node I's ranks have exited
    gen/G/step, up, saved, result  R  (elastic_rank.py)
    done          C  {"code", "line"}: the job is over; every agent exits with that code
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

from . import snapshot
from ..config.config import Config, ConfigError, elastic_nodes, to_toml
from .rank import RANK_ENV, WARM_ENV, layout_line, snapshot_root
from ..config.errors import CheckpointError, first_line

TICK_S = 0.1  # how often an agent looks at the store and its ranks
BEAT_S, LOST_S = 1.0, 15.0  # an agent beats every BEAT_S; a member silent for LOST_S is lost


def job_hash(cfg: Config) -> str:
    """The code and the config as loaded: every node must run the same. The code is $NANOTITAN_CODE_ID when set
    (a container image's digest, say), else the git commit when the package runs from a checkout (uncommitted
    edits are not seen), else the bytes of its files (an install)."""
    h = hashlib.sha256(to_toml(cfg).encode())
    here = Path(__file__).parents[1]  # the package, not only elastic/
    if os.environ.get("NANOTITAN_CODE_ID"):
        h.update(os.environ["NANOTITAN_CODE_ID"].encode())
        return h.hexdigest()[:16]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    if commit is not None and commit.returncode == 0:
        h.update(commit.stdout.strip().encode())
    else:
        for f in sorted(here.rglob("*.py")):
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def plan_world(cfg: Config, world: int) -> Config:
    """The resolved config for `world` ranks (raises ConfigError when no layout fits)."""
    from ..resolve import resolve

    return resolve(cfg, world)


class Coordinator:
    """Node 0's membership decisions, one `tick` at a time (between the agent's own ticks)."""

    def __init__(self, cfg: Config, store, my_hash: str):
        from ..resolve import planned_flags

        self.cfg, self.store, self.hash, self.planned_flags = cfg, store, my_hash, planned_flags
        self.min_nodes, self.max_nodes = elastic_nodes(cfg.elastic.nodes)
        self.run_dir = Path(cfg.run.dir)
        self.seen = 0  # node ids registered so far
        self.waiting: list[int] = []  # registered, not yet members
        self.members: list[int] = []
        self.leaving: set[int] = set()
        self.gen, self.phase = 0, "waiting"  # waiting | running | stopping | failing | done
        self.since = time.monotonic()
        self.layout = ""  # of the current generation
        self.change: dict | None = None  # the change being carried out: what, when, the old layout
        self.changes = 0
        self.failures = 0
        self.last_step = 0  # the last step the newest generation completed
        self.snapshots = snapshot_root(cfg, 0)  # node 0's: where a resume from snapshots is assembled

    # --- what the nodes say ---------------------------------------------------------------------------
    def _registrations(self) -> None:
        joined = self.store.add("joined", 0)
        for node in range(self.seen, joined):
            info = json.loads(self.store.get(f"node/{node}"))
            if info["hash"] != self.hash:
                why = (f"node {node} ({info['host']}) runs different code or config (hash {info['hash']} != node 0's "
                       f"{self.hash}): start it with the same nanotitan version and command")
                self.store.set(f"refused/{node}", why)
                self._say(why)
            else:
                self.waiting.append(node)
                if self.phase != "waiting":
                    self._say(f"node {node} ({info['host']}) asks to join")
        self.seen = joined

    def _lost(self, node: int) -> bool:
        beat = self.store.get(f"beat/{node}") if self.store.check([f"beat/{node}"]) else b"0"
        return time.time() - float(beat) > LOST_S

    def _exits(self) -> dict[int, dict]:
        g = self.gen
        out = {}
        for node in self.members:
            if self.store.check([f"gen/{g}/exit/{node}"]):
                out[node] = json.loads(self.store.get(f"gen/{g}/exit/{node}"))
            elif node != 0 and self._lost(node):  # node 0 is this process (its own long tick is no loss)
                out[node] = {"code": -9, "line": f"node {node}'s agent stopped answering", "lost": True}
        return out

    # --- the state machine ----------------------------------------------------------------------------
    def tick(self) -> None:
        if self.phase == "done":
            return
        self._registrations()
        for node in self.members + self.waiting:
            if node not in self.leaving and self.store.check([f"leave/{node}"]):
                self.leaving.add(node)
                self._say(f"node {node} got a notice (SIGTERM): it leaves after the step in flight")
        if self.phase == "waiting":
            self.waiting = [n for n in self.waiting if n not in self.leaving]
            if 0 in self.leaving:
                return self._finish(143, "stopped by SIGTERM on node 0 before the job started")
            if len(self.waiting) >= self.min_nodes:
                return self._next_generation()
            if time.monotonic() - self.since > self.cfg.elastic.join_timeout_s:
                return self._finish(2, f"only {len(self.waiting)} of elastic.nodes MIN={self.min_nodes} nodes "
                                       f"joined in {self.cfg.elastic.join_timeout_s:g} s (--elastic.join_timeout_s)")
            return
        self._report_pause()
        exits = self._exits()
        if self.phase == "running":
            failed = {n: e for n, e in exits.items() if e["code"] != 0}
            if failed:
                return self._fail(failed)
            if len(exits) == len(self.members):  # every rank ended without being asked: the run is complete
                return self._finish(0, f"finished at step {self.cfg.train.steps}")
            joiners = [n for n in self.waiting if n not in self.leaving]
            if (self.leaving & set(self.members)) or (joiners and len(self.members) < self.max_nodes):
                why = "notice" if self.leaving & set(self.members) else "join"
                self.change = {"event": why, "t": time.time(), "old": self.layout, "nodes_before": len(self.members)}
                self.store.set(f"gen/{self.gen}/stop", "1")
                self.phase = "stopping"
        elif self.phase == "stopping":
            if any(e["code"] != 0 for e in exits.values()):
                return self._fail({n: e for n, e in exits.items() if e["code"] != 0})
            if len(exits) == len(self.members):
                result = f"gen/{self.gen}/result"
                if self.store.check([result]) and self.store.get(result) == b"finished":  # asked after the last step
                    return self._finish(0, f"finished at step {self.cfg.train.steps}")
                self._next_generation()
        elif self.phase == "failing":
            if len(exits) == len(self.members):
                # a node found lost only after the failure (its agent died with its ranks) is no member either
                self.leaving |= {n for n, e in exits.items() if e.get("lost")}
                self._restart()

    def _fail(self, failed: dict[int, dict]) -> None:
        """A rank died or failed: end the generation everywhere, then restart (_restart) or stop."""
        # A rank killed by a signal first: its peers' errors ("connection closed") follow from its death.
        node, e = min(failed.items(), key=lambda kv: (kv[1].get("line", "").startswith("aborted"), kv[1]["code"] >= 0,
                                                       kv[0]))
        self._say(f"generation {self.gen} failed on node {node}: {e.get('line') or 'exit ' + str(e['code'])}")
        self.store.set(f"gen/{self.gen}/abort", "1")
        for node, e in failed.items():
            if e.get("lost"):
                self.leaving.add(node)
        planned = self.change  # a failure during a planned change (a second failure): the same change, now lossy
        self.change = {"event": "failure" if planned is None else f"{planned['event']} + failure",
                       "t": planned["t"] if planned else time.time(), "old": self.layout,
                       "nodes_before": len(self.members)}
        self.phase = "failing"

    def _restart(self) -> None:
        self.failures += 1
        if self.failures > self.cfg.train.max_restarts:
            return self._finish(1, f"generation {self.gen} failed and train.max_restarts={self.cfg.train.max_restarts} "
                                   "restarts are used up; resume with --train.resume auto (--train.max_restarts)")
        self._next_generation()

    def _next_generation(self) -> None:
        """Plan the next world from the members that stay and the nodes waiting, and publish it."""
        step = self._step_reached()
        candidates = sorted(set(self.members + self.waiting) - self.leaving)[:self.max_nodes]
        if 0 in self.leaving:  # node 0 hosts the store: its notice ends the job, after the stop's checkpoint
            return self._finish(143, f"stopped by SIGTERM on node 0 at step {step}; {self._resume_hint()}")
        while len(candidates) >= self.min_nodes:
            world = len(candidates) * self.cfg.elastic.nproc_per_node
            try:
                c = plan_world(self.cfg, world)
                break
            except ConfigError as e:  # this world admits no layout: the newest node waits as a spare
                self._say(f"world {world} admits no layout ({e}); node {candidates[-1]} waits as a spare")
                candidates.pop()
        else:
            return self._finish(1, f"fewer than elastic.nodes MIN={self.min_nodes} nodes with a layout remain "
                                   f"at step {step}; {self._resume_hint()}")
        self.members = candidates
        self.waiting = [n for n in self.waiting if n not in candidates and n not in self.leaving]
        self.layout = layout_line(c)
        self.gen += 1
        if self.gen == 1 and self.cfg.train.resume != "auto":  # the first generation starts as the user asked
            resume, snap = self.cfg.train.resume, None
        else:
            best = self._newest_checkpoint()
            resume = str(best or "auto")
            snap = _step_of(best) if best is not None and best.is_relative_to(self.snapshots) else None
        self.store.set(f"gen/{self.gen}", json.dumps({"members": self.members, "flags": self.planned_flags(c),
                                                       "layout": self.layout, "resume": resume, "snapshot": snap}))
        self.store.add("gen", 1)
        if self.change is not None:
            self.change.update(published=time.time(), nodes_after=len(self.members), step_reached=step,
                               saved=self._saved(self.gen - 1))
        else:
            self._say(f"generation 1: nodes {self.members}, world {world}: {self.layout}")
        self.phase = "running"

    def _report_pause(self) -> None:
        """After the first step of a generation that followed a change: its one line (and elastic.jsonl)."""
        ch, g = self.change, self.gen
        if ch is None or "published" not in ch or not self.store.check([f"gen/{g}/up"]):
            return
        up = json.loads(self.store.get(f"gen/{g}/up"))
        saved = ch["saved"] or {}
        stopped = saved.get("t", ch["published"])
        parts = {  # seconds, in the order they happen
            "finish_step": max(0.0, stopped - saved.get("save_s", 0.0) - ch["t"]) if saved else 0.0,
            "save": saved.get("save_s", 0.0),
            "rendezvous": up["started"] - (stopped if saved else ch["t"]),
            "process_start": up["entered"] - up["started"],
            "build": up["built"] - up["entered"] - up["load_s"],
            "load": up["load_s"],
            "first_step": up["up"] - up["built"],
        }
        self.changes += 1
        rec = {"change": self.changes, "event": ch["event"], "step": up["start_step"],
               "step_reached": ch["step_reached"], "steps_lost": ch["step_reached"] - up["start_step"],
               "nodes": [ch["nodes_before"], ch["nodes_after"]], "old": ch["old"], "new": up["layout"],
               "pause_s": up["up"] - ch["t"], "parts_s": parts}
        self._say(f"change {self.changes} ({rec['event']}) at step {rec['step']}: nodes {ch['nodes_before']} -> "
                  f"{ch['nodes_after']}, {rec['old']} -> {rec['new']}, steps lost {rec['steps_lost']}, pause "
                  f"{rec['pause_s']:.1f} s (" + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()) + ")")
        with open(self.run_dir / "elastic.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.change = None

    def _step_reached(self) -> int:
        """The last step the current generation completed (its start if none; before any, the last known)."""
        g = self.gen
        if g and self.store.check([f"gen/{g}/step"]):
            self.last_step = int(self.store.get(f"gen/{g}/step"))
        elif g and self.store.check([f"gen/{g}/up"]):
            self.last_step = json.loads(self.store.get(f"gen/{g}/up"))["start_step"]
        return self.last_step

    def _saved(self, g: int) -> dict | None:
        return json.loads(self.store.get(f"gen/{g}/saved")) if g and self.store.check([f"gen/{g}/saved"]) else None

    def _newest_checkpoint(self) -> Path | None:
        """The newest checkpoint that verifies, of the run dir's and the snapshots (a damaged one is named and
        skipped): where the next generation resumes. A snapshot newer than the run dir's newest is assembled on
        this node from the units of every node that answers (snapshot.assemble_newest)."""
        from ..state.manifest import resolve_resume

        best = None
        for root in (self.run_dir, self.snapshots):  # the snapshots: one assembled for an earlier resume
            try:
                path = resolve_resume("auto", root, verify=self.cfg.train.verify_ckpt, log=self._say)
            except CheckpointError as e:  # every checkpoint there fails to verify: the other root may hold one
                self._say(str(e))
                path = None
            if path is not None and (best is None or _step_of(path) > _step_of(best)):
                best = path
        peers = {}
        for node in range(1, self.seen):
            if self.store.check([f"node/{node}"]) and not self.store.check([f"refused/{node}"]) \
                    and not self._lost(node):
                peers[node] = json.loads(self.store.get(f"node/{node}"))["files"]
        snap = snapshot.assemble_newest(self.snapshots, peers, _step_of(best) if best else -1, self._say)
        return snap or best

    def _resume_hint(self) -> str:
        ck = self._newest_checkpoint()
        return f"newest checkpoint {ck}; start the job again with --train.resume auto" if ck else "no checkpoint yet"

    def _finish(self, code: int, line: str) -> None:
        self.store.set("done", json.dumps({"code": code, "line": line}))
        self.phase = "done"

    def _say(self, line: str) -> None:
        print(f"nanotitan elastic: {line}", flush=True)


class Agent:
    """One node: registers, starts its ranks for each generation it is a member of, reports how they ended."""

    def __init__(self, cfg: Config, argv: list[str], store):
        self.cfg, self.argv, self.store = cfg, argv, store
        self.node, self.coordinator = -1, None  # run_agent sets them when the node registers
        self.gen = 0  # the newest generation this agent has acted on
        self.procs: list[subprocess.Popen] = []  # this generation's ranks
        self.warm: list[subprocess.Popen] = []  # the next generation's, started ahead (cli.warm_rank)
        self.err_dir = Path(tempfile.mkdtemp(prefix="nanotitan-elastic-"))
        self.notice = False
        self.beat = 0.0
        self.files = snapshot.FileServer()  # this node's snapshots, for the other agents; root set at registration
        self.members: list[int] = []  # of the newest generation this node is a member of
        self.pushed: set[str] = set()  # units already copied to the peer node
        self.pusher: threading.Thread | None = None

    def run(self) -> int:
        try:
            while True:
                if self.coordinator is not None:
                    self.coordinator.tick()
                code = self.tick()
                if code is not None:
                    return code
                time.sleep(TICK_S)
        finally:
            self._close()
            self.store.add("bye", 1)  # node 0 keeps the store up until every agent has read `done`

    def tick(self) -> int | None:
        s = self.store
        if time.monotonic() - self.beat > BEAT_S:
            s.set(f"beat/{self.node}", str(time.time()))
            self.beat = time.monotonic()
        if self.notice and not s.check([f"leave/{self.node}"]):
            s.set(f"leave/{self.node}", str(time.time()))
        if s.check([f"refused/{self.node}"]):
            print(f"nanotitan elastic: {s.get(f'refused/{self.node}').decode()}", file=sys.stderr, flush=True)
            return 2
        if s.check(["done"]):
            done = json.loads(s.get("done"))
            if self.coordinator is not None:
                print(f"nanotitan elastic: {done['line']}", file=sys.stderr if done["code"] else sys.stdout, flush=True)
            if done["code"] == 0 and self.files.root is not None:  # the run dir holds the final checkpoint
                shutil.rmtree(self.files.root, ignore_errors=True)
            return done["code"]
        self._replicate()
        if self.procs:
            return self._watch()
        newest = s.add("gen", 0)
        if newest > self.gen:
            self.gen = newest
            plan = json.loads(s.get(f"gen/{newest}"))
            if self.node in plan["members"]:
                self._start(plan)
                return None
        if self.notice:  # not (or no longer) a member: nothing to finish
            print(f"nanotitan elastic: node {self.node} left the job (SIGTERM)", flush=True)
            return 0
        return None

    def _start(self, plan: dict) -> None:
        e, g = self.cfg.elastic, self.gen
        host, port = e.endpoint.rsplit(":", 1)
        n = e.nproc_per_node
        first = plan["members"].index(self.node) * n
        world = len(plan["members"]) * n
        self.members = plan["members"]
        resume = plan["resume"]
        if plan.get("snapshot") is not None and self.node != 0:  # node 0 assembled it: this node's ranks read a copy
            try:
                addr = json.loads(self.store.get("node/0"))["files"]
                resume = str(snapshot.fetch_checkpoint(addr, self.files.root, plan["snapshot"]))
            except (OSError, ValueError) as err:  # the generation fails like a rank would, in one line
                self.store.set(f"gen/{g}/exit/{self.node}", json.dumps({
                    "code": 1, "line": f"node {self.node} could not copy snapshot step_{plan['snapshot']} from node 0: "
                                       f"{first_line(err)}"}))
                return
        self._warm_up()  # already warm unless this node's last generation just started
        info = json.dumps({"endpoint": e.endpoint, "id": e.id, "gen": g, "node": self.node, "spawned": time.time()})
        # `nanotitan train` overrides: the elastic section off (ranks are not agents), the planned layout, and
        # train.ckpt_on_signal (the all-reduced stop flag that makes every rank stop at the same step).
        cmd = [*self.argv, *plan["flags"],
               "--train.resume", resume, "--train.ckpt_on_signal", "true",
               "--elastic.endpoint=", "--elastic.nodes="]
        self.procs = []
        for local in range(n):
            err = self.err_dir / f"gen{g}_rank{first + local}.json"
            env = dict(os.environ, RANK=str(first + local), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                       LOCAL_WORLD_SIZE=str(n), MASTER_ADDR=host, MASTER_PORT=port,
                       TORCHELASTIC_USE_AGENT_STORE="True",  # node 0's agent hosts the store
                       TORCHELASTIC_RESTART_COUNT=str(g - 1),  # namespaces the process group's keys per generation
                       TORCHELASTIC_ERROR_FILE=str(err), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            env[RANK_ENV] = info
            rank = self.warm[local]
            try:
                rank.stdin.write(json.dumps({"argv": cmd, "env": env}) + "\n")
                rank.stdin.close()
            except BrokenPipeError:  # it died meanwhile: its exit code fails the generation like any rank's
                pass
            self.procs.append(rank)
        self.warm = []

    def _replicate(self) -> None:
        """Copy this node's newest committed unit to the next member node (node i -> i+1 mod n, in the order of
        the generation's members), one unit at a time on a thread: the agent outlives its ranks, and the copy
        must not hold up its ticks."""
        if self.pusher is not None and self.pusher.is_alive():
            return
        if self.node not in self.members or len(self.members) < 2 or self.files.root is None:
            return
        mine = sorted((int(m.group(1)), int(m.group(2)), rel) for rel in snapshot.units(self.files.root)
                      if (m := snapshot.UNIT.match(rel)) and int(m.group(3)) == self.node and rel not in self.pushed)
        if not mine:
            return
        step, gen, rel = mine[-1]  # the newest: an older one not copied yet is superseded
        peer = self.members[(self.members.index(self.node) + 1) % len(self.members)]
        self.pushed.add(rel)
        addr = json.loads(self.store.get(f"node/{peer}"))["files"]  # here: the store's client is not for threads

        def push():
            try:
                snapshot.push_unit(addr, self.files.root / rel, rel)
            except (OSError, ValueError, RuntimeError) as err:
                print(f"nanotitan elastic: node {self.node}: snapshot step_{step} not copied to node {peer}: "
                      f"{first_line(err)}", flush=True)

        self.pusher = threading.Thread(target=push, daemon=True, name="snapshot-push")
        self.pusher.start()

    def _warm_up(self) -> None:
        """Start the next generation's ranks now: they import torch and the trainer (seconds) while they wait.
        Each touches its `ready` file once imported (wait_warm)."""
        self.warm = [p for p in self.warm if p.poll() is None]  # one killed while it waited is replaced
        while len(self.warm) < self.cfg.elastic.nproc_per_node:
            ready = self.err_dir / f"warm_{time.monotonic_ns()}.ready"
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            env[WARM_ENV] = str(ready)
            p = subprocess.Popen([sys.executable, "-c", "import sys; from nanotitan.cli import warm_rank; "
                                  "sys.exit(warm_rank())"], stdin=subprocess.PIPE, text=True, env=env,
                                 start_new_session=True)
            p.ready = ready
            self.warm.append(p)

    def wait_warm(self, timeout_s: float) -> None:
        """Until this node's warm ranks have imported (a joiner registers only then: its ranks are ready when the
        job stops for it), or timeout_s."""
        self._warm_up()
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and not all(p.ready.exists() or p.poll() is not None for p in self.warm):
            time.sleep(TICK_S)

    def _watch(self) -> int | None:
        """Ranks running: stop them on an abort or when one failed; report once all have exited."""
        s, g = self.store, self.gen
        if not self.warm and s.check([f"gen/{g}/up"]):  # warm the next set once this one trains (not while it starts)
            self._warm_up()
        codes = [p.poll() for p in self.procs]
        aborted = s.check([f"gen/{g}/abort"])
        if aborted or any(c not in (None, 0) for c in codes):
            self._kill()  # a peer is gone: nothing left to save, and a rank waiting on it would wait parallel.timeout_s
            codes = [p.poll() for p in self.procs]
        if any(c is None for c in codes):
            return None
        bad = [(r, c) for r, c in enumerate(codes) if c != 0]
        line = ""
        if bad:
            line = "aborted: a rank failed elsewhere" if aborted else self._failure_line(bad)
        s.set(f"gen/{g}/exit/{self.node}", json.dumps({"code": bad[0][1] if bad else 0, "line": line}))
        self.procs = []
        return None

    def _failure_line(self, bad: list[tuple[int, int]]) -> str:
        """The first failing rank's own line (its error file), else how it died."""
        members = json.loads(self.store.get(f"gen/{self.gen}"))["members"]
        first = self.cfg.elastic.nproc_per_node * members.index(self.node)
        for local, code in bad:
            f = self.err_dir / f"gen{self.gen}_rank{first + local}.json"
            if f.exists():
                return f"rank {first + local}: {json.loads(f.read_text())['message']}"
        local, code = bad[0]
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return f"rank {first + local} {how}"

    def _kill(self) -> None:
        """SIGKILL each rank's process group (ranks run in sessions of their own) and reap them."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.wait()

    def _close(self) -> None:
        """At exit: the ranks and the warm ones (which hold nothing yet) killed."""
        self.procs += self.warm
        self.warm = []
        self._kill()
        if self.pusher is not None:  # a copy under way is finished: the peer keeps only a whole unit anyway
            self.pusher.join(timeout=snapshot.SOCKET_TIMEOUT_S)
        self.files.close()


def run_agent(cfg: Config, argv: list[str]) -> int:
    """`nanotitan train --elastic.*`: this node's agent (and node 0's coordinator); returns the exit code."""
    import torch.distributed as dist

    from ..resolve import cpu_peak_for_ranks
    from ..data.prepare import prepare_data
    from ..run.rundir import owned_run_dir

    e = cfg.elastic
    if not cfg.parallel.auto:
        raise ConfigError("an elastic job re-plans its layout for every world: add --parallel.auto true "
                          "(and --train.global_batch B to fix the batch)")
    min_nodes, _ = elastic_nodes(e.nodes)
    first = plan_world(cfg, min_nodes * e.nproc_per_node)  # a job that cannot even start fails here, in one line
    host, port = e.endpoint.rsplit(":", 1)
    timeout = timedelta(seconds=e.join_timeout_s)
    raw, is_host = None, False
    if _local_address(host):  # node 0 is the one at HOST; on loopback the first to bind the port
        try:
            raw, is_host = dist.TCPStore(host, int(port), is_master=True, wait_for_workers=False, timeout=timeout), True
        except (RuntimeError, OSError):
            pass
    if raw is None:
        try:
            raw = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timeout)
        except (RuntimeError, OSError) as err:
            raise ConfigError(f"no elastic job answers at {e.endpoint} after {e.join_timeout_s:g} s ({err}); start "
                              "node 0 there, or fix --elastic.endpoint") from None
    store = dist.PrefixStore(f"nanotitan/elastic/{e.id}", raw)
    my_hash = job_hash(cfg)
    agent = Agent(cfg, argv, store)
    signal.signal(signal.SIGTERM, lambda *_: setattr(agent, "notice", True))

    def register() -> int:
        node = store.add("joined", 1) - 1
        agent.files.root = snapshot_root(cfg, node)
        if cfg.train.resume != "auto":  # an earlier run's snapshots under this node's name, never to be resumed
            shutil.rmtree(agent.files.root, ignore_errors=True)
        store.set(f"beat/{node}", str(time.time()))
        store.set(f"node/{node}", json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "hash": my_hash,
                                              "files": f"{_address_towards(host)}:{agent.files.port}"}))
        print(f"nanotitan elastic: node {node} ({'hosting the store at ' if is_host else 'joined '}{e.endpoint}, "
              f"job {e.id}, {e.nproc_per_node} ranks)", flush=True)
        return node

    node = register() if is_host else -1  # node 0 first: node ids start with the host
    prepare_data(cfg.data)  # once per node, before a member's ranks look for it
    cpu_peak_for_ranks(first)  # resolve.py's: the MFU peak measured once here, for every generation's ranks
    agent.wait_warm(0 if is_host else e.join_timeout_s)  # a joiner registers once its ranks have imported
    if not is_host:
        node = register()
    agent.node, agent.coordinator = node, Coordinator(cfg, store, my_hash) if is_host else None
    with owned_run_dir(cfg.run.dir, cfg.train.resume, cfg.run.overwrite) if is_host else _nothing():
        code = agent.run()
        if is_host:  # the store lives in this process: let the other agents read `done` first
            _wait_for_agents(store)
    return code


def _wait_for_agents(store, timeout_s: float = 10.0) -> None:
    """Every agent says bye when it exits; an agent that never does (lost) costs timeout_s."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and store.add("bye", 0) < store.add("joined", 0):
        time.sleep(TICK_S)


def _step_of(path: Path) -> int:
    return int(path.name.split("_")[1])


def _address_towards(host: str) -> str:
    """This machine's address on the route to HOST (where the other nodes can reach it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 1))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]


def _local_address(host: str) -> bool:
    """Whether HOST is an address of this machine (a socket can bind it)."""
    try:
        with socket.socket() as s:
            s.bind((socket.gethostbyname(host), 0))
        return True
    except OSError:
        return False


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False

