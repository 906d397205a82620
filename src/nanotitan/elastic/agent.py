"""An elastic job's agent, one per node (docs/elastic.md): it registers with node 0's store, starts its node's
ranks for each generation it is a member of, reports how they ended, serves its node's snapshot files to the
other members, pushes its own to the next (transport.py) and keeps its snapshot dir to what a resume may need
(replicas.py). Node 0's agent also runs the Coordinator (coordinator.py) between its own ticks.

How a node ends (docs/reliability.md): with the job's `done` entry, every node exits with its code and prints its
line (the resume hint included); a node leaving on its own notice (SIGTERM) while the job goes on exits 143, node
0 never before its coordinator's `done`; Ctrl-C ends in one line (130); a node whose store is gone (node 0 died)
in one line, exit 1. Every ending frees the node's snapshot dir and its temp dir; an agent killed -9 frees
nothing, so each agent's start and end sweep the temp dirs of this user's dead agents (tempdirs.py). A node
dropped while it lives (a pause longer than elastic.silent_s) says so in one line and asks to join again.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

from ..config.config import Config, ConfigError
from ..config.parse import elastic_nodes
from ..config.errors import first_line
from ..run.launch import LOG_ENV
from ..run.loopback import family, host_ip, join_endpoint, loopback_env, loopback_store, split_endpoint
from . import replicas, snapshot, tempdirs
from .auth import KEY_ENV, WINDOW_S, SignedStore, StoreGone, agent_key, default_id_warning, new_launch, single_host
from .coordinator import BEAT_S, REJOIN_S, TICK_S, Coordinator, job_hash, plan_world
from .liveness import JOB_KEY, LIVE_KEY, MISMATCH_S, Beater
from .rank import RANK_ENV, WARM_ENV, snapshot_root
from .transport import SOCKET_TIMEOUT_S, FileServer, Peer, fetch_checkpoint, push_unit

# Fault injection (tests, scripts/chaos.py): each snapshot push of this node held this many seconds on the way, as
# a slow link would hold it (its unit copied first: the node's own retention may move on meanwhile).
PUSH_HOLD_ENV = "NANOTITAN_PUSH_HOLD_S"
# Test hook (tests/elastic): a joiner, warm, registers only once this file exists, so a test decides at which step it
# joins whatever its imports cost on a loaded machine.
JOIN_GATE_ENV = "NANOTITAN_JOIN_GATE"
KEEP_S = 1.0  # how often an agent publishes what it holds (`held/I`) and prunes its snapshot dir (replicas.prune)


class Agent:
    """One node: registers, starts its ranks for each generation it is a member of, reports how they ended."""

    def __init__(self, cfg: Config, argv: list[str], store: SignedStore, bind: str):
        self.cfg, self.argv, self.store, self.key = cfg, argv, store, store.key
        self.node, self.coordinator = -1, None  # run_agent sets them when the node registers
        self.info: dict = {}  # its registration (a dropped node asks again with it)
        self.gen = 0  # the newest generation this agent has acted on
        self.plans: dict[int, dict] = {}  # the plans it read: which nodes each generation's snapshot units come from
        self.procs: list[subprocess.Popen] = []  # this generation's ranks
        self.warm: list[subprocess.Popen] = []  # the next generation's, started ahead (cli.warm_rank)
        tempdirs.sweep()  # those of this host's agents that died without removing theirs (kill -9)
        self.err_dir = tempdirs.make()
        self.notice = False  # SIGTERM: leave after the step in flight
        self.interrupted = False  # SIGINT: stop now
        self.left = False  # whether this node's leave/I is written
        self.beat = 0.0
        self.dropped = 0  # the last `dropped/I` count acted on
        # this node's snapshots, for the other agents (on the address towards the endpoint); root set at registration
        self.files = FileServer(bind, self.key, cfg.elastic.id)
        self.members: list[int] = []  # of the newest generation this node is a member of
        self.pushed: set[str] = set()  # units already copied to the peer node
        self.pusher: threading.Thread | None = None
        self.beater: Beater | None = None  # this node's liveness connection to node 0 (not node 0's own)
        self.kept, self.held = 0.0, None  # when the snapshot dir was last pruned; what `held/I` says

    def run(self) -> int:
        try:
            if self.coordinator is None:
                self._connect()
            while True:
                if self.coordinator is not None:
                    if self.interrupted:
                        self.coordinator.interrupt()
                    self.coordinator.tick()
                code = self.tick()
                if code is not None:
                    return code
                time.sleep(TICK_S)
        except StoreGone as err:  # node 0 died (or its network): nobody will write `done`
            print(f"nanotitan elastic: node {self.node}: {err}: the job ended without its coordinator's word; start "
                  "it again on every node with --train.resume auto", file=sys.stderr, flush=True)
            return 1
        finally:
            self._close()
            try:  # node 0 keeps the store up until every agent has read `done` and said so
                self.store.set(f"bye/{self.node}", "1")
            except StoreGone:
                pass

    def tick(self) -> int | None:
        s = self.store
        if self.interrupted and self.coordinator is None:
            self._kill()
            print(f"nanotitan elastic: node {self.node} interrupted (SIGINT): its ranks stopped, it left the job",
                  file=sys.stderr, flush=True)
            return 130
        if time.monotonic() - self.beat > BEAT_S:
            s.set(f"beat/{self.node}", str(time.time()))
            self.beat = time.monotonic()
        if self.notice and not self.left:
            s.set(f"leave/{self.node}", str(time.time()))
            self.left = True
        if (refused := s.get(f"refused/{self.node}")) is not None:
            print(f"nanotitan elastic: {refused}", file=sys.stderr, flush=True)
            return 2
        if (done := s.get("done")) is not None:  # every node: its code, and its line (where the job resumes)
            done = json.loads(done)
            print(f"nanotitan elastic: {done['line']}", file=sys.stderr if done["code"] else sys.stdout, flush=True)
            return done["code"]
        if self.coordinator is None and (dropped := s.get(f"dropped/{self.node}")) is not None:
            dropped = json.loads(dropped)
            if dropped["n"] > self.dropped:
                self.dropped = dropped["n"]
                self._rejoin(dropped)
                return None
        self._replicate()
        self._keep()
        if self.procs:
            return self._watch()
        plan = None  # the newest signed plan: by key, not by the `gen` counter (which anyone could bump)
        while (nxt := s.get(f"gen/{self.gen + 1}")) is not None:
            self.gen, plan = self.gen + 1, json.loads(nxt)
            self.plans[self.gen] = plan
        if plan is not None and self.node in plan["members"]:
            self._start(plan)
            return None
        if self.notice and self.coordinator is None:  # not (or no longer) a member; node 0 waits for `done`
            print(f"nanotitan elastic: node {self.node} left the job on its notice (SIGTERM); the job goes on without "
                  "it", file=sys.stderr, flush=True)
            return 143
        return None

    def _connect(self) -> None:
        """This node's liveness connection to node 0 (liveness.py), made again whenever it ends. Without node 0's
        address (signed for this launch), node 0 judges this node by its store beats, as slowly as before: named in
        one line."""
        addr = self.store.get(LIVE_KEY)
        if addr is None:
            print(f"nanotitan elastic: node {self.node}: node 0 published no liveness address that verifies; node 0 "
                  "notices this node's loss by its store beats only", file=sys.stderr, flush=True)
            return
        self.beater = Beater(addr, self.key, self.cfg.elastic.id, self.node)

    def _rejoin(self, dropped: dict) -> None:
        """Node 0 judged this node lost while it lived: its ranks go, and it asks to join again (the same id: its
        snapshot units stay its own), so the job grows back at the next generation."""
        print(f"nanotitan elastic: node {self.node} was dropped from the job at generation {dropped['gen']}: "
              f"{dropped['why']}; it asks to join again", file=sys.stderr, flush=True)
        self._kill()
        self.procs = []
        if self.beater is not None:  # its connection back first: a node without one would be judged lost again
            self.beater.up.wait(timeout=2 * self.cfg.elastic.silent_s)
        node = ask_to_join(self.store, self.info, self.cfg.elastic.join_timeout_s, self.cfg.elastic.endpoint,
                           rejoin=self.node)
        self.store.set(f"beat/{node}", str(time.time()))
        print(f"nanotitan elastic: node {node} joined again", flush=True)

    def _start(self, plan: dict) -> None:
        e, g = self.cfg.elastic, self.gen
        host, port = split_endpoint(e.endpoint)
        n = e.nproc_per_node
        first = plan["members"].index(self.node) * n
        world = len(plan["members"]) * n
        self.members = plan["members"]
        resume = plan["resume"]
        if plan.get("snapshot") is not None and self.node != 0:  # node 0 assembled it: this node's ranks read a copy
            try:
                addr = json.loads(self.store.get("node/0"))["files"]
                resume = str(fetch_checkpoint(Peer(addr, e.id, 0), self.key, self.files.root, plan["snapshot"]))
            except (OSError, ValueError, TypeError) as err:  # the generation fails like a rank would, in one line
                self.store.set(f"gen/{g}/exit/{self.node}", json.dumps({
                    "code": 1, "line": f"node {self.node} could not copy snapshot step_{plan['snapshot']} from node 0: "
                                       f"{first_line(err)}"}))
                return
        self._warm_up()  # already warm unless this node's last generation just started
        info = json.dumps({"endpoint": e.endpoint, "id": e.id, "launch": self.store.launch, "gen": g, "node": self.node,
                           "spawned": time.time()})
        # `nanotitan train` overrides: the elastic section off (ranks are not agents), the planned layout, and
        # train.ckpt_on_signal (the all-reduced stop flag that makes every rank stop at the same step).
        cmd = [*self.argv, *plan["flags"],
               "--train.resume", resume, "--train.ckpt_on_signal", "true",
               "--elastic.endpoint=", "--elastic.nodes="]
        logs = Path(self.cfg.run.dir, "logs").absolute()
        logs.mkdir(parents=True, exist_ok=True)
        self.procs = []
        for local in range(n):
            err = self.err_dir / f"gen{g}_rank{first + local}.json"
            env = dict(os.environ, RANK=str(first + local), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                       LOCAL_WORLD_SIZE=str(n), MASTER_ADDR=host, MASTER_PORT=str(port),
                       TORCHELASTIC_USE_AGENT_STORE="True",  # node 0's agent hosts the store
                       TORCHELASTIC_RESTART_COUNT=str(g - 1),  # namespaces the process group's keys per generation
                       TORCHELASTIC_ERROR_FILE=str(err), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            env[LOG_ENV] = str(logs)  # each rank's stderr (tracebacks) to RUN_DIR/logs/rank_N.log, not the console
            if single_host(e.endpoint):
                env.update(loopback_env())  # gloo/NCCL on loopback: no other machine is a member
            env[RANK_ENV], env[KEY_ENV] = info, self.key.hex()  # the ranks sign their store entries too
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
                      if (m := snapshot.UNIT.fullmatch(rel)) and int(m.group(3)) == self.node
                      and rel not in self.pushed)
        if not mine:
            return
        step, gen, rel = mine[-1]  # the newest: an older one not copied yet is superseded
        peer = self.members[(self.members.index(self.node) + 1) % len(self.members)]
        self.pushed.add(rel)
        info = self.store.get(f"node/{peer}")  # here: the store's client is not for threads
        if info is None:
            snapshot.mark_pushed(self.files.root, rel, f"node {peer} has no file server entry")
            return
        to = Peer(json.loads(info)["files"], self.cfg.elastic.id, peer)
        src, hold = self.files.root / rel, float(os.environ.get(PUSH_HOLD_ENV) or 0)

        def push():
            unit = src
            try:
                if hold:  # fault injection: a slow link holds the copy, its bytes read at the start
                    unit = self.err_dir / f"push-{step}-{gen}"
                    shutil.copytree(src, unit)
                    time.sleep(hold)
                push_unit(to, self.key, unit, rel)
                snapshot.mark_pushed(self.files.root, rel)  # the ranks wait for it (SnapshotWriter.settle)
            except (OSError, ValueError, RuntimeError) as err:
                print(f"nanotitan elastic: node {self.node}: snapshot step_{step} not copied to node {peer}: "
                      f"{first_line(err)}", flush=True)
                snapshot.mark_pushed(self.files.root, rel, f"its copy to node {peer} failed ({first_line(err)})")
            finally:
                if unit != src:
                    shutil.rmtree(unit, ignore_errors=True)

        self.pusher = threading.Thread(target=push, daemon=True, name="snapshot-push")
        self.pusher.start()

    def _keep(self) -> None:
        """Once a KEEP_S: say what this node holds (`held/I`), read what the other members hold, and prune this
        node's snapshot dir, never the newest snapshot that is complete across the nodes (replicas.py)."""
        root = self.files.root
        if root is None or time.monotonic() - self.kept < KEEP_S:
            return
        self.kept = time.monotonic()
        mine = replicas.held(root)
        if mine != self.held:
            self.store.set(f"held/{self.node}", json.dumps(mine))
            self.held = mine
        holdings = {self.node: mine}
        for node in self.members:
            if node != self.node and (theirs := self.store.get(f"held/{node}")) is not None:
                holdings[node] = json.loads(theirs)
        members_of = {g: plan["members"] for g, plan in self.plans.items()}
        replicas.prune(root, replicas.complete_across(holdings, members_of))

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
        # warm the next set once this one trains (not while it starts)
        if not self.warm and s.get(f"gen/{g}/up") is not None:
            self._warm_up()
        codes = [p.poll() for p in self.procs]
        aborted = s.get(f"gen/{g}/abort") is not None
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
        first = self.cfg.elastic.nproc_per_node * self.members.index(self.node)
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
        """At exit: the ranks and the warm ones (which hold nothing yet) killed; this node's snapshot dir and temp
        dir freed (what the job resumes from is in the run dir: node 0 copied an assembled snapshot there)."""
        self.procs += self.warm
        self.warm = []
        self._kill()
        if self.beater is not None:  # (node 0's listener stays up while the others read `done`)
            self.beater.close()
        if self.pusher is not None:  # a copy under way is finished: the peer keeps only a whole unit anyway
            self.pusher.join(timeout=SOCKET_TIMEOUT_S)
        self.files.close()
        if self.files.root is not None:
            shutil.rmtree(self.files.root, ignore_errors=True)
        shutil.rmtree(self.err_dir, ignore_errors=True)
        tempdirs.sweep()  # an agent killed meanwhile: the last one to end on this host leaves none behind


def run_agent(cfg: Config, argv: list[str]) -> int:
    """`nanotitan train --elastic.*`: this node's agent (and node 0's coordinator); returns the exit code. Ctrl-C
    before the node is in the job ends it in one line too."""
    try:
        return _agent(cfg, argv)
    except KeyboardInterrupt:
        print("nanotitan elastic: interrupted (SIGINT) before this node took part in the job", file=sys.stderr,
              flush=True)
        return 130


def _agent(cfg: Config, argv: list[str]) -> int:
    import torch.distributed as dist

    from ..data.prepare import prepare_data
    from ..resolve import cpu_peak_for_ranks
    from ..run.rundir import owned_run_dir

    e = cfg.elastic
    if not cfg.parallel.auto:
        raise ConfigError("an elastic job re-plans its layout for every world: add --parallel.auto true "
                          "(and --train.global_batch B to fix the batch)")
    min_nodes, _ = elastic_nodes(e.nodes)
    first = plan_world(cfg, min_nodes * e.nproc_per_node)  # a job that cannot even start fails here, in one line
    key = agent_key(cfg)  # and one across hosts without a secret (docs/security.md); ranks get only the key
    host, port = split_endpoint(e.endpoint)
    timeout = timedelta(seconds=e.join_timeout_s)
    raw, is_host = None, False
    if _local_address(host):  # node 0 is the one at HOST; on loopback the first to bind the port
        try:
            if single_host(e.endpoint):  # torch's own bind would be every interface (docs/security.md)
                raw, is_host = loopback_store(port, e.join_timeout_s, host=host), True
            else:
                raw = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
                is_host = True
        except (RuntimeError, OSError):
            pass
    if raw is None:
        try:
            raw = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
        except (RuntimeError, OSError) as err:
            raise ConfigError(f"no elastic job answers at {e.endpoint} after {e.join_timeout_s:g} s ({err}); start "
                              "node 0 there, or fix --elastic.endpoint") from None
    if warning := default_id_warning(cfg):
        print(warning, file=sys.stderr, flush=True)
    # node 0 draws this launch's nonce; a joiner learns it when node 0 answers its request (ask_to_join)
    store = SignedStore(raw, key, e.id, new_launch() if is_host else None)
    my_hash = job_hash(cfg)
    agent = Agent(cfg, argv, store, bind=address_towards(host))
    signal.signal(signal.SIGTERM, lambda *_: setattr(agent, "notice", True))

    def on_sigint(*_):
        if agent.interrupted:  # a second Ctrl-C: now
            raise KeyboardInterrupt
        agent.interrupted = True
    signal.signal(signal.SIGINT, on_sigint)
    agent.info = {"host": socket.gethostname(), "pid": os.getpid(), "hash": my_hash,
                  "files": join_endpoint(address_towards(host), agent.files.port)}
    try:
        # a joiner's id (and this launch's nonce) first: a secret or a clock that is not the job's is named now, in
        # one line, not after its imports; node 0 counts it as waiting only at its first beat (register)
        node = 0 if is_host else ask_to_join(store, agent.info, e.join_timeout_s, e.endpoint)
        agent.files.node, agent.files.root = node, snapshot_root(cfg, node)
        if cfg.train.resume != "auto":  # an earlier run's snapshots under this node's name, never to be resumed
            shutil.rmtree(agent.files.root, ignore_errors=True)
            snapshot_root(cfg, node)  # made again, 0700
        if is_host:  # node ids start with the host
            _register(store, node, agent.info, e, is_host)
        prepare_data(cfg.data)  # once per node, before a member's ranks look for it
        cpu_peak_for_ranks(first)  # resolve.py's: the MFU peak measured once here, for every generation's ranks
        agent.wait_warm(0 if is_host else e.join_timeout_s)  # a joiner beats once its ranks have imported
        if not is_host:
            while (gate := os.environ.get(JOIN_GATE_ENV)) and not Path(gate).exists():
                time.sleep(TICK_S)
            _register(store, node, agent.info, e, is_host)
    except BaseException:  # ConfigError, KeyboardInterrupt, StoreGone: the warm ranks and the file server go first
        agent._close()
        raise
    agent.node, agent.coordinator = node, Coordinator(cfg, store, my_hash) if is_host else None
    with owned_run_dir(cfg.run.dir, cfg.train.resume, cfg.run.overwrite) if is_host else nullcontext():
        code = agent.run()
        if is_host:  # the store lives in this process: let the other agents read `done` first
            _wait_for_byes(store, agent.coordinator.departed())
            agent.coordinator.close()
    return code


def _register(store: SignedStore, node: int, info: dict, e, is_host: bool) -> None:
    store.set(f"beat/{node}", str(time.time()))
    store.set(f"node/{node}", json.dumps(info))
    print(f"nanotitan elastic: node {node} ({'hosting the store at ' if is_host else 'joined '}{e.endpoint}, "
          f"job {e.id}, {e.nproc_per_node} ranks)", flush=True)


def ask_to_join(store: SignedStore, info: dict, timeout_s: float, endpoint: str, rejoin: int | None = None) -> int:
    """A joiner's registration: this node's id from node 0, and this launch's nonce, which the agent's entries
    carry from then on (store.launch). It takes a ticket of the `joined` counter and writes its request there
    (join/TICKET, signed), naming a random token; node 0 answers at assign/TOKEN (Coordinator._registrations).
    A request not answered in REJOIN_S (a stranger overwrote it, or moved the counter past it) is made again.
    `rejoin`: the id of a node node 0 dropped, which it asks for again.

    On the way, two things that are not the job's are named in one line (ConfigError): a secret, when node 0's
    `job` entry is there but has not verified for MISMATCH_S and no answer came (an answer that verifies proves
    the secret, so a stranger's writes over `job` end no one); a clock more than auth.WINDOW_S from node 0's
    (node 0 answers a request signed that far from its time with its time)."""
    token, end, asked = secrets.token_hex(16), time.monotonic() + timeout_s, -float("inf")
    verified, bad_since = False, None
    while (answer := store.get(f"assign/{token}")) is None:
        now = time.monotonic()
        if not verified:
            if store.get(JOB_KEY) is not None:
                verified = True
            elif store.has(JOB_KEY):  # node 0 rewrites its entry every second: a stranger's write does not last
                bad_since = bad_since or now
                if now - bad_since > MISMATCH_S:
                    raise ConfigError(f"node 0's entries in the job's store at {endpoint} do not verify with this "
                                      "node's key: your secret does not match the job's (--elastic.secret_file or "
                                      "$NANOTITAN_ELASTIC_SECRET: the same on every node)")
            else:
                bad_since = None
        if now > end:
            raise ConfigError(f"node 0 at {endpoint} gave this node no id in {timeout_s:g} s: "
                              + ("it is not coordinating yet, or refused this node's request (see node 0's output)"
                                 if verified else "no elastic coordinator answers there")
                              + " (--elastic.join_timeout_s)")
        if now - asked >= REJOIN_S:
            ticket = store.add("joined", 1) - 1
            req = dict(info, token=token, ts=time.time(), **({"node": rejoin} if rejoin is not None else {}))
            store.set(f"join/{ticket}", json.dumps(req))
            asked = now
        time.sleep(TICK_S)
    answer = json.loads(answer)
    if "clock" in answer:
        skew = answer["clock"] - time.time()
        raise ConfigError(f"this node's clock is {abs(skew):.0f} s {'behind' if skew > 0 else 'ahead of'} node 0's, "
                          f"more than the {WINDOW_S:g} s the job's signed requests allow: synchronise the clocks "
                          "(NTP, chrony) and start this node again")
    store.launch = answer["launch"]
    return answer["node"]


def _wait_for_byes(store: SignedStore, nodes: set[int], timeout_s: float = 10.0) -> None:
    """Every agent says bye (signed, `bye/I`) when it exits; one that never does (lost since) costs timeout_s."""
    end = time.monotonic() + timeout_s
    while nodes and time.monotonic() < end:
        nodes = {n for n in nodes if store.get(f"bye/{n}") is None}
        time.sleep(TICK_S)


def address_towards(host: str) -> str:
    """This machine's address on the route to HOST (where the other nodes can reach it)."""
    ip = host_ip(host)
    with socket.socket(family(ip), socket.SOCK_DGRAM) as s:
        s.connect((ip, 1))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]


def _local_address(host: str) -> bool:
    """Whether HOST is an address of this machine (a socket can bind it)."""
    try:
        ip = host_ip(host)
        with socket.socket(family(ip)) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False

