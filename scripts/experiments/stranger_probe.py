"""What a stranger on the network gets from an elastic node's snapshot transport (issue 39). Runs against any
tree: it starts that tree's file server the way its agent does, over a snapshot dir holding one unit, then
connects as someone without the job secret and tries list, get, put (a forged unit whose .metadata would run
code) and the replay of a member's request. One line per probe.

    PYTHONPATH=TREE/src python scripts/experiments/stranger_probe.py [--host 127.0.0.1]
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
from pathlib import Path

import xxhash


def _server(root: Path, host: str):
    """(the tree's server as its agent starts it, a member's sealed list request or None, what it binds)."""
    try:  # after issue 39: transport.py, a job key, the address towards the endpoint
        from nanotitan.elastic import agent, auth, transport

        key, say = b"k" * 32, (lambda line: print("  server:", line))
        if hasattr(transport, "Peer"):  # issue 49: a request names its job and node
            s = transport.FileServer(agent.address_towards(host), key, "job", log=say)
            s.node = 0
            return s, json.dumps(auth.seal(key, {"op": "list", "job": "job", "to": 0})).encode() + b"\n", s.host
        s = transport.FileServer(agent.address_towards(host), key, log=say)
        return s, json.dumps(auth.seal(key, {"op": "list"})).encode() + b"\n", s.host
    except ImportError:  # before: snapshot.FileServer() on every interface, no key
        from nanotitan.elastic import snapshot

        s = snapshot.FileServer()
        return s, json.dumps({"op": "list"}).encode() + b"\n", s.server.server_address[0]


def _ask(port: int, line: bytes, body: bytes = b"") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(line + body)
        c.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := c.recv(1 << 16):
            out += chunk
    return out


def _short(b: bytes) -> str:
    return repr(b[:110]) + (f" ... ({len(b)} bytes)" if len(b) > 110 else f" ({len(b)} bytes)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1", help="the job's endpoint host")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="stranger-probe-"))
    unit = root / "step_10" / "g1-node0"
    unit.mkdir(parents=True)
    (unit / "__0_0.raw").write_bytes(b"MODEL AND OPTIMIZER STATE " * 40)
    server, member_list, bound = _server(root, args.host)
    server.root = root
    port = server.port
    print(f"server binds {bound}:{port}")
    print("list:", _short(_ask(port, b'{"op": "list"}\n')))
    print("get: ", _short(_ask(port, json.dumps({"op": "get", "path": "step_10/g1-node0/__0_0.raw"}).encode() + b"\n")))
    meta = b"cbuiltins\nprint\n(Vthis .metadata would run code\ntR."  # a payload
    files = {".metadata": meta}
    files["manifest.json"] = json.dumps({"format": 2, "files": {n: {"bytes": len(b), "xxh3_64": xxhash.xxh3_64_hexdigest(b)}
                                                                for n, b in files.items()}}).encode()
    req = {"op": "put", "unit": "step_999999/g1-node0", "files": [[n, len(b)] for n, b in sorted(files.items())]}
    answer = _ask(port, json.dumps(req).encode() + b"\n", b"".join(b for _n, b in sorted(files.items())))
    committed = (root / "step_999999" / "g1-node0" / ".metadata").exists()
    print("put:  ", _short(answer), "| forged unit committed:", committed)
    first, again = _ask(port, member_list), _ask(port, member_list)
    print("replay of a member's list request: first", _short(first), "| again", _short(again))
    server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
