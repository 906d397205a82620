"""One job owns a run dir: a lock file held for the run's life, and no fresh run over an old run's checkpoints.

Two jobs writing one `run.dir` corrupt each other (one save deletes the other's temp dir, both truncate
metrics.jsonl, pruning keeps whichever steps are highest), and a fresh run into an old run dir has its new
checkpoints pruned in favour of the old run's (issue 12). So:

- `RunDirLock(run_dir)`: `RUN_DIR/.lock` holds {pid, host, started, proc_start, job, cmd} of the holder. It is
  created with O_EXCL; a second job refuses in one line naming the holder. A lock whose PID is dead on this
  host (or reused: its /proc start time differs), or that was left by an earlier attempt of the same torchrun
  job, is taken over with a line saying so. A lock from another host cannot be probed, so it refuses.
- `check_fresh(run_dir, resume, overwrite)`: a run that does not continue this dir's checkpoints refuses
  while the dir holds any, unless `run.overwrite=true`, which deletes them (the refusal is the safety net;
  moving them aside would silently double the disk each time a user restarts an experiment).
- `clean_stale_saves(run_dir)`: `step_N.tmp` dirs left by a job that died mid-save are removed at start, with a
  line (resume never uses them; the lock says no other job is writing them).
- A run dir that cannot be written (permission, read-only file system, full disk) is refused in one line when
  its lock is taken, before any rank starts.
- `owned_run_dir(...)`: all of these, taken by the one process that should hold them (see its docstring).

Only the standard library: the launcher calls this before torch is imported.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from ..config.config import ConfigError
from ..config.errors import os_reason
from ..state.swap import settle

LOCK_FILE = ".lock"
LOCK_ENV = "NANOTITAN_RUN_DIR_LOCK"  # set by the holder for the ranks it starts: "the launcher holds it"
_CKPT_ENTRY = re.compile(r"step_([0-9]+)(\.tmp)?")  # fullmatch


class RunDirError(ConfigError):
    """The run dir is owned by another job, or holds another run's checkpoints: one line, naming the fix."""


def _proc_start(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (Linux /proc), to tell a reused PID from its holder."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the command name may hold spaces


def _alive(holder: dict) -> bool | None:
    """True/False for a holder on this host; None when it is on another host (no way to probe it)."""
    if holder.get("host") != socket.gethostname():
        return None
    pid = int(holder.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's process
    start = _proc_start(pid)
    return not (holder.get("proc_start") and start is not None and start != holder["proc_start"])


def _describe(h: dict) -> str:
    cmd = str(h.get("cmd", "?"))
    cmd = cmd if len(cmd) <= 100 else f"{cmd[:45]} ... {cmd[-50:]}"
    return f"pid {h.get('pid')} on {h.get('host')} since {h.get('started')} ({cmd})"


class RunDirLock:
    """`RUN_DIR/.lock`, held from `acquire()` until `release()` (or the holder's death). Use as
    `with RunDirLock(d) as line:`; `line` is "" or what happened to a stale lock (print it)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.info = {"pid": os.getpid(), "host": socket.gethostname(),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "proc_start": _proc_start(os.getpid()),
                     "job": os.environ.get("TORCHELASTIC_RUN_ID", ""),
                     "cmd": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:2000]}
        self.held = False

    def __enter__(self) -> str:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _read(self) -> dict | None:
        """The holder's info; None while a new holder is between O_EXCL and its write, or if garbled."""
        try:
            info = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            return None
        return info if isinstance(info, dict) and "pid" in info else None

    def acquire(self) -> str:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunDirError(f"run.dir={self.run_dir} cannot be created: {os_reason(e)} (--run.dir)") from None
        for attempt in range(100):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read()
                if holder == {}:  # released between our open and our read
                    continue
                if holder is None:
                    if attempt < 40:  # a new holder is writing its info: give it a moment
                        time.sleep(0.05)
                        continue
                    raise RunDirError(f"{self.path} is unreadable; if no job uses {self.run_dir}, delete it")
                same_job = bool(self.info["job"]) and holder.get("job") == self.info["job"]
                alive = _alive(holder)
                if not same_job and alive is not False:
                    where = "" if alive else " (another host: cannot tell whether it still runs)"
                    raise RunDirError(f"run dir {self.run_dir} is in use by {_describe(holder)}{where}; wait for "
                                      f"that job, stop it, or choose another --run.dir (lock: {self.path})")
                line = self._take_over(holder)
                if line is None:  # someone else changed the lock meanwhile: look again
                    continue
                why = "an earlier attempt of this torchrun job" if same_job else "a process that is gone"
                return f"took over the lock of {self.run_dir} from {_describe(holder)}: {why}"
            except OSError as e:  # no permission, a read-only file system: refused before any rank starts
                raise RunDirError(f"run.dir={self.run_dir} is not writable: cannot create {self.path} "
                                  f"({os_reason(e)}); choose a writable --run.dir") from None
            else:
                try:
                    with os.fdopen(fd, "w") as f:
                        f.write(json.dumps(self.info))
                        f.flush()
                        os.fsync(f.fileno())
                except OSError as e:  # a full disk or quota: nothing of the run could be written either
                    self.path.unlink(missing_ok=True)
                    raise RunDirError(f"run.dir={self.run_dir} is not writable: writing {self.path} failed "
                                      f"({os_reason(e)}); make room or choose another --run.dir") from None
                self.held = True
                return ""
        raise RunDirError(f"could not take {self.path}: it keeps changing (another job starting?)")

    def _take_over(self, holder: dict) -> str | None:
        """Rewrite a stale lock in place under flock, so two jobs taking it over at once cannot both win:
        the second one re-reads it after the first and finds a live holder."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                now = json.loads(f.read() or "null")
            except ValueError:
                now = None
            # Still the stale holder, and still the file at the path (not one a releaser just unlinked)?
            try:
                same_file = os.fstat(f.fileno()).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same_file = False
            if now != holder or not same_file:
                return None
            f.seek(0)
            f.truncate()
            f.write(json.dumps(self.info))
            f.flush()
            os.fsync(f.fileno())
        self.held = True
        return "taken"

    def release(self) -> None:
        if self.held and self._read() == self.info:  # never remove a lock someone took over from us
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self.held = False


def _checkpoint_entries(run_dir: Path) -> list[Path]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((d for d in root.iterdir() if _CKPT_ENTRY.fullmatch(d.name)),
                  key=lambda d: int(_CKPT_ENTRY.fullmatch(d.name).group(1)))


def writable_dir(path: str | Path, flag: str) -> Path:
    """`path` if this process can write there (it, or the nearest existing directory above it, takes a file),
    else a RunDirError naming `flag`: an output dir is refused in one line before anything is computed, and
    nothing is created. Probed by creating a file, since permission bits do not tell (root, ACLs, a read-only
    mount)."""
    path = Path(path)
    probe_in = path
    while not probe_in.exists() and probe_in != probe_in.parent:
        probe_in = probe_in.parent
    try:
        if not probe_in.is_dir():
            raise NotADirectoryError(20, "Not a directory", str(probe_in))
        fd, probe = tempfile.mkstemp(prefix=".nanotitan-probe-", dir=probe_in)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        where = "" if probe_in == path else f" (in {probe_in})"
        raise RunDirError(f"{flag}={path} is not writable{where}: {os_reason(e)}; choose another {flag}") from None
    return path


def clean_stale_saves(run_dir: str | Path) -> str:
    """Remove RUN_DIR/checkpoints/step_N.tmp dirs: saves that a crashed or killed job never finished; and finish
    the re-saves one cut short (state/swap.py: the copy set aside goes back in place, or away once its replacement
    is complete). Call it holding the run dir's lock (no other job can be writing them). Returns "" or the line
    saying what went."""
    root = Path(run_dir) / "checkpoints"
    restored = settle(root)
    stale = sorted(d for d in root.iterdir() if d.name.endswith(".tmp") and _CKPT_ENTRY.fullmatch(d.name)) \
        if root.is_dir() else []
    for d in stale:
        shutil.rmtree(d, ignore_errors=True)
    lines = [f"{root}: {line}" for line in restored]
    if stale:
        lines.append(f"removed {', '.join(d.name for d in stale)} from {root}: unfinished save"
                     f"{'s' if len(stale) > 1 else ''} of an earlier job that stopped mid-save")
    return "; ".join(lines)


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


def check_fresh(run_dir: str | Path, resume: str, overwrite: bool) -> str:
    """Refuse a run that does not continue `run_dir`'s own checkpoints while the dir holds any: a fresh
    run (resume "") or one resuming from a checkpoint elsewhere would mix its steps with the old run's
    (pruning and `resume auto` pick by step number). With `overwrite` those checkpoints are deleted.
    Returns "" or one line to print. Call it once per job, before any rank starts training."""
    run_dir = Path(run_dir)
    if resume == "auto" or (resume and _inside(Path(resume), run_dir)):
        return ""  # continues this dir (overwrite would delete what it resumes from: ignored)
    entries = _checkpoint_entries(run_dir)
    if not entries:
        return ""
    names = entries[0].name if len(entries) == 1 else f"{entries[0].name}..{entries[-1].name}"
    if not overwrite:
        fresh = "a fresh run" if not resume else f"a run resuming from {resume}"
        raise RunDirError(f"run dir {run_dir} holds checkpoints of an earlier run ({names}) and this is {fresh}: "
                          "continue it with --train.resume auto, delete them with --run.overwrite true, "
                          "or choose another --run.dir")
    for d in entries:
        shutil.rmtree(d)
    return f"run.overwrite=true: deleted {len(entries)} checkpoint dirs of an earlier run in {run_dir} ({names})"


@contextlib.contextmanager
def owned_run_dir(run_dir: str | Path, resume: str, overwrite: bool, log=print):
    """Hold `run_dir` for the body: take the lock and `check_fresh` it, in exactly one process per job.

    - A launcher (`nanotitan train` starting local ranks) holds it and tells its ranks through LOCK_ENV,
      so they do nothing here.
    - Under an outside torchrun, global rank 0 holds it (other ranks may be on other hosts, and the run dir
      is shared); a restarted attempt (TORCHELASTIC_RESTART_COUNT > 0) takes over the lock of the previous
      one and does not re-check freshness: the job itself wrote those checkpoints.
    """
    lock_path = str((Path(run_dir) / LOCK_FILE).absolute())
    if os.environ.get(LOCK_ENV) == lock_path or int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    with RunDirLock(run_dir) as line:
        if line:
            log(line)
        if line := clean_stale_saves(run_dir):
            log(line)
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0:
            line = check_fresh(run_dir, resume, overwrite)
            if line:
                log(line)
        os.environ[LOCK_ENV] = lock_path  # inherited by the ranks a launcher starts
        try:
            yield
        finally:
            os.environ.pop(LOCK_ENV, None)

