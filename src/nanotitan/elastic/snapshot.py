"""Snapshots of an elastic job (issue 24, docs/elastic.md): every elastic.snapshot_every = K steps, each rank's
state is written to memory on its node while training goes on, and each node's files are copied to a peer node.
Losing a node (its processes and its /dev/shm) then costs at most K steps.

On each node, under ROOT = elastic_rank.snapshot_root(cfg, node):

    step_N/gG-nodeI/      a unit: the shards that node I's ranks wrote of generation G's snapshot of step N, and
                          the step's small files (.metadata, config.toml, state.json, manifest.json: every file's
                          size and xxh3-64, the other nodes' shards included). A node holds its own units (its
                          ranks write them) and its predecessor's (pushed to this node's FileServer by that
                          node's agent).
    step_N/gG-nodeI.tmp/  a unit being written; renamed once every file in it is written and checksummed
    checkpoints/step_N/   a whole snapshot assembled from units for a resume: a checkpoint (checkpoint.py)

Rank side (SnapshotWriter): at the step boundary it waits for the previous snapshot, copies the state to one
host buffer (checkpoint.SnapshotPacking: the pieces this rank writes) and returns. A thread then writes that
buffer as the rank's one raw shard, checksums it, agrees with the other ranks (a process group of its own) and
commits the unit.
Agent side (FileServer, push_unit, fetch_checkpoint): each agent serves its ROOT over TCP (list, get, put). It
pushes its node's new units to the next member node, and fetches a whole snapshot from node 0 before a resume.
No file system is shared between nodes.
Coordinator side (assemble_newest): for the newest step whose files are all on surviving nodes and verify, it
builds checkpoints/step_N on node 0.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import socketserver
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

from ..state import checkpoint as ckpt
from ..config.config import Config
from ..config.errors import first_line
from ..state.manifest import COMPLETE, DCP_METADATA, MANIFEST, _hash_file, unit_mismatch
from ..parallel import comm

UNIT = re.compile(r"^step_(\d+)/g(\d+)-node(\d+)$")  # a committed unit, relative to ROOT
KEEP_STEPS = 2  # a node keeps the units of its two newest steps: the newest may be incomplete when a node dies
SOCKET_TIMEOUT_S = 60.0


# --- rank side: stage at the step boundary, write on a thread ---------------------------------------------

class SnapshotWriter:
    """One rank's snapshots. `start` costs the copy of the state to host memory; the rest runs on a thread."""

    def __init__(self, cfg: Config, root: Path, node: int, gen: int, leader: bool, timeout_s: float):
        self.cfg, self.root, self.node, self.gen, self.leader = cfg, root, node, gen, leader
        self.timeout_s = timeout_s
        self.packing: ckpt.SnapshotPacking | None = None  # the host copy, refilled at each snapshot
        self.group = None  # the thread's process group (gloo), built at the first snapshot
        self.thread: threading.Thread | None = None
        self.error = ""  # the last snapshot's failure, printed by the main thread
        # what the snapshots cost this rank: wall seconds at the step boundary (waiting for the one in flight, the
        # packing once, the copy), CPU seconds on the thread
        self.cost_s = {"wait": 0.0, "pack": 0.0, "stage": 0.0, "write_cpu": 0.0}
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
            self.packing = ckpt.SnapshotPacking(model, optimizer, shard, self.group)
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
        self.thread = threading.Thread(target=self._write, args=(step, small), daemon=True,
                                       name=f"snapshot-{step}")
        self.thread.start()

    def wait(self) -> None:
        """Until the snapshot in flight is committed (or has failed: one line, and training goes on)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error:
            print(f"nanotitan elastic: rank {comm.world_rank()}: {self.error}", flush=True)
            self.error = ""

    def summary(self) -> str:
        n, c = max(1, self.count), self.cost_s
        return (f"{self.count} snapshots, each {1e3 * c['stage'] / n:.0f} ms at the step boundary (copy to host memory) "
                f"+ {1e3 * c['write_cpu'] / n:.0f} ms CPU on its thread; {1e3 * c['pack']:.0f} ms once to plan who "
                f"writes what; {c['wait']:.2f} s waited for one in flight")

    def _write(self, step: int, small: dict | None) -> None:
        rank = comm.world_rank()
        unit = self.root / f"step_{step}" / f"g{self.gen}-node{self.node}"
        tmp = unit.with_name(unit.name + ".tmp")
        t0 = time.thread_time()
        try:
            # Nothing non-finite is kept (checkpoint.py's rule): checked here on the copy, agreed by the gather below.
            key = self.packing.nonfinite()
            bad = f"{key} holds NaN/inf" if key else ""
            mine = {}  # this rank's shard: its bytes and xxh3
            try:  # a rank-local failure is agreed by the gather, never left inside a collective
                tmp.mkdir(parents=True, exist_ok=True)
                if not bad:
                    mine = self.packing.write(tmp)
            except OSError as e:
                bad = f"writing {Path(e.filename or tmp).name} failed ({first_line(e)})"
            part = {"rank": rank, "files": mine, "bad": bad, "small": small}
            if self.group is not None:
                parts: list = [None] * comm.world_size()
                torch.distributed.all_gather_object(parts, part, group=self.group)
            else:
                parts = [part]
            if any(p["bad"] for p in parts):
                p = next(p for p in parts if p["bad"])
                self.error = f"snapshot of step {step} not kept: rank {p['rank']}: {p['bad']}"
                if self.leader:
                    shutil.rmtree(tmp, ignore_errors=True)
                return
            if self.leader:  # every rank's shard is written (the gather): commit this node's unit
                manifest = {name: meta for p in parts for name, meta in p["files"].items()}
                ckpt.write_small_files(tmp, parts[0]["small"], manifest)
                commit(tmp, unit)
                prune(self.root)
        except BaseException as e:  # noqa: BLE001 - a failed snapshot must not stop training: the next one retries
            self.error = f"snapshot of step {step} failed: {first_line(e)}"
        finally:
            self.cost_s["write_cpu"] += time.thread_time() - t0


def commit(tmp: Path, final: Path) -> None:
    """Make a written unit (or checkpoint) visible in one rename: a crash before it leaves only a .tmp dir."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def prune(root: Path) -> None:
    """Keep the units of the KEEP_STEPS newest steps (and leftovers of a write in flight among them)."""
    steps = sorted(int(d.name[5:]) for d in root.glob("step_*") if d.name[5:].isdigit())
    for s in steps[:-KEEP_STEPS]:
        shutil.rmtree(root / f"step_{s}", ignore_errors=True)


def units(root: Path) -> dict[str, list[str]]:
    """{unit path relative to ROOT: its files} of the committed units on this node. The snapshot thread's `prune`
    may remove a step while this lists it (a glob across the two levels then raised FileNotFoundError and took the
    agent down): a step or unit gone meanwhile is simply not listed."""
    out = {}
    for step in root.glob("step_*"):
        try:
            for d in step.iterdir():
                rel = f"{step.name}/{d.name}"
                if UNIT.match(rel) and d.is_dir():
                    out[rel] = sorted(f.name for f in d.iterdir())
        except FileNotFoundError:  # pruned while listed
            continue
    return out


# --- transport between nodes: each agent serves its ROOT over TCP ------------------------------------------
# One request per connection: a JSON line, then for `put` the files' bytes; the answer is a JSON line, then for
# `get` the file's bytes. Paths are relative to ROOT and never leave it.

class _TCPServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True  # on this class only: setting it on ThreadingTCPServer would change every user's
    daemon_threads = True  # a request in flight never holds up the agent's exit


class FileServer:
    """This node's snapshot files for the other agents: `list` its units, `get` a file, `put` a peer's unit."""

    def __init__(self, host: str = "0.0.0.0"):
        self.root: Path | None = None  # set once the node has its id (elastic.run_agent)
        server = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                self.connection.settimeout(SOCKET_TIMEOUT_S)
                try:
                    req = json.loads(self.rfile.readline())
                    server._serve(req, self.rfile, self.wfile)
                except (OSError, ValueError) as e:
                    try:
                        self.wfile.write((json.dumps({"error": first_line(e)}) + "\n").encode())
                    except OSError:
                        pass

        self.server = _TCPServer((host, 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True, name="snapshot-files").start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _path(self, rel: str) -> Path:
        if self.root is None:
            raise ValueError("this node has no snapshot dir yet")
        p = (self.root / rel).resolve()
        if not p.is_relative_to(self.root.resolve()):
            raise ValueError(f"path {rel!r} is outside the snapshot dir")
        return p

    def _serve(self, req: dict, rfile, wfile) -> None:
        op = req.get("op")
        if op == "list":
            out = units(self.root) if self.root is not None and self.root.is_dir() else {}
            wfile.write((json.dumps({"units": out}) + "\n").encode())
        elif op == "get":
            p = self._path(req["path"])
            with open(p, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                wfile.write((json.dumps({"bytes": size}) + "\n").encode())
                shutil.copyfileobj(f, wfile, 8 << 20)
        elif op == "put":  # a peer's unit: written as .tmp, checked against its own manifest, then renamed
            unit = self._path(req["unit"])
            if not UNIT.match(req["unit"]):
                raise ValueError(f"{req['unit']!r} is not a unit")
            tmp = unit.with_name(unit.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for name, size in req["files"]:
                with open(tmp / Path(name).name, "wb") as f:
                    _copy_n(rfile, f, size)
            why = check_unit(tmp)
            if why:
                shutil.rmtree(tmp, ignore_errors=True)
                raise ValueError(f"replica {req['unit']} refused: {why}")
            commit(tmp, unit)
            prune(self.root)
            wfile.write(b'{"ok": true}\n')
        else:
            raise ValueError(f"unknown request {op!r}")


def _copy_n(src, dst, n: int) -> None:
    while n > 0:
        chunk = src.read(min(n, 8 << 20))
        if not chunk:
            raise OSError(f"connection closed with {n} bytes still to come")
        dst.write(chunk)
        n -= len(chunk)


def check_unit(d: Path) -> str:
    """'' when unit `d` matches its manifest: every file in it named there, with its size and checksum (manifest.py)."""
    return unit_mismatch(d)


def _request(addr: str, req: dict, body=None, timeout_s: float = SOCKET_TIMEOUT_S):
    """(socket file for reading, the answer's JSON) of one request to the FileServer at HOST:PORT."""
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    f = sock.makefile("rwb")
    f.write((json.dumps(req) + "\n").encode())
    if body is not None:
        body(f)
    f.flush()
    answer = json.loads(f.readline() or b'{"error": "no answer"}')
    if "error" in answer:
        sock.close()
        raise OSError(f"{addr}: {answer['error']}")
    return sock, f, answer


def list_units(addr: str, timeout_s: float = 5.0) -> dict[str, list[str]]:
    sock, _f, answer = _request(addr, {"op": "list"}, timeout_s=timeout_s)
    sock.close()
    return answer["units"]


def get_file(addr: str, rel: str, dest: Path) -> None:
    sock, f, answer = _request(addr, {"op": "get", "path": rel})
    with sock, open(dest, "wb") as out:
        _copy_n(f, out, answer["bytes"])


def push_unit(addr: str, unit: Path, rel: str) -> None:
    """Copy a committed unit to the FileServer at `addr` (the peer checks it before it keeps it)."""
    files = sorted((f.name, f.stat().st_size) for f in unit.iterdir())

    def body(out):
        for name, _size in files:
            with open(unit / name, "rb") as src:
                shutil.copyfileobj(src, out, 8 << 20)

    sock, _f, _answer = _request(addr, {"op": "put", "unit": rel, "files": files}, body)
    sock.close()


def fetch_checkpoint(addr: str, root: Path, step: int) -> Path:
    """This node's copy of node 0's assembled checkpoints/step_N (fetched, verified, then renamed into place)."""
    final = root / "checkpoints" / f"step_{step}"
    if (final / COMPLETE).exists():
        return final
    rel = f"checkpoints/step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    get_file(addr, f"{rel}/{MANIFEST}", tmp / MANIFEST)
    for name in json.loads((tmp / MANIFEST).read_bytes())["files"]:
        get_file(addr, f"{rel}/{name}", tmp / name)
    why = check_unit(tmp)
    if why:
        raise OSError(f"snapshot step_{step} from {addr}: {why}")
    (tmp / COMPLETE).write_text(f"step {step}\n")
    commit(tmp, final)
    return final


# --- coordinator side: the newest step whose files are all somewhere, assembled on node 0 -------------------

def assemble_newest(root: Path, peers: dict[int, str], newer_than: int, log) -> Path | None:
    """The newest snapshot step > newer_than whose every file is held by this node (ROOT) or a peer's FileServer
    (`peers`: node -> HOST:PORT; one that does not answer is skipped) and verifies: assembled into
    ROOT/checkpoints/step_N and returned. Each step passed over is named through `log`, with why."""
    holders: dict[tuple[int, int], dict[str, list]] = {}  # (step, gen) -> file -> [(addr or None, rel path)]

    def add(addr, inventory):
        for rel, files in inventory.items():
            m = UNIT.match(rel)
            key = (int(m.group(1)), int(m.group(2)))
            for name in files:
                holders.setdefault(key, {}).setdefault(name, []).append((addr, f"{rel}/{name}"))

    add(None, units(root))
    for node, addr in peers.items():
        try:
            add(addr, list_units(addr))
        except OSError as e:
            log(f"resume: node {node}'s snapshots are out of reach ({first_line(e)})")
    for step, gen in sorted(holders, reverse=True):
        if step <= newer_than:
            break
        files = holders[(step, gen)]
        where = f"snapshot step_{step} (generation {gen})"
        tmp = root / "checkpoints" / f"step_{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        why = _fetch(root, files, MANIFEST, tmp, None) or unit_mismatch(tmp)  # a garbled manifest is named, too
        if not why:
            manifest = json.loads((tmp / MANIFEST).read_bytes())["files"]
            missing = sorted(set(manifest) - set(files))
            if missing:
                why = f"{missing[0]} is on no node that answers"
            for name in sorted(manifest):
                why = why or _fetch(root, files, name, tmp, manifest[name])
        if why:
            log(f"resume: skipped {where}: {why}")
            shutil.rmtree(tmp, ignore_errors=True)
            continue
        (tmp / COMPLETE).write_text(f"step {step}\n")
        final = tmp.with_name(f"step_{step}")
        commit(tmp, final)
        for d in final.parent.iterdir():  # the older assembled ones have served
            if d != final:
                shutil.rmtree(d, ignore_errors=True)
        return final
    return None


def _fetch(root: Path, files: dict[str, list], name: str, dest_dir: Path, want: dict | None) -> str:
    """Copy `name` from the first holder (this node's ROOT, or a peer's) whose copy matches `want` (size and
    xxh3); '' or why none did."""
    why = f"{name} is on no node that answers"
    for addr, rel in files.get(name, []):
        dest = dest_dir / name
        try:
            if addr is None:
                shutil.copyfile(root / rel, dest)
            else:
                get_file(addr, rel, dest)
        except OSError as e:
            why = f"{name} could not be read ({first_line(e)})"
            continue
        if want is None or _hash_file(dest) == (want["bytes"], want["xxh3_64"]):
            return ""
        why = f"{'shard' if name.endswith(('.distcp', '.raw')) else 'file'} {name} fails its checksum (xxh3_64) on every node that holds it"
    return why

