"""The snapshot transport's smaller holes (issue 49 item 7), probed against any tree since issue 39: it starts that
tree's FileServer over a snapshot dir holding one unit, and prints one line per probe: what the stranger (or the
member's client) got, how many lines the server said, and whether a traceback escaped.

    PYTHONPATH=TREE/src python scripts/experiments/transport_probe.py
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from nanotitan.elastic import auth, snapshot, transport

KEY = b"k" * 32
NEW = hasattr(transport, "Peer")  # this wave: requests name their job and node


def _server(root: Path, said: list, node: int = 0):
    s = transport.FileServer("127.0.0.1", KEY, "job", log=said.append) if NEW else \
        transport.FileServer("127.0.0.1", KEY, log=said.append)
    s.root, s.node = root, node
    return s


def _peer(port: int, node: int = 0):
    return transport.Peer(f"127.0.0.1:{port}", "job", node) if NEW else f"127.0.0.1:{port}"


def _ask(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    out = b""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        c.sendall(data)  # a refusal at accept may reset the connection first
        c.shutdown(socket.SHUT_WR)
        while chunk := c.recv(1 << 16):
            out += chunk
    return out


def _sealed(**fields) -> bytes:
    return json.dumps(auth.seal(KEY, {"op": "list", "job": "job", "to": 0, **fields} if NEW else
                                {"op": "list", **fields})).encode() + b"\n"


def _probe(port, said, err, what: str, data: bytes) -> None:
    n, t = len(said), err.getvalue().count("Traceback")
    got = _ask(port, data)  # the server's line, or its traceback, comes before it closes the connection
    print(f"{what:<34} got {got[:40]!r:<44} server lines {len(said) - n}, tracebacks "
          f"{err.getvalue().count('Traceback') - t}")


def _slow_loris(port: int, limit_s: float = 8.0) -> str:
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.settimeout(0.5)
        start = time.monotonic()
        for b in _sealed():
            if time.monotonic() - start > limit_s:
                return f"still connected after {limit_s:g} s (1 byte / 0.5 s)"
            try:
                c.send(bytes([b]))
                if c.recv(100) or True:
                    return f"cut after {time.monotonic() - start:.1f} s"
            except socket.timeout:
                continue
            except OSError:
                return f"cut after {time.monotonic() - start:.1f} s"
    return "sent the whole line"


def _liar(answer) -> int:
    """A server that answers one request with answer(its JSON)."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        with contextlib.suppress(OSError):
            conn, _ = srv.accept()
            with conn:
                conn.sendall(answer(json.loads(conn.makefile("rb").readline())))
    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="transport-probe-"))
    unit = root / "step_10" / "g1-node0"
    unit.mkdir(parents=True)
    (unit / "__0_0.raw").write_bytes(b"weights")
    os.symlink(unit / "__0_0.raw", unit / "link")
    (root / "step_1" / "g1-node1\n").mkdir(parents=True)
    said: list[str] = []
    err = io.StringIO()
    sys.stderr = err  # socketserver prints a handler's traceback here
    try:
        _probes(root, said, err)
    finally:
        sys.stderr = sys.__stderr__
    return 0


def _probes(root: Path, said: list, err: io.StringIO) -> None:
    s0, s1 = _server(root, said, 0), _server(root, said, 1)
    p = s0.port
    _probe(p, said, err, "non-ASCII mac", b'{"op": "list", "mac": "' + "é".encode() * 64 + b'"}\n')
    _probe(p, said, err, "deep JSON", b"[" * 100_000 + b"\n")
    _probe(p, said, err, "signed, path a number", _sealed(op="get", path=123))
    _probe(p, said, err, "request for node 1 sent to node 0", _sealed(to=1) if NEW else _sealed())
    _probe(p, said, err, "signed get of a symlink in ROOT", _sealed(op="get", path="step_10/g1-node0/link"))
    print(f"{'slow loris':<34} {_slow_loris(p)}")
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", p)) for _ in range(100)]
    end = time.monotonic() + 2  # until the server has taken them all (the old tree) or 2 s (capped)
    while threading.active_count() < before + 100 and time.monotonic() < end:
        time.sleep(0.01)
    print(f"{'100 idle connections':<34} server threads +{threading.active_count() - before}")
    for c in idle:
        c.close()
    n = len(said)
    for _ in range(200):
        _ask(p, b'{"op": "list"}\n')
    s0.close()
    print(f"{'200 bad requests':<34} server lines {len(said) - n}")
    signed = lambda req: json.dumps(auth.seal(KEY, {"units": {"../x": ["y"]}}, reply_to=req["nonce"])).encode() + b"\n"
    for what, answer in (("client: answer [1]", lambda req: b"[1]\n"),
                         ("client: non-ASCII mac", lambda req: '{"mac": "é"}\n'.encode()),
                         ("client: signed units {'../x': ..}", signed)):
        try:
            got = transport.list_units(_peer(_liar(answer), 1), KEY)
            print(f"{what:<34} returned {str(got)[:60]}")
        except Exception as e:  # noqa: BLE001 - what the client raises is the probe's result
            print(f"{what:<34} raised {type(e).__name__}: {str(e)[:70]}")
    print(f"{'units() of step_1/g1-node1<LF>':<34} listed: {'step_1/g1-node1' + chr(10) in snapshot.units(root)}")
    s1.close()


if __name__ == "__main__":
    raise SystemExit(main())
