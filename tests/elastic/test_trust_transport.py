"""The snapshot transport's smaller holes (issue 49 item 7, docs/security.md): whatever a stranger sends ends in
the one refusal and one line on the serving node, and whatever a server answers ends in one OSError on the
client; a request line has a deadline, connections waiting for theirs are capped, refusal lines are rate limited;
a request names its job and node; names are matched whole and in ASCII; `get` follows no symlink, reads no FIFO.

All in-process, against a FileServer on 127.0.0.1."""

import hashlib
import json
import os
import socket
import threading
import time

import pytest
import xxhash

from nanotitan.elastic import auth, snapshot, transport
from nanotitan.elastic.replicas import assemble_newest
from tests.helpers.sockets import exchange as _raw

KEY = b"k" * 32
REFUSED = b'{"error": "refused"}\n'


def _server(tmp_path, said, node=0, job="job"):
    root = tmp_path / f"node{node}"
    unit = root / "step_10" / "g1-node0"
    unit.mkdir(parents=True, exist_ok=True)
    (unit / "__0_0.raw").write_bytes(b"weights")
    server = transport.FileServer("127.0.0.1", KEY, job, log=said.append)
    server.root, server.node = root, node
    return server


@pytest.fixture
def served(tmp_path):
    """(node 0's FileServer of job "job", the lines it says, a Peer naming it)."""
    said: list[str] = []
    server = _server(tmp_path, said)
    yield server, said, transport.Peer(f"127.0.0.1:{server.port}", "job", 0)
    server.close()


def _signed(fields: dict, **over) -> bytes:
    """A member's request line (a valid MAC over `fields`), then `over` pasted in after sealing (breaks the MAC)."""
    req = auth.seal(KEY, fields)
    return json.dumps({**req, **over}).encode() + b"\n"


def _until(cond, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def _hostile() -> dict[str, bytes]:
    """What a stranger (or a member's broken code) sends: each must end in one refusal and one line. Signed here,
    when the test runs: a MAC minutes old would be refused as stale, not for what it is."""
    return {
        "non-ASCII mac": json.dumps({"op": "list", "job": "job", "to": 0, "mac": "é" * 64}).encode() + b"\n",
        "non-ASCII mac, signed fields": _signed({"op": "list", "job": "job", "to": 0}, mac="\u00e9" * 64),
        "deep JSON": b"[" * 200_000 + b"\n",
        "deep JSON in a field": b'{"op": "list", "mac": ' + b"[" * 50_000 + b"\n",
        "oversize line": b"x" * (transport.MAX_REQUEST + 10) + b"\n",
        "not UTF-8": b"\xff\xfe\xfd{\n",
        "a JSON array": b"[1, 2, 3]\n",
        "empty line": b"\n",
        "truncated line": b'{"op": "list", "ma',
        "huge int": b'{"op": "list", "to": ' + b"9" * 5000 + b"}\n",
        "NaN": b'{"op": "list", "ts": NaN, "mac": "' + b"0" * 64 + b'"}\n',
        "ts of 400 digits": _signed({"op": "list", "job": "job", "to": 0}, ts=10**400),
        "mac of the wrong length": _signed({"op": "list", "job": "job", "to": 0}, mac="0" * 63),
        "mac as a list": _signed({"op": "list", "job": "job", "to": 0}, mac=["a"]),
        # a valid MAC over fields of the wrong type or shape (a member's broken code, or a future bug)
        "path a number": _signed({"op": "get", "path": 123, "job": "job", "to": 0}),
        "path with ..": _signed({"op": "get", "path": "step_10/../../x", "job": "job", "to": 0}),
        "to a bool": _signed({"op": "list", "job": "job", "to": True}),
        "files not pairs": _signed({"op": "put", "unit": "step_1/g1-node0", "files": [["a"]], "job": "job", "to": 0}),
        "files a dict": _signed({"op": "put", "unit": "step_1/g1-node0", "files": {"a": 1}, "job": "job", "to": 0}),
        "size negative": _signed({"op": "put", "unit": "step_1/g1-node0", "files": [["a", -5]], "job": "job", "to": 0}),
        "unknown op": _signed({"op": "rm", "job": "job", "to": 0}),
        "an extra field": _signed({"op": "list", "job": "job", "to": 0, "x": 1}),
        "no destination": _signed({"op": "list"}),
    }


def test_every_hostile_request_gets_one_refusal_and_one_line(served, capfd, monkeypatch):
    monkeypatch.setattr(transport, "SAID_PER_MIN", 1000, raising=False)  # this test counts every line
    server, said, peer = served
    hostile = _hostile()
    for i, (what, data) in enumerate(hostile.items()):
        assert _raw(server.port, data) == REFUSED, what  # its line is said before the answer is sent
        assert len(said) == i + 1 and said[i].startswith("nanotitan elastic: refused"), (what, said[i:])
        assert "\n" not in said[i] and len(said[i]) < 400 and said[i].isascii(), (what, said[i])
    # a member's NaN timestamp (it would never go stale)
    monkeypatch.setattr(auth.time, "time", lambda: float("nan"))
    nan = json.dumps(auth.seal(KEY, {"op": "list", "job": "job", "to": 0})).encode() + b"\n"
    monkeypatch.undo()
    monkeypatch.setattr(transport, "SAID_PER_MIN", 1000, raising=False)
    assert _raw(server.port, nan) == REFUSED and "NaN" in said[-1]
    # the server is still up and serves a member
    assert transport.list_units(peer, KEY) == {"step_10/g1-node0": ["__0_0.raw"]}
    server.close()
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err, err[-2000:]
    assert len(said) == len(hostile) + 1


class _Liar:
    """A server at an address a member trusts that answers each request with `answer(request) -> bytes`."""

    def __init__(self, answer):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port, self.answer = self.sock.getsockname()[1], answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    req = json.loads(conn.makefile("rb").readline())
                    conn.sendall(self.answer(req))
                except OSError:
                    pass

    def close(self):
        self.sock.close()


def _sealed(msg: dict, body: str = ""):
    return lambda req: json.dumps(auth.seal(KEY, msg, body, reply_to=req["nonce"])).encode() + b"\n"


GARBAGE = {  # what a server answers a member: each must end in one clean OSError on the client
    "nothing": lambda req: b"",
    "not JSON": lambda req: b"<html>\n",
    "deep JSON": lambda req: b"[" * 200_000 + b"\n",
    "a JSON list": lambda req: b"[1]\n",
    "a JSON string": lambda req: b'"units"\n',
    "non-ASCII mac": lambda req: json.dumps({"units": {}, "reply_to": req["nonce"], "mac": "é" * 64}).encode() + b"\n",
    "an error that is a dict": lambda req: b'{"error": {"a": 1}}\n',
    "no newline, ever": lambda req: b"{" * 100,
    "oversize line": lambda req: b" " * (transport.MAX_ANSWER + 10) + b"\n",
    "another request's nonce": lambda req: _sealed({"units": {}})({"nonce": "0" * 32}),
    "units a list": _sealed({"units": [1, 2]}),
    "units with a path": _sealed({"units": {"../../etc": ["passwd"]}}),
    "units with a newline": _sealed({"units": {"step_1/g1-node1\n": ["a"]}}),
    "file names not str": _sealed({"units": {"step_1/g1-node1": [None]}}),
    "get: bytes a str": _sealed({"bytes": "7"}, "0" * 64),
    "get: bytes negative": _sealed({"bytes": -1}, "0" * 64),
    "get: short body": lambda req: _sealed({"bytes": 100}, "0" * 64)(req) + b"abc",
}


def test_a_garbage_answer_is_one_clean_error_on_the_client(tmp_path):
    for what, answer in GARBAGE.items():
        liar = _Liar(answer)
        peer = transport.Peer(f"127.0.0.1:{liar.port}", "job", 1)
        try:
            call = (lambda: transport.get_file(peer, KEY, "step_1/g1-node1/a", tmp_path / "got")) \
                if what.startswith("get") else (lambda: transport.list_units(peer, KEY, timeout_s=2.0))
            with pytest.raises(OSError) as err:
                call()
            assert str(err.value).startswith(peer.addr) and "\n" not in str(err.value), (what, err.value)
            assert not (tmp_path / "got").exists(), what
            if not what.startswith("get"):  # node 0's resume: one line, and on it goes
                said: list[str] = []
                assert assemble_newest(tmp_path / "node0", {1: peer}, KEY, -1, said.append) is None
                assert len(said) == 1 and "out of reach" in said[0], (what, said)
        finally:
            liar.close()
    # fetch_checkpoint: a signed manifest that is not one
    liar = _Liar(lambda req: _sealed({"bytes": 9}, hashlib.sha256(b"[" * 9).hexdigest())(req) + b"[" * 9)
    try:
        with pytest.raises(OSError, match="a manifest that is not one"):
            transport.fetch_checkpoint(transport.Peer(f"127.0.0.1:{liar.port}", "job", 0), KEY, tmp_path / "n2", 4)
    finally:
        liar.close()


def test_a_slow_loris_is_cut_at_the_request_deadline(served, monkeypatch):
    monkeypatch.setattr(transport, "REQUEST_S", 1.0, raising=False)
    server, said, _peer = served
    line = json.dumps(auth.seal(KEY, {"op": "list", "job": "job", "to": 0})).encode() + b"\n"
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(0.2)  # one byte each 0.2 s: a valid request, far too slowly
        start, got = time.monotonic(), b""
        for b in line:
            if time.monotonic() - start > 3:  # not cut (the old per-read timeout): stop waiting
                break
            try:
                s.send(bytes([b]))
                got = s.recv(100)
            except socket.timeout:
                continue
            except OSError:
                break
            break  # the server answered (or closed)
        cut = time.monotonic() - start
    assert got in (REFUSED, b"") and cut < 2.5, (got, cut)
    _until(lambda: said)
    assert "within the deadline" in said[0], said


def test_connections_waiting_for_their_request_are_capped(tmp_path, monkeypatch):
    monkeypatch.setattr(transport, "MAX_PENDING", 4, raising=False)
    said: list[str] = []
    server = _server(tmp_path, said)
    peer = transport.Peer(f"127.0.0.1:{server.port}", "job", 0)
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=3) as extra:
            assert extra.recv(100) == REFUSED  # at once, from the accepting thread: no thread for it
        _until(lambda: said)
        assert "more than 4 connections wait" in said[0], said
        for s in idle:
            s.close()
        _until(lambda: len(said) == 5)  # each idle one's slot is free once its line is said
        assert transport.list_units(peer, KEY) == {"step_10/g1-node0": ["__0_0.raw"]}
    finally:
        for s in idle:
            s.close()
        server.close()


def test_a_flood_of_refusals_prints_a_bounded_number_of_lines(served):
    server, said, _peer = served
    for _ in range(transport.SAID_PER_MIN + 40):
        assert _raw(server.port, b'{"op": "list"}\n') == REFUSED
    server.close()  # sums up what was not named
    assert len(said) == transport.SAID_PER_MIN + 1, said
    assert "refused 40 more snapshot-transport requests" in said[-1]


def test_a_request_for_another_node_or_job_is_refused(tmp_path):
    said1: list[str] = []
    said2: list[str] = []
    node1, node2 = _server(tmp_path, said1, node=1), _server(tmp_path, said2, node=2)
    other_job = _server(tmp_path, said2, node=1, job="other")
    try:
        for_node1 = json.dumps(auth.seal(KEY, {"op": "list", "job": "job", "to": 1})).encode() + b"\n"
        assert b"step_10/g1-node0" in _raw(node1.port, for_node1)
        assert _raw(node2.port, for_node1) == REFUSED  # the same bytes, replayed to node 2 within the window
        assert "addressed to node 1 of job 'job', this is node 2" in said2[-1], said2
        again = json.dumps(auth.seal(KEY, {"op": "list", "job": "job", "to": 1})).encode() + b"\n"
        assert _raw(other_job.port, again) == REFUSED  # node 1 of another job with the same secret
        assert "of job 'other'" in said2[-1], said2
        with pytest.raises(OSError, match="refused"):  # the client helpers name the destination too
            transport.list_units(transport.Peer(f"127.0.0.1:{node2.port}", "job", 1), KEY)
        assert transport.list_units(transport.Peer(f"127.0.0.1:{node2.port}", "job", 2), KEY)
    finally:
        for s in (node1, node2, other_job):
            s.close()


def test_get_follows_no_symlink_and_reads_no_fifo(served, tmp_path):
    server, _said, peer = served
    unit = server.root / "step_10" / "g1-node0"
    (tmp_path / "outside").write_bytes(b"not a snapshot")
    os.symlink(unit / "__0_0.raw", unit / "inside_link")  # inside ROOT: still not followed
    os.symlink(tmp_path / "outside", unit / "outside_link")
    os.symlink(unit, server.root / "step_10" / "g1-node9")  # a linked dir on the way
    os.mkfifo(unit / "fifo")
    for rel in ("inside_link", "outside_link", "fifo"):
        start = time.monotonic()
        with pytest.raises(OSError, match="symlink|not a regular file"):
            transport.get_file(peer, KEY, f"step_10/g1-node0/{rel}", tmp_path / "got")
        assert time.monotonic() - start < 5 and not (tmp_path / "got").exists(), rel
    with pytest.raises(OSError, match="symlink|Not a directory|Too many levels"):
        transport.get_file(peer, KEY, "step_10/g1-node9/__0_0.raw", tmp_path / "got")
    transport.get_file(peer, KEY, "step_10/g1-node0/__0_0.raw", tmp_path / "got")  # a regular file still is
    assert (tmp_path / "got").read_bytes() == b"weights"


def test_names_are_matched_whole_and_in_ascii(served, tmp_path):
    from nanotitan.config.config import ConfigError, load_config
    from nanotitan.state.manifest import COMPLETE, complete_steps

    # a unit dir with a trailing newline ($ matched before it) or Arabic-Indic digits (\d) is not listed
    root = tmp_path / "root"
    bad = ("step_1/g1-node1\n", "step_\u0661/g1-node1")
    for rel in bad:
        (root / rel).mkdir(parents=True)
    assert snapshot.units(root) == {}
    run = tmp_path / "run"  # nor is such a checkpoint
    (run / "checkpoints" / "step_\u0663").mkdir(parents=True)
    (run / "checkpoints" / "step_\u0663" / COMPLETE).write_text("step 3\n")
    assert complete_steps(run) == []
    with pytest.raises(ConfigError, match="elastic.id"):
        load_config(None, ["--elastic.nodes", "1:2", "--elastic.endpoint", "127.0.0.1:1", "--elastic.id", "j\u00f6b",
                           "--data.loader", "indexed"])
    # nor pushed: the server refuses such a unit, and a file name with a non-ASCII letter (\w)
    server, _said, peer = served
    unit = tmp_path / "send" / "u"
    unit.mkdir(parents=True)
    (unit / "manifest.json").write_text(json.dumps({"format": 2, "files": {}}))
    for rel in bad:
        with pytest.raises(OSError, match="refused"):
            transport.push_unit(peer, KEY, unit, rel)
    (unit / "\u00e9.raw").write_bytes(b"x")  # listed in its manifest: only its name is wrong
    (unit / "manifest.json").write_text(json.dumps({"format": 2, "files": {
        "\u00e9.raw": {"bytes": 1, "xxh3_64": xxhash.xxh3_64_hexdigest(b"x")}}}))
    with pytest.raises(OSError, match="refused"):
        transport.push_unit(peer, KEY, unit, "step_2/g1-node1")
    assert sorted(p.name for p in server.root.iterdir()) == ["step_10"]
