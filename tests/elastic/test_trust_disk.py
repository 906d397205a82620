"""Snapshot dirs and the secret are the user's own (issue 49, item 6; docs/security.md "Disk"):
- a node's snapshot ROOT sits under SNAPSHOT_DIR/nanotitan-UID/, made 0700; a planted symlink, a dir of another
  user's or one others can read, enter or write is refused in one line (nothing written through it, nothing of the target deleted);
- a secret file open to group/others, someone else's, or a planted RUN_DIR/elastic.secret is refused in one line;
  the README's `chmod 600` secret loads;
- an agent's ranks inherit only the derived key, not $NANOTITAN_ELASTIC_SECRET;
- the snapshot writer and its packing gather JSON in tensors: torch's all_gather_object (which unpickles what each
  peer sends) is never called."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanotitan.config.config import ConfigError, load_config
from nanotitan.elastic import auth
from nanotitan.elastic.rank import snapshot_root


def _cfg(tmp_path, *extra):
    return load_config(None, ["--elastic.nodes", "1:2", "--elastic.endpoint", "127.0.0.1:29500",
                              "--elastic.snapshot_dir", str(tmp_path / "shm"), "--run.dir", str(tmp_path / "run"),
                              "--data.loader", "indexed", *extra])


def test_snapshot_root_is_under_a_private_per_user_parent(tmp_path):
    root = snapshot_root(_cfg(tmp_path), 1)
    parent = tmp_path / "shm" / f"nanotitan-{os.getuid()}"
    assert root.parent == parent and root.name.endswith("-node1") and root.is_dir()
    assert parent.stat().st_mode & 0o777 == 0o700
    assert snapshot_root(_cfg(tmp_path), 1) == root  # an existing own dir is fine


def test_a_planted_snapshot_dir_is_refused_in_one_line(tmp_path):
    """Another user plants /dev/shm/nanotitan-UID as a symlink to a dir of the victim's (the writes, and
    assemble_newest's cleanup of the target's siblings, would go there), or as a dir anyone can write."""
    (tmp_path / "shm").mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("x")
    parent = tmp_path / "shm" / f"nanotitan-{os.getuid()}"
    parent.symlink_to(victim)
    with pytest.raises(ConfigError, match=rf"^snapshot dir {parent} is a symlink: not this user's own; remove it "
                                          r"or choose another --elastic.snapshot_dir$"):
        snapshot_root(_cfg(tmp_path), 0)
    assert sorted(p.name for p in victim.iterdir()) == ["precious"]
    parent.unlink()
    parent.mkdir()
    for mode in (0o777, 0o755, 0o750, 0o701):  # written, or only read or entered, by others (was: 0755 accepted)
        parent.chmod(mode)
        with pytest.raises(ConfigError, match=rf"is open to group or others \(mode {mode:04o}\)"):
            snapshot_root(_cfg(tmp_path), 0)
    parent.chmod(0o700)
    root = snapshot_root(_cfg(tmp_path), 0)
    root.rmdir()
    root.symlink_to(victim)  # the node's own dir, planted (were the parent ever open)
    with pytest.raises(ConfigError, match=rf"^snapshot dir {root} is a symlink"):
        snapshot_root(_cfg(tmp_path), 0)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a dir owned by another user")
def test_a_dir_of_another_user_is_refused(tmp_path):
    parent = tmp_path / "shm" / f"nanotitan-{os.getuid()}"
    parent.mkdir(parents=True, mode=0o700)
    os.chown(parent, 12345, 12345)
    with pytest.raises(ConfigError, match=r"is owned by uid 12345, not this user \(0\)"):
        snapshot_root(_cfg(tmp_path), 0)


def test_a_secret_file_open_to_others_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    s = tmp_path / "job.secret"
    s.write_bytes(os.urandom(32))
    s.chmod(0o644)
    with pytest.raises(ConfigError, match=rf"^elastic.secret_file='{s}' is open to group or others \(mode 0644\): "
                                          rf"chmod 600 {s}, as its owner \(--elastic.secret_file\)$"):
        auth.job_key(_cfg(tmp_path, "--elastic.secret_file", str(s)))
    s.chmod(0o600)  # the README's flow
    assert auth.job_key(_cfg(tmp_path, "--elastic.secret_file", str(s))) == auth.derive(s.read_bytes())
    if os.getuid() == 0:
        os.chown(s, 12345, -1)
        with pytest.raises(ConfigError, match=r"is owned by uid 12345, not this user"):
            auth.job_key(_cfg(tmp_path, "--elastic.secret_file", str(s)))


def test_a_secret_under_16_bytes_is_refused_in_one_line(tmp_path, monkeypatch):
    """A 3-character secret was accepted, and recovered offline in 0.4 s from one signed `done` entry: a secret
    file or $NANOTITAN_ELASTIC_SECRET under auth.MIN_SECRET bytes is refused in one line naming where it came from."""
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    s = tmp_path / "job.secret"
    s.write_text("abc\n")
    s.chmod(0o600)
    with pytest.raises(ConfigError, match=rf"^elastic.secret_file='{s}' holds a secret of 3 bytes, fewer than 16: "):
        auth.job_key(_cfg(tmp_path, "--elastic.secret_file", str(s)))
    monkeypatch.setenv(auth.SECRET_ENV, "x" * 15)
    with pytest.raises(ConfigError, match=r"^\$NANOTITAN_ELASTIC_SECRET holds a secret of 15 bytes, fewer than 16: "):
        auth.job_key(_cfg(tmp_path))
    monkeypatch.setenv(auth.SECRET_ENV, "x" * 16)
    assert auth.job_key(_cfg(tmp_path)) == auth.derive(b"x" * 16)


def test_a_planted_run_dir_secret_is_refused(tmp_path, monkeypatch):
    """RUN_DIR/elastic.secret made by someone else (here: 0644, then a symlink) is a secret they know."""
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    run = tmp_path / "run"
    run.mkdir()
    planted = run / auth.SECRET_FILE
    planted.write_text("known to the attacker")
    planted.chmod(0o644)
    with pytest.raises(ConfigError, match=rf"^{planted} is open to group or others \(mode 0644\): not this user's "
                                          r"own secret; remove it \(a one-host job makes a new one\), or give "
                                          r"--elastic.secret_file$"):
        auth.job_key(_cfg(tmp_path))
    planted.unlink()
    (tmp_path / "theirs").write_text("known")
    (tmp_path / "theirs").chmod(0o600)
    planted.symlink_to(tmp_path / "theirs")
    with pytest.raises(ConfigError, match=rf"^{planted} is unreadable or a symlink"):
        auth.job_key(_cfg(tmp_path))
    planted.unlink()
    key = auth.job_key(_cfg(tmp_path))  # made afresh, 0600, and read back
    assert key != auth.derive(b"known") and planted.stat().st_mode & 0o777 == 0o600


def test_ranks_get_only_the_derived_key(tmp_path, monkeypatch):
    """The agent (agent.main) takes its key through agent_key: the raw secret leaves its environment before any
    rank or warm rank is started, so a child sees no $NANOTITAN_ELASTIC_SECRET."""
    from nanotitan.elastic import agent

    assert agent.agent_key is auth.agent_key and not hasattr(agent, "job_key")
    monkeypatch.setenv(auth.SECRET_ENV, "correct-horse-battery")
    assert auth.agent_key(_cfg(tmp_path)) == auth.derive(b"correct-horse-battery")
    assert auth.SECRET_ENV not in os.environ
    child = subprocess.run([sys.executable, "-c", f"import os; print(os.environ.get({auth.SECRET_ENV!r}))"],
                           capture_output=True, text=True, timeout=30, env=dict(os.environ))
    assert child.stdout.strip() == "None"


def _pack_and_snapshot(rank, world, tmp):
    """Two replicas of a tiny model: the packing's plan and a snapshot's agreement, with all_gather_object
    replaced by a call that fails the test."""
    from nanotitan.elastic import snapshot
    from tests.helpers.specs import build_shard_spec
    from tests.helpers.checkpoint import SAVE_KS, build, perturb, tiny_cfg

    def unpickles(*a, **k):
        raise AssertionError("all_gather_object called: it unpickles what a peer sends")

    torch.distributed.all_gather_object = unpickles
    cfg = tiny_cfg((2, 1, 1))
    model, opt = build(cfg, build_shard_spec(cfg, 0, 0))
    perturb(model, opt, SAVE_KS)
    w = snapshot.SnapshotWriter(cfg, Path(tmp) / "shm", node=0, gen=1, leader=rank == 0, timeout_s=60)
    w.start(5, model, opt, None, {"dp": 2, "pp": 1, "ep": 1}, 10)
    w.wait()
    from nanotitan.state.packing import gather_json

    got = gather_json({"rank": rank, "deep": [[rank]] * rank}, None)
    return got, w.error, w.packing.length


def test_snapshots_gather_no_pickles(tmp_path):
    from nanotitan.state.manifest import unit_mismatch
    from tests.helpers.mp import run_ranks

    out = run_ranks(_pack_and_snapshot, 2, args=(str(tmp_path),), timeout=180)
    assert [o[0] for o in out] == [[{"rank": 0, "deep": []}, {"rank": 1, "deep": [[1]]}]] * 2
    assert [o[1] for o in out] == ["", ""]
    assert all(o[2] > 0 for o in out)  # the replicas split the pieces
    unit = tmp_path / "shm" / "step_5" / "g1-node0"
    assert unit_mismatch(unit) == "" and (unit / ".metadata").is_file()
