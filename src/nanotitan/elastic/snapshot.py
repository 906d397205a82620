"""Snapshots of an elastic job (docs/elastic.md): every elastic.snapshot_every = K steps, each rank's
state is written to memory on its node while training goes on, and each node's files are copied to a peer node.
Losing a node (its processes and its /dev/shm) then costs at most K steps.

On each node, under ROOT = rank.snapshot_root(cfg, node), which is SNAPSHOT_DIR/nanotitan-UID/NAME: a parent of
this user's own, mode 0700, so no other local user reads the weights or plants a symlink (own_dir):

    step_N/gG-nodeI/      a unit: the shards that node I's ranks wrote of generation G's snapshot of step N, and
                          the step's small files (.metadata, config.toml, state.json, manifest.json: every file's
                          size and xxh3-64, the other nodes' shards included). A node holds its own units (its
                          ranks write them) and its predecessor's (pushed to this node's transport by that
                          node's agent).
    step_N/gG-nodeI.tmp/  a unit being written; renamed once every file in it is written and checksummed
    checkpoints/step_N/   a whole snapshot assembled from units for a resume: a checkpoint (checkpoint.py)

Rank side (SnapshotWriter): at the step boundary it waits for the previous snapshot, copies the state to one
host buffer (packing.SnapshotPacking: the pieces this rank writes) and returns. A thread then writes that
buffer as the rank's one raw shard, checksums it, agrees with the other ranks (a process group of its own) and
commits the unit. A shard its node cannot write (a full disk) is sent to a rank on another node, which writes it
into its own node's unit (_rescue). At the end of the step after a snapshot, every rank waits until each node's
unit is on the peer node too (`settle`: the agent's word in ROOT/pushed.json, then a barrier), so losing any one
node costs at most K steps.
Agent side (transport.py): each agent serves its ROOT over TCP to the job's members (list, get, put; every request
signed with the job's key). It pushes its node's new units to the next member node, and fetches a whole snapshot
from node 0 before a resume. No file system is shared between nodes.
Coordinator side (replicas.assemble_newest): for the newest step whose files are all on nodes that answer and
verify, it builds checkpoints/step_N on node 0. What each node keeps: replicas.prune, run by its agent.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import stat
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

from ..config.config import Config, ConfigError
from ..config.errors import first_line, os_reason
from ..parallel.comm import collectives as comm
from ..state import checkpoint as ckpt
from ..state.manifest import DCP_METADATA, is_plain_file, unit_mismatch
from ..state.packing import SnapshotPacking, gather_json, write_raw
from ..state.swap import swap_in

UNIT = re.compile(r"step_([0-9]+)/g([0-9]+)-node([0-9]+)")  # fullmatch: a committed unit, relative to ROOT
PUSHED = "pushed.json"  # in ROOT, by the agent: {"unit", "why"} of this node's newest unit it copied to the peer


# --- rank side: stage at the step boundary, write on a thread ---------------------------------------------

class SnapshotWriter:
    """One rank's snapshots. `start` costs the copy of the state to host memory; the rest runs on a thread."""

    def __init__(self, cfg: Config, root: Path, node: int, gen: int, leader: bool, timeout_s: float,
                 peers: bool = False):
        self.cfg, self.root, self.node, self.gen, self.leader = cfg, root, node, gen, leader
        self.timeout_s = timeout_s
        self.peers = peers  # whether the generation has another node, which the agent copies this node's units to
        self.packing: SnapshotPacking | None = None  # the host copy, refilled at each snapshot
        self.group = None  # the thread's process group (gloo), built at the first snapshot
        self.thread: threading.Thread | None = None
        self.error = ""  # the last snapshot's failure, printed by the main thread
        self.note = ""  # how the last snapshot got around a rank's failed write, printed by the main thread
        self.unit: str | None = None  # the unit the leader committed of the snapshot in flight (relative to ROOT)
        self.pending = False  # a snapshot started and not yet settled (on a second node)
        # what the snapshots cost this rank: wall seconds at the step boundary (waiting for the one in flight, the
        # packing once, the copy; the wait for the copy on a peer node), CPU seconds on the thread
        self.cost_s = {"wait": 0.0, "pack": 0.0, "stage": 0.0, "write_cpu": 0.0, "replica": 0.0}
        self.count = 0

    def start(self, step: int, model, optimizer, shard, layout: dict, samples: int) -> None:
        """Snapshot the state after `step`. Collective (every rank calls it at the same step)."""
        # At most one snapshot in flight: one due before the previous is written waits for it (else the thread
        # would read a copy being refilled, and an older unit could commit after a newer one).
        t0 = time.perf_counter()
        self.wait()
        t1 = time.perf_counter()
        if self.group is None and comm.distributed():
            # The thread's collective (the checksum gather) never shares a group with training's, which run at the
            # same time on the main thread. Built once, at the same step everywhere.
            self.group = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        if self.packing is None:  # who writes which piece where: one all-gather, at the generation's first snapshot
            self.packing = SnapshotPacking(model, optimizer, shard, self.group)
            self.cost_s["pack"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        self.packing.stage(model, optimizer, shard)
        small = None
        if comm.world_rank() == 0:  # the step's small files, the same bytes in every node's unit
            small = ckpt.small_files(self.cfg, step, {"step": step, "samples": samples}, layout)
            small[DCP_METADATA] = self.packing.metadata
        self.cost_s["wait"] += t1 - t0
        self.cost_s["stage"] += time.perf_counter() - t2
        self.count += 1
        self.unit, self.pending = None, True
        self.thread = threading.Thread(target=self._write, args=(step, small), daemon=True,
                                       name=f"snapshot-{step}")
        self.thread.start()

    def wait(self) -> None:
        """Until the snapshot in flight is committed (or has failed: one line, and training goes on)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        for line in (self.note, self.error):
            if line:
                print(f"nanotitan elastic: rank {comm.world_rank()}: {line}", flush=True)
        self.error = self.note = ""

    def settle(self) -> None:
        """At the step after a snapshot, before that step counts: until the snapshot is committed and this node's
        unit is on the peer node too (its agent's copy: a unit only in this node's memory dies with the node), every
        rank waiting for every node's (a barrier). So a kill of any one node at any step loses at most K steps;
        the snapshot's write and copy overlap one step. Collective (every rank, the same step)."""
        if not self.pending:
            return
        self.pending = False
        t0 = time.perf_counter()
        self.wait()
        why = self._await_copy() if self.unit is not None and self.peers else ""
        if self.group is not None:
            torch.distributed.barrier(group=self.group)
        self.cost_s["replica"] += time.perf_counter() - t0
        if why:
            print(f"nanotitan elastic: rank {comm.world_rank()}: {why}; losing this node now costs up to 2K steps",
                  flush=True)

    def _await_copy(self) -> str:
        """'' once the agent says this node's newest unit is on the peer node, else why not (its copy failed, or
        took half of parallel.timeout_s: the other ranks wait in the barrier that long at most)."""
        end = time.monotonic() + self.timeout_s / 2
        while time.monotonic() < end:
            got = pushed(self.root)
            if got.get("unit") == self.unit:
                return f"{self.unit} is on this node only: {got['why']}" if got.get("why") else ""
            time.sleep(0.005)
        return f"{self.unit} is not on another node after {self.timeout_s / 2:g} s"

    def summary(self) -> str:
        n, c = max(1, self.count), self.cost_s
        return (f"{self.count} snapshots, each {1e3 * c['stage'] / n:.0f} ms at the step boundary "
                f"(copy to host memory) + {1e3 * c['write_cpu'] / n:.0f} ms CPU on its thread; "
                f"{1e3 * c['pack']:.0f} ms once to plan who "
                f"writes what; {c['wait']:.2f} s waited for one in flight, {c['replica']:.2f} s for the copies on "
                "a peer node")

    def _write(self, step: int, small: dict | None) -> None:
        rank = comm.world_rank()
        unit = self.root / f"step_{step}" / f"g{self.gen}-node{self.node}"
        tmp = unit.with_name(unit.name + ".tmp")
        t0 = time.thread_time()
        try:
            # Nothing non-finite is kept (checkpoint.py's rule): checked here on the copy, agreed by the gather below.
            key = self.packing.nonfinite()
            bad = f"{key} holds NaN/inf" if key else ""
            mine, stranded = {}, ""  # this rank's shard: its bytes and xxh3; why it could not be written here
            try:  # a rank-local failure is agreed by the gather, never left inside a collective
                tmp.mkdir(parents=True, exist_ok=True)
                if not bad:
                    mine = self.packing.write(tmp)
            except OSError as e:  # a full disk: a rank on another node writes the shard (_rescue)
                stranded = f"writing {Path(e.filename or tmp).name} failed ({first_line(e)})"
                mine = self.packing.digest()
            part = {"rank": rank, "node": self.node, "files": mine, "bad": bad, "stranded": stranded,
                    "small": _text(small)}
            # JSON in tensors (packing.gather_json), not all_gather_object: nothing a peer sends is unpickled
            parts = gather_json(part, self.group) if self.group is not None else [part]
            full = {p["node"] for p in parts if p["stranded"]}  # a node's ranks share its disk: all of them move
            for p in parts:
                if p["node"] in full and not p["stranded"]:
                    p["stranded"] = f"node {p['node']}'s disk refused another rank's shard"
            if not any(p["bad"] for p in parts) and full and self.group is not None:
                self._rescue(parts, tmp, step)
            if any(p["bad"] or p["stranded"] for p in parts):
                p = next(p for p in parts if p["bad"] or p["stranded"])
                self.error = f"snapshot of step {step} not kept: rank {p['rank']}: {p['bad'] or p['stranded']}"
                if self.leader:
                    shutil.rmtree(tmp, ignore_errors=True)
                return
            if self.leader and not any(p["node"] == self.node and "rescued_by" in p for p in parts):
                # every rank's shard is written (the gather): commit this node's unit (not where the disk is full:
                # its shards are in the unit of the node that wrote them)
                manifest = {name: meta for p in parts for name, meta in p["files"].items()}
                ckpt.write_small_files(tmp, _bytes(parts[0]["small"]), manifest)
                commit(tmp, unit)  # the node's agent decides what is kept (replicas.prune)
                self.unit = f"{unit.parent.name}/{unit.name}"
            elif self.leader:
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException as e:  # noqa: BLE001 - a failed snapshot must not stop training: the next one retries
            self.error = f"snapshot of step {step} failed: {first_line(e)}"
        finally:
            self.cost_s["write_cpu"] += time.thread_time() - t0

    def _rescue(self, parts: list[dict], tmp: Path, step: int) -> None:
        """The shards of ranks that could not write them (a full disk) are sent to a rank on another node that
        wrote its own, which writes them into its node's unit, checked against the checksum of the buffer they
        were sent from; agreed by a second gather. The snapshot is then whole, as long as one node can write: a
        full disk on one node during a save costs no more than K steps. On success each rescued part's
        `stranded` is cleared and `rescued_by` set to its writer (in every rank's `parts`). Collective."""
        dist = torch.distributed
        writers = [p for p in parts if not p["stranded"]]
        jobs = []  # (stranded part, the rank that writes its shard)
        for p in sorted((p for p in parts if p["stranded"]), key=lambda p: p["rank"]):
            others = [w for w in writers if w["node"] != p["node"]]
            if others:  # the one with the fewest rescues so far, then the lowest rank
                w = min(others, key=lambda w: (sum(h is w for _, h in jobs), w["rank"]))
                jobs.append((p, w))
        rank, why = comm.world_rank(), ""
        for p, w in jobs:
            if p["rank"] == rank:
                dist.send(self.packing.buffer[:self.packing.length], dst=w["rank"], group=self.group)
            elif w["rank"] == rank:
                (name, want), = p["files"].items()
                data = torch.empty(want["bytes"], dtype=torch.uint8)
                dist.recv(data, src=p["rank"], group=self.group)
                try:
                    got = write_raw(tmp / name, memoryview(data.numpy()))
                    if got != want:
                        why = why or f"rank {p['rank']}'s shard arrived with another checksum"
                except OSError as e:
                    why = why or f"writing rank {p['rank']}'s shard failed too ({first_line(e)})"
        failed = [w for w in gather_json(why, self.group) if w]
        if failed or len(jobs) < sum(1 for p in parts if p["stranded"]):
            for p in parts:  # not kept: the line says why the rescue failed too
                if p["stranded"]:
                    p["stranded"] += f"; {failed[0]}" if failed else "; no rank on another node could write it"
            return
        for p, w in jobs:
            p["stranded"], p["rescued_by"] = "", w["node"]
            if p["node"] == self.node or w["rank"] == rank:
                self.note = (f"snapshot of step {step}: rank {p['rank']} could not write its shard on node "
                             f"{p['node']}, so node {w['node']}'s rank {w['rank']} wrote it there")


def _text(small: dict | None) -> dict | None:
    """The small files as JSON can carry them: bytes (the .metadata) in base64."""
    if small is None:
        return None
    return {k: v if isinstance(v, str) else {"b64": base64.b64encode(v).decode()} for k, v in small.items()}


def _bytes(small: dict) -> dict:
    return {k: v if isinstance(v, str) else base64.b64decode(v["b64"]) for k, v in small.items()}


def commit(tmp: Path, final: Path) -> None:
    """Make a written unit (or an assembled checkpoint, COMPLETE already in it) visible: an older copy of it is set
    aside, the .tmp dir renamed into place, then the old copy deleted (state/swap.py): a kill at any point leaves a
    whole copy."""
    swap_in(tmp, final)


def units(root: Path) -> dict[str, list[str]]:
    """{unit path relative to ROOT: its files} of the committed units on this node. The agent's `replicas.prune`
    may remove a step while this lists it (a glob across the two levels then raised FileNotFoundError and took the
    agent down): a step or unit gone meanwhile is simply not listed. Only real dirs and regular files are (lstat):
    a symlink to /dev/zero would be copied forever, one to a dir would serve what is not a snapshot."""
    out = {}
    for step in root.glob("step_*"):
        try:
            for d in step.iterdir():
                rel = f"{step.name}/{d.name}"
                if UNIT.fullmatch(rel) and _real_dir(step) and _real_dir(d):
                    out[rel] = sorted(f.name for f in d.iterdir() if is_plain_file(f))
        except FileNotFoundError:  # pruned while listed
            continue
    return out


def mark_pushed(root: Path, unit: str, why: str = "") -> None:
    """The agent's word to its ranks (SnapshotWriter.settle): its node's unit `unit` is on the peer node ('') or
    not (why). One small file in ROOT, replaced whole."""
    tmp = root / f".{PUSHED}.tmp"
    try:
        tmp.write_text(json.dumps({"unit": unit, "why": why}))
        tmp.replace(root / PUSHED)
    except OSError:  # ROOT gone: the node is ending, its ranks with it
        pass


def pushed(root: Path) -> dict:
    """What `mark_pushed` last said ({} before its first word)."""
    try:
        got = json.loads((root / PUSHED).read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def _real_dir(p: Path) -> bool:
    return stat.S_ISDIR(os.lstat(p).st_mode)


# --- the snapshot dirs are the user's own ---------------------------------------------------------------

def own_dir(path: Path) -> Path:
    """`path`, made with mode 0700 if absent; an existing one must be a real dir (not a symlink) owned by this
    user that neither group nor others can read, enter or write (a 0755 one would show every local user the
    weights), else ConfigError in one line. /dev/shm is writable by every
    local user: a dir planted there under a predictable name, or a symlink, would read the weights or redirect
    the writes (and assemble_newest's cleanup would then delete the target's siblings)."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"cannot make the snapshot dir {path}: {os_reason(e)} (--elastic.snapshot_dir)") from None
    st = os.lstat(path)
    why = ("is a symlink" if stat.S_ISLNK(st.st_mode) else "is not a dir" if not stat.S_ISDIR(st.st_mode)
           else f"is owned by uid {st.st_uid}, not this user ({os.getuid()})" if st.st_uid != os.getuid()
           else f"is open to group or others (mode {stat.S_IMODE(st.st_mode):04o})" if st.st_mode & 0o077
           else "")
    if why:
        raise ConfigError(f"snapshot dir {path} {why}: not this user's own; remove it or choose another "
                          "--elastic.snapshot_dir")
    return path


def private_root(snapshot_dir: str | Path, name: str) -> Path:
    """SNAPSHOT_DIR/nanotitan-UID/NAME: a node's snapshot ROOT under a parent that only this user can enter (made
    0700), each level checked by own_dir. SNAPSHOT_DIR itself (/dev/shm: every user's) is made if absent."""
    try:
        Path(snapshot_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot make elastic.snapshot_dir={str(snapshot_dir)!r}: {os_reason(e)} "
                          "(--elastic.snapshot_dir)") from None
    return own_dir(own_dir(Path(snapshot_dir) / f"nanotitan-{os.getuid()}") / name)


def check_unit(d: Path) -> str:
    """'' when unit `d` matches its manifest: every file in it named there, with its size and checksum (manifest.py)."""
    return unit_mismatch(d)
