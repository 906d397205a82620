"""Elastic jobs: nodes join and leave a running job, which re-plans its layout and goes on (docs/elastic.md).

    nanotitan train --config C --elastic.nodes MIN:MAX --elastic.nproc_per_node N \\
                    --elastic.endpoint HOST:PORT --elastic.id JOB          # the same command on every node

Each such command is its node's agent (agent.py); node 0 (the one at HOST) also hosts the job's store and
coordinates (this module).
torchrun's own re-rendezvous deadlocks when an agent joins late (torch 2.13; pytorch #123678, #147064), so the
membership is ours. A job runs in generations: a fixed set of member nodes, a world of members * N ranks, and
the planner's layout for that world at the same global batch and micro-batch (resolve.py, parallel.auto).

    join      a new agent registers; the coordinator asks the running generation to stop
    notice    SIGTERM to an agent (a scheduler's preemption notice): same, without that node
    stop      rank 0 sees `gen/G/stop` at a step boundary; every rank finishes that step, saves a checkpoint
              and exits 0 (rank.py); nothing is lost
    next      the coordinator plans the new world and publishes `gen/G+1`; each member agent starts its ranks
              with the planned layout and `--train.resume auto`, which load that checkpoint resharded
    failure   a rank that dies ends its generation (the others are killed); the next one starts from the newest
              checkpoint or snapshot that verifies, within train.max_restarts, and the steps since it are lost
    snapshot  every elastic.snapshot_every steps the ranks write their state to their node's memory; each agent
              serves its node's snapshot files (transport.FileServer) and pushes its node's to the next member
              node, so a lost node's shards are still on another; node 0 assembles a resume from them

Each change prints one line on node 0 and appends it to RUN_DIR/elastic.jsonl: old layout -> new layout, steps
lost, and the pause from the change to the first completed step of the new generation, split into its parts.

The ranks are restarted at each change (a fresh process per generation), not kept alive with rebuilt groups:
a new layout rebuilds every group, shard and optimizer state anyway, and a joiner's ranks have to start from
nothing. docs/elastic.md measures what that costs.

Store keys (prefix nanotitan/elastic/JOB), written by the agents (A), the coordinator (C) and rank 0 (R). Every
entry but the counters (joined, gen) carries a MAC of the job's key (auth.SignedStore) over its full key and
this launch's nonce (node 0 draws it; a joiner learns it from assign/TOKEN): one without a valid MAC, or from
another job or an earlier launch, is named in one line and read as absent.
    joined        A  counter of join tickets: a doorbell only (anyone can move it; node 0 reads a bounded window)
    join/T        A  a joiner's request at ticket T: {"token", "host", "pid", "hash", "files", "ts"} (no launch
                     nonce yet: bound to its random token, and refused when older than auth.WINDOW_S)
    assign/TOKEN  C  {"node", "launch"}: the joiner's node id (node 0's own count) and this launch's nonce
    node/I        A  {"host", "pid", "hash", "files"}: the hash of the code and config, which must match node 0's;
                     files: HOST:PORT of its transport.FileServer
    refused/I     C  why node I may not join (it prints it and exits 2)
    job           C  the job id, signed but bound to no launch: a joiner checks its secret against it
    live          C  HOST:PORT of node 0's liveness listener (liveness.py): each agent's connection there tells
                     node 0 at once that its processes died, and within elastic.silent_s that it went silent
    beat/I        A  the time, every second: until a node's liveness connection is up, the beat it is judged by
                     (timed by when node 0 reads a new one: a node's clock may be off)
    dropped/I     C  {"n", "gen", "why"}: node I was judged lost; its agent, if it lives, asks to join again
    held/I        A  the snapshot units node I holds, [step, gen, origin] (replicas.py: what each node keeps)
    leave/I       A  SIGTERM: node I leaves after the step in flight
    gen, gen/G    C  counter of generations; plan of G: {"members", "flags", "layout", "resume", "snapshot"}
                     (snapshot: the step of node 0's assembled snapshot that `resume` names, which each member
                     fetches into its own snapshot dir, or null)
    gen/G/stop    C  stop after the step in flight        gen/G/abort  C  kill the ranks (a failure elsewhere)
    gen/G/exit/I  A  {"code", "line"} once all of node I's ranks have exited
    gen/G/step, up, saved, result  R  (rank.py)
    done          C  {"code", "line"}: the job is over; every agent prints the line and exits with that code
    bye/I         A  node I read `done` and exits: node 0 keeps the store up until every node's is there
"""

from __future__ import annotations

import hashlib
import json
import re
import os
import shutil
import subprocess
import time
from pathlib import Path

from ..config.config import Config, ConfigError, to_toml
from ..config.parse import elastic_nodes
from ..config.errors import CheckpointError
from ..state.manifest import COMPLETE, checkpoint_dir
from ..state.swap import swap_in
from ..run.loopback import host_ip, split_endpoint
from .auth import WINDOW_S
from .rank import layout_line, snapshot_root
from .liveness import JOB_KEY, LIVE_KEY, LiveServer
from .replicas import assemble_newest
from .transport import Peer

TICK_S = 0.1  # how often an agent looks at the store and its ranks
STEP_OF = re.compile(r"step_([0-9]+)(?:\.old)?")  # fullmatch: a checkpoint dir, or the copy a re-save set aside
# An agent writes beat/I every BEAT_S; one whose liveness connection is not up yet is lost after LOST_S of them
# missing (once it is up, the connection decides: liveness.py).
BEAT_S, LOST_S = 1.0, 15.0
REJOIN_S = 5.0  # a joiner not answered in this time asks again (agent.ask_to_join); node 0 reads a ticket this long
# train.max_restarts of an elastic job that does not set it: restarts in a row without progress (a generation
# that trains past the failed one's furthest step refunds them). A node's death costs one; 3 failures that make no
# progress in between are the job's own (a bug, a node that dies again as soon as it rejoins), and repeating them
# only burns the cluster.
ELASTIC_RESTARTS = 3


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


def restart_budget(cfg: Config) -> int:
    """train.max_restarts when the user set it, else ELASTIC_RESTARTS: an elastic job survives a node's death by
    default (the dataclass default, 0, is torchrun's: a plain job's)."""
    set_it = "train.max_restarts" in cfg.explicit if cfg.explicit is not None else cfg.train.max_restarts != 0
    return cfg.train.max_restarts if set_it else ELASTIC_RESTARTS


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
        # registrations (_registrations): node 0 is node 0; the others ask for an id
        self.seen = 0  # the `joined` counter's tickets looked at so far
        self.counter_moved = False  # whether a move of the counter by someone else was named
        self.tickets: dict[int, float] = {}  # tickets whose request (join/T) is not read yet: since when
        self.tokens: dict[str, int | None] = {}  # each join request's token: its node id (None: refused)
        self.next_id = 1
        self.unconfirmed: dict[int, dict] = {}  # ids assigned whose node has not beaten yet: its request
        self.nodes: set[int] = {0}  # the nodes that joined (beat with this launch's nonce)
        self.refused_nodes: set[int] = set()  # ids assigned to nodes told to go (refused/I)
        self.beats: dict[int, tuple[str, float]] = {}  # each node's last valid beat, and when node 0 first read it
        self.waiting: list[int] = [0]  # registered, not yet members
        self.members: list[int] = []
        self.leaving: set[int] = set()
        self.gen, self.phase = 0, "waiting"  # waiting | running | stopping | failing | done
        self.since = time.monotonic()
        self.layout = ""  # of the current generation
        self.change: dict | None = None  # the change being carried out: what, when, the old layout
        self.changes = 0
        self.failures = 0  # restarts in a row, since the last generation that trained past a failure
        self.failed_at = 0  # the furthest step before the last failure
        self.last_step = 0  # the last step the newest generation completed
        self.snapshots = snapshot_root(cfg, 0)  # node 0's: where a resume from snapshots is assembled
        host = split_endpoint(cfg.elastic.endpoint)[0]  # node 0's address: the agents reach it
        self.live = LiveServer(host_ip(host), store.key, cfg.elastic.id, log=self._say, silent_s=cfg.elastic.silent_s)
        self.said_lost: set[int] = set()
        self.drops: dict[int, int] = {}  # how often each node was dropped (judged lost): its `dropped/I` entry's count
        self.published = -1e9  # when `job` and `live` were last checked (monotonic)
        self._publish()

    def _publish(self) -> None:
        """`job` (signed, bound to no launch: a joiner checks its secret against it) and the listener's address
        `live` (bound to this launch: an earlier launch's cannot send an agent elsewhere), each rewritten once a
        second when what is there does not verify."""
        if time.monotonic() - self.published >= 1.0:
            for key, value in ((JOB_KEY, self.cfg.elastic.id), (LIVE_KEY, self.live.addr)):
                if self.store.get(key) != value:
                    self.store.set(key, value)
            self.published = time.monotonic()

    def close(self) -> None:
        self.live.close()

    # --- what the nodes say ---------------------------------------------------------------------------
    def _registrations(self) -> None:
        """Joiners (agent.ask_to_join). Each takes a ticket of the `joined` counter, which anyone can move, and so
        is only a doorbell: node 0 looks at no more than max_nodes tickets past the last it saw (a counter moved
        further, or back, is looked at from its newest max_nodes), and at each ticket for REJOIN_S at most. A
        joiner whose request was not answered (overwritten, its ticket passed over) asks again with a new ticket.
        The request (join/TICKET, signed) names a random token of the joiner's; node 0 assigns the node id from
        its own count (no counter hands out a taken id) and answers at assign/TOKEN with it and this launch's
        nonce. The node joins at its first beat that carries the nonce: a request replayed from an earlier
        launch never beats."""
        now, window = time.monotonic(), self.max_nodes
        joined = self.store.add("joined", 0)
        if not self.seen <= joined <= self.seen + window:
            if not self.counter_moved:
                self._say(f"the joined counter moved from {self.seen} to {joined}, not by joiners: only its newest "
                          f"{window} tickets are read")
                self.counter_moved = True
            self.seen = max(0, joined - window)
        for ticket in range(self.seen, joined):
            self.tickets.setdefault(ticket, now)
        self.seen = joined
        for ticket in sorted(self.tickets)[:-window]:  # the newest `window` pending tickets are kept
            del self.tickets[ticket]
        for ticket, since in sorted(self.tickets.items()):
            raw = self.store.get(f"join/{ticket}")
            if raw is not None:
                try:
                    self._join_request(json.loads(raw))
                except (KeyError, TypeError, ValueError):  # signed, by another version: its hash would differ
                    self._say(f"the join request at ticket {ticket} is not one this version reads: ignored")
            if raw is not None or now - since > REJOIN_S:  # its joiner, if any, asks again
                del self.tickets[ticket]
        for node, info in list(self.unconfirmed.items()):
            if self.store.get(f"beat/{node}") is None:
                continue
            del self.unconfirmed[node]
            self.nodes.add(node)
            self.waiting.append(node)
            if self.phase != "waiting":
                self._say(f"node {node} ({info['host']}) asks to join")

    def _join_request(self, req: dict) -> None:
        """A signed join request: the node id for its token (the same one when it asks again), published with this
        launch's nonce; a node with other code or config is told why (refused/I)."""
        token = req["token"]
        if token not in self.tokens:
            if abs(behind := time.time() - req["ts"]) > WINDOW_S:  # a replay of an earlier launch's, or a clock off
                self._say(f"a join request from {req['host']} signed at a time {abs(behind):.0f} s "
                          f"{'behind' if behind > 0 else 'ahead of'} node 0's clock (a replay of an earlier launch's, "
                          "or a clock that is off): not joined; the joiner is told node 0's time")
                self.tokens[token] = None
                self.store.set(f"assign/{token}", json.dumps({"clock": time.time()}))
                return
            node = req.get("node")
            if node in self.drops and node not in self.members + self.waiting + list(self.unconfirmed):
                self.leaving.discard(node)  # a node dropped while it lived asks again: the same id (its snapshots')
                self.said_lost.discard(node)
                self.live.forget(node)
                self._say(f"node {node} ({req['host']}), dropped at its loss, asks to join again")
            else:
                node = self.next_id
                self.next_id += 1
            self.tokens[token] = node
            if req["hash"] != self.hash:
                why = (f"node {node} ({req['host']}) runs different code or config (hash {req['hash']} != node 0's "
                       f"{self.hash}): start it with the same nanotitan version and command")
                self.store.set(f"refused/{node}", why)  # before the answer: the joiner reads it right after
                self.refused_nodes.add(node)
                self._say(why)
            else:
                self.unconfirmed[node] = req
                while len(self.unconfirmed) > self.max_nodes:  # ids no one took up (replays): the oldest go
                    del self.unconfirmed[min(self.unconfirmed)]
        if (node := self.tokens[token]) is not None:
            self.store.set(f"assign/{token}", json.dumps({"node": node, "launch": self.store.launch}))

    def _lost(self, node: int) -> str:
        """'' while `node` is alive, else why it is lost: its liveness connection's verdict once it had one, else
        its store beats', each timed by when node 0 read it (a node's clock may be off: the beat's value only has
        to change)."""
        why = self.live.state(node)
        if why is None:
            beat, now = self.store.get(f"beat/{node}"), time.monotonic()
            last = self.beats.get(node)
            if beat is not None and (last is None or last[0] != beat):  # a forged beat is no beat
                self.beats[node] = last = (beat, now)
            silent = now - (last[1] if last else self.since)
            why = f"node {node}'s agent stopped answering (no beat for {silent:.0f} s)" if silent > LOST_S else ""
        return why

    def _exits(self) -> dict[int, dict]:
        g = self.gen
        out = {}
        for node in self.members:
            if (ended := self.store.get(f"gen/{g}/exit/{node}")) is not None:
                out[node] = json.loads(ended)
            elif node != 0 and (why := self._lost(node)):  # node 0 is this process (its own long tick is no loss)
                out[node] = {"code": -9, "line": why, "lost": True}
                if node not in self.said_lost:
                    self.said_lost.add(node)
                    self._say(f"node {node} lost: {why}")
                    # its agent may live (a pause, a cut connection): it reads why, and asks to join again
                    self.drops[node] = self.drops.get(node, 0) + 1
                    self.store.set(f"dropped/{node}", json.dumps({"n": self.drops[node], "gen": g, "why": why}))
        return out

    # --- the state machine ----------------------------------------------------------------------------
    def tick(self) -> None:
        if self.phase == "done":
            return
        self._publish()
        self._registrations()
        for node in self.members + self.waiting:
            if node not in self.leaving and self.store.get(f"leave/{node}") is not None:
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
            if self.failures and self._step_reached() > self.failed_at:  # progress: the restarts are refunded
                self.failures = 0
            failed = {n: e for n, e in exits.items() if e["code"] != 0}
            if failed:
                return self._fail(failed)
            if len(exits) == len(self.members):  # every rank ended without being asked: the run is complete
                return self._finish(0, f"finished at step {self.cfg.train.steps}")
            joiners = [n for n in self.waiting if n not in self.leaving]
            leaving = self.leaving & set(self.members)
            # a generation takes its first step (the last change's record) before the next change stops it
            if self.change is None and (leaving or (joiners and len(self.members) < self.max_nodes)):
                why = "notice" if leaving else "join"
                self.change = {"event": why, "t": time.time(), "old": self.layout, "nodes_before": len(self.members)}
                self.store.set(f"gen/{self.gen}/stop", "1")
                self.phase = "stopping"
        elif self.phase == "stopping":
            if any(e["code"] != 0 for e in exits.values()):
                return self._fail({n: e for n, e in exits.items() if e["code"] != 0})
            if len(exits) == len(self.members):
                result = f"gen/{self.gen}/result"
                if self.store.get(result) == "finished":  # asked after the last step
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
        budget = restart_budget(self.cfg)
        if self.failures > budget:
            return self._finish(1, f"generation {self.gen} failed and train.max_restarts={budget} restarts are used "
                                   f"up (--train.max_restarts); {self._resume_hint()}")
        self.failed_at = self._step_reached()
        self._next_generation()

    def _next_generation(self) -> None:
        """Plan the next world from the members that stay and the nodes waiting, and publish it."""
        step = self._step_reached()
        self.leaving |= {n for n in self.waiting if n != 0 and self._lost(n)}  # a spare that died meanwhile
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
            self.change.update(published=time.time(), nodes_after=len(self.members), members=self.members,
                               step_reached=step, saved=self._saved(self.gen - 1))
        else:
            self._say(f"generation 1: nodes {self.members}, world {world}: {self.layout}")
        self.phase = "running"

    def _report_pause(self) -> None:
        """After the first step of a generation that followed a change: its one line (and elastic.jsonl)."""
        ch, g = self.change, self.gen
        up = self.store.get(f"gen/{g}/up") if ch is not None and "published" in ch else None
        if up is None:
            return
        up = json.loads(up)
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
               "nodes": [ch["nodes_before"], ch["nodes_after"]], "members": ch["members"], "old": ch["old"],
               "new": up["layout"], "pause_s": up["up"] - ch["t"], "parts_s": parts}
        self._say(f"change {self.changes} ({rec['event']}) at step {rec['step']}: nodes {ch['nodes_before']} -> "
                  f"{ch['nodes_after']}, {rec['old']} -> {rec['new']}, steps lost {rec['steps_lost']}, pause "
                  f"{rec['pause_s']:.1f} s (" + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()) + ")")
        with open(self.run_dir / "elastic.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.change = None

    def _step_reached(self) -> int:
        """The last step the current generation completed (its start if none; before any, the last known)."""
        g = self.gen
        step, up = (self.store.get(f"gen/{g}/step"), self.store.get(f"gen/{g}/up")) if g else (None, None)
        if step is not None:
            self.last_step = int(step)
        elif up is not None:
            self.last_step = json.loads(up)["start_step"]
        return self.last_step

    def _saved(self, g: int) -> dict | None:
        saved = self.store.get(f"gen/{g}/saved") if g else None
        return json.loads(saved) if saved is not None else None

    def _newest_checkpoint(self) -> Path | None:
        """The newest checkpoint that verifies, of the run dir's and the snapshots (a damaged one is named and
        skipped): where the next generation resumes. A snapshot newer than the run dir's newest is assembled on
        this node from the units of every node that answers (assemble_newest): a node judged lost is asked too,
        since its file server may answer (a paused agent, a cut liveness connection)."""
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
        for node in sorted(self.nodes - {0}):
            info = self.store.get(f"node/{node}")
            if info is not None and self.store.get(f"refused/{node}") is None:
                peers[node] = Peer(json.loads(info)["files"], self.cfg.elastic.id, node)
        snap = assemble_newest(self.snapshots, peers, self.store.key, _step_of(best) if best else -1, self._say)
        return snap or best

    def _resume_hint(self) -> str:
        """Where the job resumes after it ends: the newest checkpoint, an assembled snapshot copied into the run dir
        first (every node frees its snapshot dir when the job ends)."""
        ck = self._newest_checkpoint()
        if ck is not None and ck.is_relative_to(self.snapshots):
            ck = keep_in(self.run_dir, ck)
        return f"newest checkpoint {ck}; start the job again with --train.resume auto" if ck else "no checkpoint yet"

    def interrupt(self) -> None:
        """Ctrl-C on node 0: every rank stopped at once (nothing saved), the job over with 130 and where it resumes."""
        if self.phase == "done":
            return
        if self.gen:
            self.store.set(f"gen/{self.gen}/abort", "1")
        self._finish(130, f"interrupted (SIGINT) on node 0 at step {self._step_reached()}; {self._resume_hint()}")

    def departed(self) -> set[int]:
        """The nodes node 0 waits for at the end (their `bye/I`): every one that joined or was refused (it reads
        why from the store) and was not lost."""
        return {n for n in (self.nodes | self.refused_nodes) - {0} if n not in self.said_lost}

    def _finish(self, code: int, line: str) -> None:
        if self.live.summary():
            self._say(self.live.summary())
        self.store.set("done", json.dumps({"code": code, "line": line}))
        self.phase = "done"

    def _say(self, line: str) -> None:
        print(f"nanotitan elastic: {line}", flush=True)


def _step_of(path: Path) -> int:
    return int(STEP_OF.fullmatch(path.name).group(1))


def keep_in(run_dir: Path, snap: Path) -> Path:
    """A copy of the assembled snapshot `snap` (checkpoints/step_N in memory) as RUN_DIR/checkpoints/step_N, the
    old copy of that step (if any) set aside until the new one is complete (state/swap.py)."""
    final = checkpoint_dir(run_dir) / snap.name
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(snap, tmp, ignore=shutil.ignore_patterns(COMPLETE))
    swap_in(tmp, final, f"step {_step_of(snap)}\n")
    return final
