"""The file transport between an elastic job's nodes: each agent serves its snapshot dir (snapshot.py's ROOT) over
TCP, on the address that reaches the job's endpoint, to the job's members only (docs/security.md).

One request per connection: a JSON line, then for `put` the files' bytes; the answer is a JSON line, then for `get`
the file's bytes. Every request carries a MAC of the job's key over its fields, its body's SHA-256, a timestamp,
a nonce (auth.py) and its destination (the job id and node id it is for); every answer a MAC bound to the request's
nonce. A request that is not well formed, without a valid MAC, stale, replayed or addressed to another node or job
gets one refusal and nothing else, and is named in one line on the serving node (at most SAID_PER_MIN a minute,
the rest counted). A connection must deliver its request line within REQUEST_S, and at most MAX_PENDING wait for
theirs at once. Paths are relative to ROOT, made of plain names, and never leave it nor follow a symlink.

    list   the committed units of this node             get   one regular file
    put    a peer's unit: written as .tmp, its body's SHA-256 and its manifest checked, then renamed into place
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import socketserver
import stat
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..config.errors import first_line
from ..state.manifest import COMPLETE, MANIFEST
from ..run.loopback import family, split_endpoint
from .auth import ReplayGuard, seal, valid
from .snapshot import UNIT, check_unit, commit, units

SOCKET_TIMEOUT_S = 60.0  # a member's transfer, per socket operation, once its request is admitted
REQUEST_S = 5.0  # connect to the request line's newline: a client that trickles it (slow loris) is cut
MAX_REQUEST = 64 << 10  # a request line; a unit's file list is a few hundred bytes
MAX_ANSWER = 1 << 20  # an answer line (a node's unit list)
MAX_PENDING = 32  # connections not yet admitted, each a thread: one more is refused at once
SAID_PER_MIN = 10  # refusal lines named per minute; the others are counted, then summed up in one line
MAX_FILES = 10_000  # in a put's file list, or a unit list's
_NAME = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9_.-]{1,255}")  # fullmatch: a plain file name, never . or ..
_HEX = re.compile(r"[0-9a-f]*")  # fullmatch
_GARBLED = (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError, OverflowError)
_REFUSED = b'{"error": "refused"}\n'  # the one word a stranger gets


@dataclass(frozen=True)
class Peer:
    """Where a request goes: the FileServer at `addr` (HOST:PORT) of node `node` of job `job`. The job and node
    are signed into the request and checked by the server: one captured for node 1 is refused by node 2."""
    addr: str
    job: str
    node: int


class _Refused(Exception):
    """Why a request is refused (the serving node's one line), and its op when known."""

    def __init__(self, why: str, op: str = "?"):
        super().__init__(why)
        self.op = op


class _TCPServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True  # on this class only: setting it on ThreadingTCPServer would change every user's
    daemon_threads = True  # a request in flight never holds up the agent's exit
    request_queue_size = 128  # a flood overflowing the accept queue (5) would delay members' connects by seconds

    def __init__(self, addr, files: "FileServer"):
        self.files, self.pending = files, threading.BoundedSemaphore(MAX_PENDING)
        self.address_family = family(addr[0])
        super().__init__(addr, _Handler)

    def process_request(self, request, client_address):
        """A thread per connection, but at most MAX_PENDING of them not yet admitted: one more is refused here."""
        if not self.pending.acquire(blocking=False):
            self.files.say(client_address, f"more than {MAX_PENDING} connections wait for their request line")
            try:
                request.setblocking(False)
                request.send(_REFUSED)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def handle_error(self, request, client_address):  # never a traceback: one line
        self.files.say(client_address, first_line(sys.exc_info()[1]))


class _Handler(socketserver.BaseRequestHandler):
    def handle(self):
        self.server.files.handle(self.request, self.client_address, self.server.pending.release)


class _Said:
    """The serving node's refusal lines: the first SAID_PER_MIN of each minute named, the others counted and summed
    up in one line (when the next minute's first one comes, or at close). A flood prints a few lines a minute."""

    def __init__(self, log):
        self.log, self.lock = log, threading.Lock()
        self.since, self.named, self.hidden = time.monotonic(), 0, 0

    def __call__(self, line: str) -> None:
        with self.lock:
            if time.monotonic() - self.since >= 60.0:
                self.flush()
            if self.named < SAID_PER_MIN:
                self.named += 1
                self.log(line)
            else:
                self.hidden += 1

    def flush(self) -> None:
        if self.hidden:
            self.log(f"nanotitan elastic: refused {self.hidden} more snapshot-transport requests in the last "
                     f"{time.monotonic() - self.since:.0f} s (not named: at most {SAID_PER_MIN} a minute)")
        self.since, self.named, self.hidden = time.monotonic(), 0, 0


class FileServer:
    """This node's snapshot files for the job's other agents: `list` its units, `get` a file, `put` a peer's unit.
    Binds `host` (the agent passes its address towards the endpoint) and serves requests signed with `key` and
    addressed to job `job`, node `node` (set with `root` once the node has its id: agent.run_agent)."""

    def __init__(self, host: str, key: bytes, job: str, log=print):
        self.root: Path | None = None
        self.node: int | None = None
        self.key, self.job, self.guard, self.log = key, job, ReplayGuard(key), log
        self.said = _Said(log)
        self.server = _TCPServer((host, 0), self)
        self.host, self.port = self.server.server_address[:2]
        threading.Thread(target=self.server.serve_forever, daemon=True, name="snapshot-files").start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        with self.said.lock:
            self.said.flush()

    def say(self, client, why: str, op: str = "?") -> None:
        self.said(f"nanotitan elastic: refused a snapshot-transport request ({op}) from {_peer(client)}: {why}")

    def handle(self, sock: socket.socket, client, admitted) -> None:
        """One connection: its request line within REQUEST_S, admitted or refused (one refusal, one line), then
        served. Nothing a peer sends escapes as a traceback."""
        try:
            line, rest = _read_line(sock, MAX_REQUEST, time.monotonic() + REQUEST_S, "request")
            req = self._admit(line)
        except Exception as e:  # noqa: BLE001 - a stranger's bytes: whatever they raise is one refusal
            if isinstance(e, _Refused):
                self.say(client, str(e), e.op)
            else:
                self.say(client, f"a request that breaks its reader ({first_line(e)[:120]})")
            _refuse(sock)
            return
        finally:
            admitted()  # its slot among the pending connections (a refused one's after its refusal)
        wfile = sock.makefile("wb")
        try:
            sock.settimeout(SOCKET_TIMEOUT_S)
            self._serve(req, _Body(rest, sock.makefile("rb")), wfile)
        except Exception as e:  # noqa: BLE001 - a member's request that fails: its one line goes back to it
            _send(wfile, (json.dumps({"error": first_line(e)}) + "\n").encode())
        finally:
            try:
                wfile.close()
            except OSError:
                pass

    def _admit(self, line: bytes) -> dict:
        """The request, or _Refused saying why not: well formed, a valid MAC, fresh, new, for this job and node."""
        try:
            req = json.loads(line, parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:
            raise _Refused(f"not a JSON request ({first_line(e)[:80]})") from None
        why = _malformed(req)
        op = _shown(req.get("op"), 20) if isinstance(req, dict) else "?"
        why = why or self.guard.why_not(req)
        if not why and (req["job"], req["to"]) != (self.job, self.node):
            why = (f"addressed to node {req['to']} of job {_shown(req['job'], 60)!r}, this is node {self.node} of job "
                   f"{self.job!r} (a request replayed to another node or job)")
        if why:
            raise _Refused(why, op)
        return req

    def _serve(self, req: dict, rfile, wfile) -> None:
        op = req["op"]
        if op == "list":
            held = units(self.root) if self.root is not None and self.root.is_dir() else {}
            self._answer(wfile, req, {"units": held})
        elif op == "get":
            with os.fdopen(_open_under(self._root(), req["path"]), "rb") as f:
                size, digest = os.fstat(f.fileno()).st_size, _sha256_file(f)
                self._answer(wfile, req, {"bytes": size}, digest)
                f.seek(0)
                _copy_n(f, wfile, size)
        else:
            self._put(req, rfile)
            self._answer(wfile, req, {"ok": True})

    def _root(self) -> Path:
        if self.root is None:
            raise ValueError("this node has no snapshot dir yet")
        return self.root

    def _answer(self, wfile, req: dict, msg: dict, body_sha256: str = "") -> None:
        wfile.write((json.dumps(seal(self.key, msg, body_sha256, reply_to=req["nonce"])) + "\n").encode())
        wfile.flush()

    def _put(self, req: dict, rfile) -> None:
        """A peer's unit: written as .tmp, its bytes checked against the request's SHA-256 and the unit against its
        own manifest, then renamed into place; anything else leaves nothing."""
        root = self._root()
        unit = root / req["unit"]  # _malformed: step_N/gG-nodeI, plain names
        tmp = unit.with_name(unit.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(exist_ok=True)  # the step's dir, in ROOT (never ROOT itself: made 0700 by its agent)
        tmp.mkdir()
        h = hashlib.sha256()
        try:
            for name, size in req["files"]:
                with open(tmp / name, "xb") as f:  # a fresh dir: a name given twice is refused
                    _copy_n(rfile, f, size, h)
            why = "its bytes are not the ones signed" if h.hexdigest() != req["body"] else check_unit(tmp)
        except (OSError, ValueError):
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if why:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ValueError(f"replica {req['unit']} refused: {why}")
        commit(tmp, unit)  # the agent decides what is kept (replicas.prune)


# --- what a request and an answer must look like ------------------------------------------------------------

_COMMON = {"op": str, "ts": (int, float), "nonce": str, "body": str, "reply_to": str, "mac": str, "job": str,
           "to": int}
_OPS = {"list": {}, "get": {"path": str}, "put": {"unit": str, "files": list}}


def _malformed(req) -> str:
    """'' when `req` has exactly a request's fields, each of its type and shape, else why not. Checked before the
    MAC: a stranger's fields reach no parser, hash or comparison but these."""
    if not isinstance(req, dict):
        return "not a JSON object"
    if not (isinstance(req.get("mac"), str) and len(req["mac"]) == 64 and _HEX.fullmatch(req["mac"])):
        return "no valid MAC (a sender without the job secret)"
    if req.get("op") not in _OPS:
        return "no known op"
    want = {**_COMMON, **_OPS[req["op"]]}
    if set(req) != set(want):
        return f"fields {ascii(sorted(set(req) ^ set(want)))[:80]} missing or unknown"
    for k, kind in want.items():  # bool is not an int here: type(), not isinstance
        if type(req[k]) not in (kind if isinstance(kind, tuple) else (kind,)):
            return f"field {k!r} is not {'a number' if isinstance(kind, tuple) else 'a ' + kind.__name__}"
    if not (abs(req["ts"]) < 1e15 and len(req["nonce"]) == 32 and _HEX.fullmatch(req["nonce"])
            and len(req["body"]) in (0, 64) and _HEX.fullmatch(req["body"]) and req["reply_to"] == ""
            and len(req["job"]) <= 200 and req["to"] >= 0):
        return "a field out of its range (ts, nonce, body, reply_to, job or to)"  # NaN < 1e15 is false too
    if req["op"] == "get" and not (len(req["path"]) <= 1024
                                   and all(_NAME.fullmatch(p) for p in req["path"].split("/"))):
        return f"path {ascii(req['path'])[:80]} is not plain names under the snapshot dir"
    if req["op"] == "put":
        files = req["files"]
        if not (UNIT.fullmatch(req["unit"]) and len(files) <= MAX_FILES
                and all(type(f) is list and len(f) == 2 and type(f[0]) is str and _NAME.fullmatch(f[0])
                        and type(f[1]) is int and 0 <= f[1] < 1 << 48 for f in files)):
            return f"unit {ascii(req['unit'])[:80]} or its file list is not a unit's"
    return ""


def _unit_list(answer: dict) -> dict[str, list[str]]:
    """A list answer's units, or ValueError when they are not {step_N/gG-nodeI: [plain names]}."""
    got = answer.get("units")
    if not (isinstance(got, dict) and len(got) <= MAX_FILES and all(
            isinstance(rel, str) and UNIT.fullmatch(rel) and isinstance(names, list) and len(names) <= MAX_FILES
            and all(isinstance(n, str) and _NAME.fullmatch(n) for n in names) for rel, names in got.items())):
        raise ValueError("a unit list that is not one")
    return got


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number here")


def _shown(x, n: int = 200) -> str:
    """A peer's text for a log line: printable ASCII, at most n characters."""
    return (x if isinstance(x, str) and x.isascii() and x.isprintable() else ascii(x))[:n]


def _peer(client) -> str:
    return f"{client[0]}:{client[1]}" if isinstance(client, tuple) and len(client) >= 2 else "?"


# --- bytes on the wire ----------------------------------------------------------------------------------

def _read_line(sock: socket.socket, cap: int, deadline: float, what: str) -> tuple[bytes, bytes]:
    """(the first line, with its newline; the bytes read after it) of `sock`, whole within `deadline`
    (time.monotonic()) and at most `cap` bytes; else _Refused. A per-read timeout alone would let a peer that
    sends one byte a second hold the thread for ever."""
    buf = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Refused(f"no whole {what} line within the deadline ({len(buf)} bytes, cut)")
        sock.settimeout(left)
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            continue
        except OSError as e:  # reset by the peer, say
            raise _Refused(f"the connection failed before a whole {what} line ({first_line(e)[:80]})") from None
        if not chunk:
            raise _Refused(f"the connection closed before a whole {what} line ({len(buf)} bytes)")
        end = chunk.find(b"\n")
        if end >= 0 and len(buf) + end < cap:
            return buf + chunk[:end + 1], chunk[end + 1:]
        buf += chunk
        if len(buf) >= cap:
            raise _Refused(f"a {what} line over {cap} bytes")


class _Body:
    """A socket's bytes after its first line: those already read, then the rest."""

    def __init__(self, head: bytes, rfile):
        self.head, self.rfile = head, rfile

    def read(self, n: int) -> bytes:
        if self.head:
            chunk, self.head = self.head[:n], self.head[n:]
            return chunk
        return self.rfile.read(n)


def _send(wfile, data: bytes) -> None:
    try:
        wfile.write(data)
        wfile.flush()
    except OSError:
        pass


def _refuse(sock: socket.socket, linger_s: float = 1.0, drain: int = 1 << 20) -> None:
    """The one word a stranger gets, then what it still sends read and dropped (at most `drain` bytes, `linger_s`):
    a close on unread bytes resets the connection, and a reset can discard the refusal before the peer reads it."""
    end = time.monotonic() + linger_s
    try:
        sock.settimeout(linger_s)
        sock.sendall(_REFUSED)
        sock.shutdown(socket.SHUT_WR)
        while drain > 0 and (left := end - time.monotonic()) > 0:
            sock.settimeout(left)
            if not (chunk := sock.recv(min(drain, 1 << 16))):
                break
            drain -= len(chunk)
    except OSError:
        pass


def _open_under(root: Path, rel: str) -> int:
    """A read-only fd of ROOT/REL (plain names: _malformed), opened one level at a time without following a
    symlink (O_NOFOLLOW) nor blocking on a FIFO (O_NONBLOCK); OSError unless it is a regular file."""
    parts = rel.split("/")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for d in parts[:-1]:
            nxt = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        try:
            out = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except OSError as e:
            raise OSError(f"{rel}: a symlink, or not there ({e.strerror})") from None
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(out).st_mode):
        os.close(out)
        raise OSError(f"{rel} is not a regular file")
    return out


def _sha256_file(f) -> str:
    h = hashlib.sha256()
    while chunk := f.read(8 << 20):
        h.update(chunk)
    return h.hexdigest()


def _copy_n(src, dst, n: int, h=None) -> None:
    while n > 0:
        chunk = src.read(min(n, 8 << 20))
        if not chunk:
            raise OSError(f"connection closed with {n} bytes still to come")
        dst.write(chunk)
        if h is not None:
            h.update(chunk)
        n -= len(chunk)


# --- the client side: every failure, whatever the other side sent, is one OSError -------------------------

def _request(peer: Peer, key: bytes, req: dict, body=None, body_sha256: str = "",
             timeout_s: float = SOCKET_TIMEOUT_S):
    """(socket, a reader of what follows the answer line, the answer's JSON) of one signed request to `peer`;
    raises OSError, in one line, on a refusal, an answer without a valid MAC for this request, or any garbage."""
    req = seal(key, dict(req, job=peer.job, to=peer.node), body_sha256)
    try:
        host, port = split_endpoint(peer.addr)
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except (OSError, ValueError) as e:
        raise OSError(f"{peer.addr}: {first_line(e)}") from None
    try:
        f = sock.makefile("wb")
        f.write((json.dumps(req) + "\n").encode())
        if body is not None:
            body(f)
        f.flush()
        line, rest = _read_line(sock, MAX_ANSWER, time.monotonic() + timeout_s, "answer")
        sock.settimeout(timeout_s)
        answer = json.loads(line, parse_constant=_no_constant)
        if not isinstance(answer, dict):
            raise ValueError("an answer that is not a JSON object")
        if "error" in answer:
            raise OSError(_shown(answer["error"]))
        if not valid(key, answer) or answer.get("reply_to") != req["nonce"]:
            raise OSError("an answer without a valid MAC")
        return sock, _Body(rest, sock.makefile("rb")), answer
    except (OSError, _Refused, *_GARBLED) as e:
        sock.close()
        why = str(e) if isinstance(e, (OSError, _Refused)) and str(e) else first_line(e)
        raise OSError(f"{peer.addr}: {why}") from None


def list_units(peer: Peer, key: bytes, timeout_s: float = 5.0) -> dict[str, list[str]]:
    sock, _f, answer = _request(peer, key, {"op": "list"}, timeout_s=timeout_s)
    sock.close()
    try:
        return _unit_list(answer)
    except ValueError as e:
        raise OSError(f"{peer.addr}: {e}") from None


def get_file(peer: Peer, key: bytes, rel: str, dest: Path) -> None:
    """Copy one file; raises OSError (and leaves no file) when its bytes are not the ones the answer signed."""
    sock, f, answer = _request(peer, key, {"op": "get", "path": rel})
    with sock:
        size, want = answer.get("bytes"), answer.get("body")
        if type(size) is not int or size < 0 or not isinstance(want, str):
            raise OSError(f"{peer.addr}: {rel}: an answer without a size and a SHA-256")
        h = hashlib.sha256()
        try:
            with open(dest, "wb") as out:
                _copy_n(f, out, size, h)
        except OSError as e:
            dest.unlink(missing_ok=True)
            raise OSError(f"{peer.addr}: {rel}: {first_line(e)}") from None
    if h.hexdigest() != want:
        dest.unlink()
        raise OSError(f"{peer.addr}: {rel}: the bytes received are not the ones signed")


def push_unit(peer: Peer, key: bytes, unit: Path, rel: str) -> None:
    """Copy a committed unit to `peer`'s FileServer (the peer checks it before it keeps it)."""
    files = sorted((f.name, f.stat().st_size) for f in unit.iterdir())
    h = hashlib.sha256()
    for name, _size in files:
        with open(unit / name, "rb") as src:
            while chunk := src.read(8 << 20):
                h.update(chunk)

    def body(out):
        for name, _size in files:
            with open(unit / name, "rb") as src:
                shutil.copyfileobj(src, out, 8 << 20)

    sock, _f, _answer = _request(peer, key, {"op": "put", "unit": rel, "files": files}, body, h.hexdigest())
    sock.close()


def fetch_checkpoint(peer: Peer, key: bytes, root: Path, step: int) -> Path:
    """This node's copy of node 0's assembled checkpoints/step_N (fetched, verified, then renamed into place)."""
    final = root / "checkpoints" / f"step_{step}"
    if (final / COMPLETE).exists():
        return final
    rel = f"checkpoints/step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    get_file(peer, key, f"{rel}/{MANIFEST}", tmp / MANIFEST)
    try:
        names = list(json.loads((tmp / MANIFEST).read_bytes(), parse_constant=_no_constant)["files"])
    except _GARBLED as e:
        raise OSError(f"snapshot step_{step} from {peer.addr}: a manifest that is not one ({first_line(e)})") from None
    for name in names:
        if not (isinstance(name, str) and _NAME.fullmatch(name)):
            raise OSError(f"snapshot step_{step} from {peer.addr}: its manifest names {ascii(name)[:80]}")
        get_file(peer, key, f"{rel}/{name}", tmp / name)
    why = check_unit(tmp)
    if why:
        raise OSError(f"snapshot step_{step} from {peer.addr}: {why}")
    (tmp / COMPLETE).write_text(f"step {step}\n")
    commit(tmp, final)
    return final
