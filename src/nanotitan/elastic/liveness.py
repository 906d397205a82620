"""A dead node noticed in seconds (issue 49, item 8; docs/elastic.md): each agent holds one TCP connection to node
0's liveness listener and beats on it every BEAT_S from a thread of its own.

- A node whose processes die (kill -9, an OOM kill) is noticed at once: the kernel closes a dead process's
  sockets, and the listener reads the end of the connection.
- A node that goes silent (frozen: SIGSTOP; its cable pulled), whose connection stays open, is lost after
  elastic.silent_s (default SILENT_S) without a byte from it: 16 missed beats, so a loaded machine's scheduling and
  GIL pauses (hundreds of ms) are no loss. Silence is measured at the listener's own select passes, after it has
  read every byte that had arrived, so a pause of node 0's process is no silence of the others.
- A connection that ends while the agent lives (a pause longer than silent_s, a reset) is made again by the agent's
  Beater, every RETRY_S. Node 0 has dropped the node by then; the agent reads why (`dropped/I`) and asks to join
  again (agent.py), so a node wrongly judged lost comes back at the next generation.

Both ends prove the job's key (auth.py; the lines carry MACs of a key derived from it for them alone). The listener
opens each connection with a random challenge and its MAC, so an agent whose secret differs knows it at once. The
agent answers with its node id. Every line it sends (the hello, seq 0, then one per beat) carries a MAC of the job,
the challenge, the node and a sequence number that must grow by one. A stranger therefore can neither keep a dead
node alive (no valid beat, and a captured one replays under no other challenge) nor end a live one (only the node's
own authenticated connection counts; a stranger's connection, or its close, is refused in one line and changes
nothing). The listener is one thread over every connection (a selector): a connection that says no valid hello
within HELLO_S is closed, at most MAX_PENDING wait for theirs, a line is at most LINE_MAX bytes, and refusal lines
are limited to one a second.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import selectors
import socket
import threading
import time

from ..config.config import ConfigError
from ..run.loopback import family, join_endpoint, split_endpoint

BEAT_S = 0.25  # an agent beats this often on its connection
SILENT_S = 4.0  # elastic.silent_s's default: an open connection silent this long is a lost node
RETRY_S = 0.5  # a Beater whose connection ended (or never opened) tries again this often
HELLO_S = 2.0  # a connection without a valid hello by then is closed
MAX_PENDING = 32  # connections allowed to wait for their hello at once
LINE_MAX = 256  # bytes of one line (a beat is about 110)
MISMATCH_S = 3.0  # a joiner that can verify none of node 0's `job` entries for this long has another secret
LIVE_KEY = "live"  # the store entry (signed, bound to the launch, by node 0's coordinator): the listener's HOST:PORT
JOB_KEY = "job"  # node 0's word that it coordinates the job: its clock, signed but bound to no launch (auth.UNBOUND)


def live_key(job_key: bytes) -> bytes:
    """The liveness lines' own key, derived from the job's: the listener MACs a challenge for anyone who connects,
    which must not be a MAC anything else of the job (a store entry, a transport request) would accept."""
    return hashlib.sha256(b"nanotitan-live-v1\0" + job_key).digest()


def _mac(key: bytes, *fields) -> str:
    return hmac.new(key, "\0".join(map(str, fields)).encode(), hashlib.sha256).hexdigest()


def _parse(line: bytes) -> dict | None:
    """A line as a JSON object, or None for anything else (non-ASCII, deep nesting, garbage)."""
    try:
        msg = json.loads(line.decode("ascii"))
    except Exception:  # noqa: BLE001 - RecursionError, UnicodeError, ValueError: all a stranger's
        return None
    return msg if isinstance(msg, dict) else None


class _Conn:
    def __init__(self, sock: socket.socket, peer: str):
        self.sock, self.peer = sock, peer
        self.challenge = secrets.token_hex(16)
        self.opened = time.monotonic()
        self.buf = b""
        self.node: int | None = None  # set by a valid hello
        self.seq = 0


class LiveServer:
    """Node 0's listener: which nodes hold an authenticated connection, and why one that ended is lost."""

    def __init__(self, host: str, key: bytes, job: str, log=print, silent_s: float = SILENT_S):
        self.key, self.job, self.log, self.silent_s = live_key(key), job, log, silent_s
        self.sock = socket.create_server((host, 0), family=family(host))
        self.sock.setblocking(False)
        self.addr = join_endpoint(host, self.sock.getsockname()[1])
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ)
        self.conns: dict[socket.socket, _Conn] = {}
        self.up: dict[int, _Conn] = {}  # node -> its authenticated connection
        self.seen: dict[int, float] = {}  # node -> when its last valid line was read (monotonic)
        self.ended: dict[int, str] = {}  # node -> why it is lost
        self.longest = (0.0, -1)  # the longest gap between two lines of one node so far, and the node
        self.lock = threading.Lock()
        self.refusals, self.said = 0, 0.0
        self.closing = False
        self.thread = threading.Thread(target=self._loop, daemon=True, name="liveness")
        self.thread.start()

    def state(self, node: int) -> str | None:
        """None: node never held an authenticated connection; '': it holds one and beats; else why it is lost."""
        with self.lock:
            if node in self.ended:
                return self.ended[node]
            return "" if node in self.up else None

    def summary(self) -> str:
        """The longest silence seen (how far a job's beats were from a false loss), '' before any beat."""
        gap, node = self.longest
        return f"liveness: the longest silence of a node was {gap:.2f} s (node {node}; a loss at {self.silent_s:g} s)" \
            if node >= 0 else ""

    def forget(self, node: int) -> None:
        """A dropped node that joins again: judged anew (by its next connection, or its store beats until then)."""
        with self.lock:
            self.ended.pop(node, None)

    def close(self) -> None:
        self.closing = True
        self.thread.join(timeout=5)

    # --- the listener's thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self.closing:
                t0 = time.monotonic()
                for k, _ in self.sel.select(0.1):
                    if k.fileobj is self.sock:
                        self._accept()
                    elif k.fileobj in self.conns:
                        self._read(self.conns[k.fileobj])
                with self.lock:  # every byte that had arrived by t0 is read: silence is measured at t0
                    for c in list(self.conns.values()):
                        if c.node is None and t0 - c.opened > HELLO_S:
                            self._drop(c, f"no valid hello within {HELLO_S:g} s")
                        elif c.node is not None and t0 - self.seen[c.node] > self.silent_s:
                            self._drop(c, f"node {c.node} sent no beat for {t0 - self.seen[c.node]:.1f} s "
                                          "(frozen, or its network is down)")
        finally:
            for c in list(self.conns.values()):
                c.sock.close()
            self.sel.close()
            self.sock.close()

    def _accept(self) -> None:
        try:
            sock, peer = self.sock.accept()
        except OSError:
            return
        c = _Conn(sock, f"{peer[0]}:{peer[1]}")
        if sum(x.node is None for x in self.conns.values()) >= MAX_PENDING:
            sock.close()
            return self._refuse(c, f"more than {MAX_PENDING} connections wait for their hello")
        sock.setblocking(False)
        try:
            sock.send(json.dumps({"challenge": c.challenge, "mac": _mac(self.key, self.job, c.challenge)})
                      .encode() + b"\n")
        except OSError:
            sock.close()
            return
        self.conns[sock] = c
        self.sel.register(sock, selectors.EVENT_READ)

    def _read(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        now = time.monotonic()
        with self.lock:
            if not data:
                return self._drop(c, f"node {c.node}'s agent closed its connection to node 0 (its process "
                                     "died, or it exited)" if c.node is not None else "closed before a valid hello")
            c.buf += data
            while b"\n" in c.buf:
                line, c.buf = c.buf.split(b"\n", 1)
                if why := self._line(c, line, now):
                    return self._drop(c, why)
            if len(c.buf) > LINE_MAX:
                self._drop(c, f"a line longer than {LINE_MAX} bytes")

    def _line(self, c: _Conn, line: bytes, now: float) -> str:
        """Take one line of `c`: '' when it is a valid hello or beat, else why the connection is refused."""
        msg = _parse(line) if len(line) <= LINE_MAX else None
        node, seq = (msg.get("node"), msg.get("seq")) if msg else (None, None)
        if (type(node) is not int or type(seq) is not int or not isinstance(msg.get("mac"), str)
                or not msg["mac"].isascii()
                or not hmac.compare_digest(msg["mac"], _mac(self.key, self.job, c.challenge, node, seq))):
            return "no valid MAC (a sender without the job secret)"
        if c.node is None:
            if seq != 0:
                return "a first line that is no hello (its seq is not 0)"
            old = self.up.get(node)
            if old is not None:  # the node's agent connected anew: its old connection is no loss
                old.node = None
                self._drop(old, "", quiet=True)
            c.node = node
            self.up[node] = c
            self.ended.pop(node, None)
        elif node != c.node or seq != c.seq + 1:
            return f"a beat out of sequence for node {c.node}"
        else:
            self.longest = max(self.longest, (now - self.seen[node], node))
        c.seq = seq
        self.seen[node] = now
        return ""

    def _drop(self, c: _Conn, why: str, quiet: bool = False) -> None:
        """Close `c` (the lock held): the end of an authenticated connection is its node's loss."""
        self.conns.pop(c.sock, None)
        try:
            self.sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()
        if c.node is not None and self.up.get(c.node) is c:
            del self.up[c.node]
            self.ended[c.node] = why
        elif not quiet:
            self._refuse(c, why)

    def _refuse(self, c: _Conn, why: str) -> None:
        self.refusals += 1
        if time.monotonic() - self.said >= 1.0:  # a flood of strangers costs one line a second
            more = f" ({self.refusals - 1} more refused since the last such line)" if self.refusals > 1 else ""
            self.log(f"refused a liveness connection from {c.peer}: {why}{more}")
            self.refusals, self.said = 0, time.monotonic()


class Beater:
    """An agent's side: its connection to node 0's listener, with a beat every BEAT_S from a thread of its own
    (the agent's own ticks, and the store's calls, may take longer than a beat). A connection that cannot be made,
    or that ends, is made again every RETRY_S until `close`: each change named in one line."""

    def __init__(self, addr: str, key: bytes, job: str, node: int, log=print):
        self.addr, self.key, self.job, self.node, self.log = addr, live_key(key), job, node, log
        self.up = threading.Event()  # a connection is open and beating
        self.stop = threading.Event()
        self.sock: socket.socket | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="liveness-beat")
        self.thread.start()

    def _open(self) -> socket.socket:
        """A connection whose hello is done: node 0's challenge verified, this node's hello (seq 0) sent."""
        host, port = split_endpoint(self.addr)
        sock = socket.create_connection((host, port), timeout=HELLO_S)
        try:
            hello = _parse(_readline(sock))
            if not hello or not isinstance(hello.get("challenge"), str) or not isinstance(hello.get("mac"), str) \
                    or not hmac.compare_digest(hello["mac"], _mac(self.key, self.job, hello["challenge"])):
                raise ValueError(f"node 0's liveness listener at {self.addr} does not sign with this node's key")
            self.challenge, self.seq = hello["challenge"], 0
            self._send(sock)
        except BaseException:
            sock.close()
            raise
        return sock

    def _send(self, sock: socket.socket) -> None:
        msg = {"node": self.node, "seq": self.seq, "mac": _mac(self.key, self.job, self.challenge, self.node, self.seq)}
        sock.sendall(json.dumps(msg).encode() + b"\n")

    def _run(self) -> None:
        said, was_up = "", False
        while not self.stop.is_set():
            try:
                self.sock = self._open()
            except (OSError, ValueError) as err:
                why = str(err) if isinstance(err, ValueError) else (err.strerror or str(err))
                if why != said:
                    self.log(f"nanotitan elastic: node {self.node}: no liveness connection to node 0 ({why}); trying "
                             f"again every {RETRY_S:g} s (until then node 0 judges this node by its store beats)")
                    said = why
                self.stop.wait(RETRY_S)
                continue
            if said or was_up:
                self.log(f"nanotitan elastic: node {self.node}: liveness connection to node 0 open again")
            said, was_up = "", True
            self.up.set()
            while not self.stop.wait(BEAT_S):
                self.seq += 1
                try:
                    self._send(self.sock)
                except OSError as err:
                    if not self.stop.is_set():
                        self.log(f"nanotitan elastic: node {self.node}: the liveness connection to node 0 ended "
                                 f"({err.strerror or err}); connecting again")
                        said = "ended"
                    break
            self.up.clear()
            self.sock.close()

    def close(self) -> None:
        self.stop.set()
        if self.sock is not None:
            self.sock.close()
        self.thread.join(timeout=5)


def _readline(sock: socket.socket) -> bytes:
    buf = b""
    while b"\n" not in buf and len(buf) <= LINE_MAX:
        chunk = sock.recv(LINE_MAX)
        if not chunk:
            raise ConnectionError("node 0's liveness listener closed the connection")
        buf += chunk
    return buf.split(b"\n", 1)[0]
