"""The temp dirs of agents killed -9 are swept (elastic/tempdirs.py): an agent's start and end remove the
`nanotitan-elastic-*` dirs of this user whose owner is provably gone (no such pid, a zombie, or the pid reused by
a process that started at another time), never a live agent's, one without an owner file, or another user's."""

import os
import subprocess
import sys
import time

from nanotitan.elastic import tempdirs

KILLED = ("import os, signal; from nanotitan.elastic import tempdirs; print(tempdirs.make(), flush=True); "
          "os.kill(os.getpid(), signal.SIGKILL)")  # an agent that makes its temp dir, then is killed -9


def _dir_of_a_killed_agent() -> str:
    """A temp dir made by a process that then died by SIGKILL (nothing of it ran to remove the dir)."""
    p = subprocess.run([sys.executable, "-c", KILLED], capture_output=True, text=True, timeout=60)
    assert p.returncode == -9, p.stderr
    return p.stdout.strip()


def _dir_of_a_killed_agent_in(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    return _dir_of_a_killed_agent()


def test_a_killed_agents_dir_is_swept_a_live_ones_kept(tmp_path, monkeypatch):
    dead = _dir_of_a_killed_agent_in(tmp_path, monkeypatch)
    assert os.path.dirname(dead) == str(tmp_path) and os.path.isfile(os.path.join(dead, tempdirs.OWNER))
    zombie = subprocess.Popen([sys.executable, "-c", KILLED], stdout=subprocess.PIPE, text=True)  # killed, not reaped
    undead = zombie.stdout.readline().strip()
    live = tempdirs.make()  # this process's: alive
    reused = tempdirs.make()  # this pid, but the owner started at another time: the pid was reused
    pid, ticks, boot = (reused / tempdirs.OWNER).read_text().split()
    (reused / tempdirs.OWNER).write_text(f"{pid} {int(ticks) - 1} {boot}\n")
    rebooted = tempdirs.make()  # this pid and start time, but of another boot
    (rebooted / tempdirs.OWNER).write_text(f"{pid} {ticks} not-this-boot\n")
    unowned = tmp_path / "nanotitan-elastic-unowned"  # being made, or by a version without owner files
    unowned.mkdir()
    other = tmp_path / "nanotitan-elastic-other"  # not ours to judge
    other.mkdir()

    while tempdirs.start_ticks(zombie.pid, running=True) is not None:  # until it is dead (a zombie)
        time.sleep(0.01)
    try:
        assert sorted(map(str, tempdirs.sweep())) == sorted([dead, undead, str(reused), str(rebooted)])
    finally:
        zombie.wait()
    assert live.is_dir() and unowned.is_dir() and other.is_dir()
    assert not os.path.exists(dead)


def test_another_users_dir_is_untouched(tmp_path, monkeypatch):
    """A dead owner's dir that belongs to another uid stays (this user may not, and must not, judge it)."""
    dead = _dir_of_a_killed_agent_in(tmp_path, monkeypatch)
    if os.getuid() == 0:  # root can make it truly another user's
        os.chown(dead, 65534, 65534)
    else:  # otherwise: this process looks like another user to the sweep
        monkeypatch.setattr(os, "getuid", lambda: os.stat(dead).st_uid + 1)
    assert tempdirs.sweep() == [] and os.path.isdir(dead)
