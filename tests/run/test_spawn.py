"""nanotitan.run.spawn.run_ranks: results in rank order, fail fast with the failing rank's traceback, a hard
timeout, every rank dead afterwards, and concurrent calls that cannot take each other's port.
Cost: ~45 s wall on 2 quiet cores (12 s of it the hanging case's timeout), 12 rank start-ups and 4 forks."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nanotitan.run.spawn import run_ranks

pytestmark = pytest.mark.serial  # it bounds how fast ranks are killed: it runs alone (Makefile)


def _sum_ranks(rank, world, tag):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)  # the group is real: every rank sees 1 + 2 + ... + world
    return rank, world, tag, t.item(), torch.get_num_threads(), os.environ.get("SPAWN_TAG")


def _write_pid(pid_dir: str, rank: int) -> None:
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))


def _raise_on_rank1(rank, world, pid_dir):
    _write_pid(pid_dir, rank)
    if rank == 1:
        # wait until every rank is alive, so the others really have to be killed
        while len([f for f in os.listdir(pid_dir) if f.endswith(".pid")]) < world:
            time.sleep(0.05)
        Path(pid_dir, "raised_at").write_text(repr(time.time()))
        raise ValueError("boom from rank one")
    time.sleep(300)  # would hold the run for 5 minutes if it were not killed


def _hang_on_rank0(rank, world, pid_dir):
    _write_pid(pid_dir, rank)
    if rank == 0:
        time.sleep(300)
    return rank


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie waits for a reaper that may never come)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _assert_all_gone(pid_dir: Path, world: int) -> None:
    pids = [int((pid_dir / f"{r}.pid").read_text()) for r in range(world)]
    for pid in pids:  # joined, so reaped: the pid no longer exists
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_concurrent_runs_return_their_own_results_in_rank_order():
    """Two calls at once (3 and 2 ranks): each gets its own ranks' results, in rank order, with its own
    threads/env; with a pick-a-port-then-bind launcher the two could rendezvous on one port."""
    out = {}

    def call(tag, world, **kw):
        out[tag] = run_ranks(_sum_ranks, world, args=(tag,), timeout=90, **kw)

    threads = [threading.Thread(target=call, args=("a", 3), kwargs={"env": {"SPAWN_TAG": "A"}}),
               threading.Thread(target=call, args=("b", 2), kwargs={"threads": 2})]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out["a"] == [(r, 3, "a", 6.0, 1, "A") for r in range(3)]
    assert out["b"] == [(r, 2, "b", 3.0, 2, None) for r in range(2)]


def _where(rank, world):
    return os.environ.get("SPAWN_TAG"), os.getcwd(), torch.get_num_threads()


def test_forkserver_ranks_take_the_callers_environment_and_directory(monkeypatch, tmp_path):
    """tests/helpers/mp.py's ranks fork from a server started once: each still sees the caller's environment and working
    directory as they are at the call, not as they were when the server started."""
    from tests.helpers import mp

    mp.run_ranks(_where, 1, timeout=90)  # the server runs by now, if no earlier test started it
    monkeypatch.setenv("SPAWN_TAG", "late")
    monkeypatch.chdir(tmp_path)
    assert mp.run_ranks(_where, 2, timeout=90, threads=2) == [("late", str(tmp_path), 2)] * 2


def test_a_raising_rank_fails_fast_with_its_traceback_and_kills_the_others(tmp_path):
    with pytest.raises(RuntimeError, match="rank 1 failed") as err:
        run_ranks(_raise_on_rank1, 3, args=(str(tmp_path),), timeout=120)
    after = time.time() - float((tmp_path / "raised_at").read_text())
    msg = str(err.value)
    assert "ValueError: boom from rank one" in msg and "_raise_on_rank1" in msg, msg
    # the two sleeping ranks are killed at once, not joined first (a join with a grace period each: >= 10 s)
    assert after < 5, f"returned {after:.1f} s after the raise"
    _assert_all_gone(tmp_path, 3)


def test_a_hanging_rank_hits_the_timeout_with_its_stack_and_everything_is_killed(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] still running after 12 s") as err:
        run_ranks(_hang_on_rank0, 2, args=(str(tmp_path),), timeout=12)
    wall = time.monotonic() - t0
    assert "_hang_on_rank0" in str(err.value), err.value  # the stuck rank's Python stack
    assert wall < 17, f"took {wall:.1f} s for a 12 s timeout"
    _assert_all_gone(tmp_path, 2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_ranks_exit_when_their_caller_is_killed(tmp_path, start_method):
    """A caller killed outright (no finally runs) leaves no rank blocked behind it; a forkserver's rank too (its
    parent is the server, which exits with the caller)."""
    code = (f"from nanotitan.run.spawn import run_ranks; from tests.run.test_spawn import _hang_on_rank0; "
            f"run_ranks(_hang_on_rank0, 1, ({str(tmp_path)!r},), timeout=300, start_method={start_method!r})")
    caller = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "0.pid").exists():
            assert time.monotonic() < deadline and caller.poll() is None, "the rank never started"
            time.sleep(0.1)
    finally:
        caller.kill()
        caller.wait()
    rank_pid = int((tmp_path / "0.pid").read_text())
    deadline = time.monotonic() + 10
    while _running(rank_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(rank_pid), "the rank outlived its caller"
