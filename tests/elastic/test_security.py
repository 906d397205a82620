"""Trust (issue 39, docs/security.md): no byte of a checkpoint, a snapshot or the network runs as code, and an
elastic job's transport and store act only on what carries a valid MAC of the job's key.

- a `.metadata` naming anything but checkpoint metadata ends a resume in one line: its payload never runs, nothing
  is deleted; a real DCP `.metadata` still loads;
- the same file in a snapshot unit pushed with a valid MAC is committed (its manifest agrees) and refused at load;
- a stranger (no MAC, or a MAC of another key) gets nothing from list/get/put, its forged unit is not committed, a
  replayed or stale request is refused, each named in one line on the serving node;
- a store entry without a valid MAC reads as absent, named once; a forged registration joins nothing;
- a job across hosts without a secret does not start (one line naming the option) unless --elastic.insecure."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import xxhash

from tests.helpers.equivalence import base_args, layout_args
from tests.helpers.sockets import exchange as _raw

KEY = b"k" * 32


def _payload(marker: Path) -> bytes:
    """A pickle that, if unpickled by plain pickle, creates `marker` (builtins.open(marker, 'w'))."""
    return f"cbuiltins\nopen\n(V{marker}\nVw\ntR.".encode()


def _plant(step_dir: Path, marker: Path) -> None:
    """Replace a checkpoint's .metadata with the payload and update its manifest to match (as whoever can write
    the one can write the other)."""
    data = _payload(marker)
    (step_dir / ".metadata").write_bytes(data)
    m = json.loads((step_dir / "manifest.json").read_text())
    m["files"][".metadata"] = {"bytes": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)}
    (step_dir / "manifest.json").write_text(json.dumps(m))


@pytest.fixture(scope="module")
def trained(corpus_dir, tmp_path_factory):
    """A one-rank run with checkpoints at steps 2 and 4, and its args."""
    from nanotitan.config.config import load_config
    from nanotitan.train import Trainer

    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("sec") / "run"
    args = base_args(corpus_dir, run) + layout_args(1, 1, 1) + ["--train.ckpt_every", "2"]
    Trainer(load_config(None, args + ["--train.steps", "4"])).train()
    return run, args


def test_metadata_allow_list(tmp_path):
    """A real DCP .metadata loads through the allow-list; one naming builtins.open is refused before it runs."""
    import torch.distributed.checkpoint as dcp

    from nanotitan.config.errors import CheckpointError
    from nanotitan.state.metadata import UnsafeMetadataError, safe_load_metadata

    sd = {"a": torch.zeros(3, 4), "b": torch.ones(2, dtype=torch.bfloat16), "c": torch.tensor(3)}
    dcp.save(sd, checkpoint_id=tmp_path / "real", no_dist=True)
    md = safe_load_metadata((tmp_path / "real" / ".metadata").read_bytes(), "real/.metadata")
    assert md.state_dict_metadata["b"].properties.dtype == torch.bfloat16
    assert list(md.state_dict_metadata["a"].size) == [3, 4]
    marker = tmp_path / "pwned"
    with pytest.raises(UnsafeMetadataError, match=r"^x/.metadata holds builtins.open, which is not checkpoint "
                                                  r"metadata$"):
        safe_load_metadata(_payload(marker), "x/.metadata")
    with pytest.raises(UnsafeMetadataError, match="holds posix.system"):
        safe_load_metadata(b"cposix\nsystem\n(Vtouch /tmp/x\ntR.", "x/.metadata")
    with pytest.raises(CheckpointError, match="unreadable"):
        safe_load_metadata(b"\x80\x04garbage", "x/.metadata")
    assert not marker.exists()


def test_resume_from_a_planted_metadata_runs_nothing(trained, tmp_path):
    """--train.resume auto over a run dir whose newest .metadata is the payload (manifest updated): one line,
    exit 3, the payload's file is not created and the checkpoint is still there."""
    run, args = trained
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    marker = tmp_path / "pwned"
    _plant(copy / "checkpoints" / "step_4", marker)
    argv = [a if a != str(run) else str(copy) for a in args]
    out = subprocess.run([sys.executable, "-m", "nanotitan.cli", "train", *argv, "--train.steps", "6",
                          "--train.resume", "auto"], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    line = (f"checkpoint error: {copy}/checkpoints/step_4/.metadata holds builtins.open, which is not checkpoint "
            "metadata")
    assert out.returncode == 3, out.stdout + out.stderr
    assert line in out.stderr, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert not marker.exists()
    assert (copy / "checkpoints" / "step_4" / ".metadata").read_bytes() == _payload(marker)


def test_a_signed_snapshot_unit_with_planted_metadata_is_refused_at_load(trained, tmp_path):
    """A member's unit pushed with a valid MAC is committed (its manifest agrees with its bytes), assembled, and
    refused when loaded: the MAC says who sent it, not that its bytes are data."""
    import shutil

    from nanotitan.config.config import load_config
    from nanotitan.config.errors import CheckpointError
    from nanotitan.elastic import transport
    from nanotitan.elastic.replicas import assemble_newest
    from nanotitan.state.checkpoint import load_checkpoint
    from nanotitan.train import Trainer

    run, args = trained
    unit = tmp_path / "sender" / "step_4" / "g1-node1"
    shutil.copytree(run / "checkpoints" / "step_4", unit)
    (unit / "COMPLETE").unlink()
    marker = tmp_path / "pwned"
    _plant(unit, marker)
    server = transport.FileServer("127.0.0.1", KEY, "job")
    server.root, server.node = tmp_path / "node0", 0
    server.root.mkdir()  # (its agent makes it, 0700)
    try:
        transport.push_unit(transport.Peer(f"127.0.0.1:{server.port}", "job", 0), KEY, unit, "step_4/g1-node1")
        assert (server.root / "step_4" / "g1-node1" / ".metadata").exists()
        path = assemble_newest(server.root, {}, KEY, -1, print)
    finally:
        server.close()
    tr = Trainer(load_config(None, [a if a != str(run) else str(tmp_path / "r2") for a in args]))
    with pytest.raises(CheckpointError, match=r"step_4/.metadata holds builtins.open, which is not checkpoint"):
        load_checkpoint(path, tr.model, tr.optimizer, tr.dims, shard=tr.shard)
    assert not marker.exists() and (path / ".metadata").exists()


def test_a_stranger_gets_nothing_and_a_replay_is_refused(tmp_path, monkeypatch):
    from nanotitan.elastic import auth, transport

    root = tmp_path / "node0"
    unit = root / "step_10" / "g1-node0"
    unit.mkdir(parents=True)
    (unit / "__0_0.raw").write_bytes(b"secret weights")
    said: list[str] = []
    server = transport.FileServer("127.0.0.1", KEY, "job", log=said.append)
    server.root, server.node = root, 0
    addr = transport.Peer(f"127.0.0.1:{server.port}", "job", 0)
    try:
        assert server.host == "127.0.0.1"  # the address asked for, not every interface
        # no MAC at all: one refusal, nothing else
        for req in ({"op": "list"}, {"op": "get", "path": "step_10/g1-node0/__0_0.raw"}):
            assert _raw(server.port, json.dumps(req).encode() + b"\n") == b'{"error": "refused"}\n'
        forged = tmp_path / "forged" / "step_99/g1-node1"
        forged.mkdir(parents=True)
        (forged / "manifest.json").write_text(json.dumps({"files": {}}))
        body = (forged / "manifest.json").read_bytes()
        put = {"op": "put", "unit": "step_99/g1-node1", "files": [["manifest.json", len(body)]]}
        assert _raw(server.port, json.dumps(put).encode() + b"\n" + body) == b'{"error": "refused"}\n'
        # a MAC of another key: the same
        other = b"o" * 32
        with pytest.raises(OSError, match="refused"):
            transport.list_units(addr, other)
        with pytest.raises(OSError, match="refused"):
            transport.get_file(addr, other, "step_10/g1-node0/__0_0.raw", tmp_path / "got")
        with pytest.raises(OSError, match="refused"):
            transport.push_unit(addr, other, forged, "step_99/g1-node1")
        assert not (root / "step_99").exists() and not (tmp_path / "got").exists()
        assert len(said) == 6 and all("no valid MAC" in s for s in said), said
        # a member's request, replayed byte for byte: refused
        req = json.dumps(auth.seal(KEY, {"op": "list", "job": "job", "to": 0})).encode() + b"\n"
        assert b"step_10/g1-node0" in _raw(server.port, req)
        assert _raw(server.port, req) == b'{"error": "refused"}\n'
        assert "a nonce already used (a replay)" in said[-1]
        # a stale one (signed two minutes ago): refused
        monkeypatch.setattr(auth.time, "time", lambda real=time.time: real() - 120)
        stale = json.dumps(auth.seal(KEY, {"op": "list", "job": "job", "to": 0})).encode() + b"\n"
        monkeypatch.undo()
        assert _raw(server.port, stale) == b'{"error": "refused"}\n'
        assert "stale timestamp" in said[-1] and len(said) == 8
        # the member's own requests still work
        assert list(transport.list_units(addr, KEY)) == ["step_10/g1-node0"]
        transport.get_file(addr, KEY, "step_10/g1-node0/__0_0.raw", tmp_path / "got")
        assert (tmp_path / "got").read_bytes() == b"secret weights"
    finally:
        server.close()


def test_a_forged_store_entry_is_refused_once_and_joins_nothing(corpus_dir, tmp_path, capsys):
    from tests.helpers.elastic import _coordinator, _register

    coord, store, _raw_store = _coordinator(corpus_dir, tmp_path, "1:2")
    _register(coord, store, 0, coord.hash)
    assert store.add("joined", 1) == 1  # a stranger takes a ticket and writes a join request without the key
    store.store.set("join/0", "0" * 64 + json.dumps({"token": "f" * 32, "host": "evil", "pid": 0, "hash": coord.hash,
                                                     "files": "", "ts": time.time()}))
    store.store.set("leave/0", "1")  # and tries to make node 0 leave
    coord.since -= 1e6
    coord.tick()
    coord.tick()
    plan = json.loads(store.get("gen/1"))
    assert plan["members"] == [0], plan
    out = capsys.readouterr().out
    assert out.count("refused store entry 'join/0'") == 1 and out.count("refused store entry 'leave/0'") == 1, out
    assert "leaves" not in out


def test_a_job_across_hosts_needs_a_secret(tmp_path, monkeypatch):
    from nanotitan.config.config import ConfigError, load_config
    from nanotitan.elastic import auth

    monkeypatch.delenv(auth.SECRET_ENV, raising=False)

    def cfg(endpoint, *extra):
        return load_config(None, ["--elastic.nodes", "1:2", "--elastic.endpoint", endpoint,
                                  "--run.dir", str(tmp_path / "run"), "--data.loader", "indexed", *extra])

    with pytest.raises(ConfigError, match=r"needs a job secret.*--elastic.secret_file PATH.*--elastic.insecure true"):
        auth.job_key(cfg("10.1.2.3:29500"))
    assert auth.job_key(cfg("10.1.2.3:29500", "--elastic.insecure", "true")) == auth.INSECURE_KEY
    (tmp_path / "s").write_text("correct-horse-battery\n")
    (tmp_path / "s").chmod(0o600)  # the README's `chmod 600`: a 0644 secret is refused (tests/elastic/test_trust_disk.py)
    assert auth.job_key(cfg("10.1.2.3:29500", "--elastic.secret_file", str(tmp_path / "s"))) == auth.derive(b"correct-horse-battery")
    monkeypatch.setenv(auth.SECRET_ENV, "correct-horse-battery")
    assert auth.job_key(cfg("10.1.2.3:29500")) == auth.derive(b"correct-horse-battery")
    monkeypatch.delenv(auth.SECRET_ENV)
    one = auth.job_key(cfg("127.0.0.1:29500"))  # one host: the run dir's own secret, made once, 0600
    assert auth.job_key(cfg("127.0.0.1:29500")) == one != auth.INSECURE_KEY
    assert (tmp_path / "run" / auth.SECRET_FILE).stat().st_mode & 0o777 == 0o600
