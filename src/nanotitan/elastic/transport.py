"""The file transport between an elastic job's nodes: each agent serves its snapshot dir (snapshot.py's ROOT) over
TCP, on the address that reaches the job's endpoint, to the job's members only (docs/security.md).

One request per connection: a JSON line, then for `put` the files' bytes; the answer is a JSON line, then for `get`
the file's bytes. Every request carries a MAC of the job's key over its fields, its body's SHA-256, a timestamp
and a nonce (auth.py); every answer a MAC bound to the request's nonce. A request without a valid MAC, stale, or
replayed gets one refusal and nothing else, and is named in one line on the serving node. Paths are relative to
ROOT and never leave it.

    list   the committed units of this node             get   one file
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
import threading
from pathlib import Path

from ..config.errors import first_line
from ..state.manifest import COMPLETE, MANIFEST
from .auth import ReplayGuard, seal, valid
from .snapshot import UNIT, check_unit, commit, prune, units

SOCKET_TIMEOUT_S = 60.0
MAX_LINE = 1 << 20  # a request or answer line; a unit's file list is a few hundred bytes
_NAME = re.compile(r"^(?!\.{1,2}$)[\w.-]+$")  # a file of a unit: a plain name, never . or ..


class _TCPServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True  # on this class only: setting it on ThreadingTCPServer would change every user's
    daemon_threads = True  # a request in flight never holds up the agent's exit


class FileServer:
    """This node's snapshot files for the job's other agents: `list` its units, `get` a file, `put` a peer's unit.
    Binds `host` (the agent passes its address towards the endpoint) and serves requests signed with `key`."""

    def __init__(self, host: str, key: bytes, log=print):
        self.root: Path | None = None  # set once the node has its id (agent.run_agent)
        self.key, self.guard, self.log = key, ReplayGuard(key), log
        server = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                self.connection.settimeout(SOCKET_TIMEOUT_S)
                try:
                    req = server._admit(self.rfile.readline(MAX_LINE), self.client_address)
                    if req is None:  # the one word a stranger gets
                        self.wfile.write(b'{"error": "refused"}\n')
                    else:
                        server._serve(req, self.rfile, self.wfile)
                except (OSError, ValueError) as e:
                    try:
                        self.wfile.write((json.dumps({"error": first_line(e)}) + "\n").encode())
                    except OSError:
                        pass

        self.server = _TCPServer((host, 0), Handler)
        self.host, self.port = self.server.server_address[:2]
        threading.Thread(target=self.server.serve_forever, daemon=True, name="snapshot-files").start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _admit(self, line: bytes, peer) -> dict | None:
        """The request, or None after refusing it (one line here, one refusal there, nothing else)."""
        try:
            req = json.loads(line)
        except ValueError:
            req = None
        why = self.guard.why_not(req) if isinstance(req, dict) else "not a request"
        if not why:
            return req
        op = req.get("op") if isinstance(req, dict) else None
        self.log(f"nanotitan elastic: refused a snapshot-transport request ({str(op)[:20]!r}) from "
                 f"{peer[0]}:{peer[1]}: {why}")
        return None

    def _path(self, rel: str) -> Path:
        if self.root is None:
            raise ValueError("this node has no snapshot dir yet")
        p = (self.root / rel).resolve()
        if not p.is_relative_to(self.root.resolve()):
            raise ValueError(f"path {rel!r} is outside the snapshot dir")
        return p

    def _answer(self, wfile, req: dict, msg: dict, body_sha256: str = "") -> None:
        wfile.write((json.dumps(seal(self.key, msg, body_sha256, reply_to=req["nonce"])) + "\n").encode())

    def _serve(self, req: dict, rfile, wfile) -> None:
        op = req.get("op")
        if op == "list":
            self._answer(wfile, req, {"units": units(self.root) if self.root is not None and self.root.is_dir() else {}})
        elif op == "get":
            p = self._path(req["path"])
            with open(p, "rb") as f:
                size, digest = os.fstat(f.fileno()).st_size, _sha256_file(f)
                self._answer(wfile, req, {"bytes": size}, digest)
                f.seek(0)
                _copy_n(f, wfile, size)
        elif op == "put":
            self._put(req, rfile)
            self._answer(wfile, req, {"ok": True})
        else:
            raise ValueError(f"unknown request {op!r}")

    def _put(self, req: dict, rfile) -> None:
        """A peer's unit: written as .tmp, its bytes checked against the request's SHA-256 and the unit against its
        own manifest, then renamed into place; anything else leaves nothing."""
        if not UNIT.match(str(req.get("unit"))) or not all(_NAME.match(str(n)) for n, _ in req["files"]):
            raise ValueError(f"{str(req.get('unit'))[:80]!r} is not a unit")
        unit = self._path(req["unit"])
        tmp = unit.with_name(unit.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        h = hashlib.sha256()
        try:
            for name, size in req["files"]:
                with open(tmp / name, "wb") as f:
                    _copy_n(rfile, f, int(size), h)
            why = "its bytes are not the ones signed" if h.hexdigest() != req["body"] else check_unit(tmp)
        except (OSError, ValueError):
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if why:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ValueError(f"replica {req['unit']} refused: {why}")
        commit(tmp, unit)
        prune(self.root)


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


def _request(addr: str, key: bytes, req: dict, body=None, body_sha256: str = "",
             timeout_s: float = SOCKET_TIMEOUT_S):
    """(socket, its file, the answer's JSON) of one signed request to the FileServer at HOST:PORT; raises OSError
    on a refusal or an answer without a valid MAC for this request."""
    host, port = addr.rsplit(":", 1)
    req = seal(key, req, body_sha256)
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    f = sock.makefile("rwb")
    try:
        f.write((json.dumps(req) + "\n").encode())
        if body is not None:
            body(f)
        f.flush()
        answer = json.loads(f.readline(MAX_LINE) or b'{"error": "no answer"}')
    except (OSError, ValueError) as e:
        sock.close()
        raise OSError(f"{addr}: {first_line(e)}") from None
    if "error" in answer or not valid(key, answer) or answer.get("reply_to") != req["nonce"]:
        sock.close()
        raise OSError(f"{addr}: {answer.get('error') or 'an answer without a valid MAC'}")
    return sock, f, answer


def list_units(addr: str, key: bytes, timeout_s: float = 5.0) -> dict[str, list[str]]:
    sock, _f, answer = _request(addr, key, {"op": "list"}, timeout_s=timeout_s)
    sock.close()
    return answer["units"]


def get_file(addr: str, key: bytes, rel: str, dest: Path) -> None:
    """Copy one file; raises OSError (and leaves no file) when its bytes are not the ones the answer signed."""
    sock, f, answer = _request(addr, key, {"op": "get", "path": rel})
    h = hashlib.sha256()
    with sock, open(dest, "wb") as out:
        _copy_n(f, out, int(answer["bytes"]), h)
    if h.hexdigest() != answer["body"]:
        dest.unlink()
        raise OSError(f"{addr}: {rel}: the bytes received are not the ones signed")


def push_unit(addr: str, key: bytes, unit: Path, rel: str) -> None:
    """Copy a committed unit to the FileServer at `addr` (the peer checks it before it keeps it)."""
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

    sock, _f, _answer = _request(addr, key, {"op": "put", "unit": rel, "files": files}, body, h.hexdigest())
    sock.close()


def fetch_checkpoint(addr: str, key: bytes, root: Path, step: int) -> Path:
    """This node's copy of node 0's assembled checkpoints/step_N (fetched, verified, then renamed into place)."""
    final = root / "checkpoints" / f"step_{step}"
    if (final / COMPLETE).exists():
        return final
    rel = f"checkpoints/step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    get_file(addr, key, f"{rel}/{MANIFEST}", tmp / MANIFEST)
    for name in json.loads((tmp / MANIFEST).read_bytes())["files"]:
        if not _NAME.match(name):
            raise OSError(f"snapshot step_{step} from {addr}: its manifest names {name[:80]!r}")
        get_file(addr, key, f"{rel}/{name}", tmp / name)
    why = check_unit(tmp)
    if why:
        raise OSError(f"snapshot step_{step} from {addr}: {why}")
    (tmp / COMPLETE).write_text(f"step {step}\n")
    commit(tmp, final)
    return final
