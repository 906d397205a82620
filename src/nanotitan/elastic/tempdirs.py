"""An agent's temp dir (its ranks' error files, the warm ranks' ready files, a held push's copy), and the sweep of
the ones whose agent died without removing its own: a kill -9 runs nothing of the agent, and nothing else knows
the dir is garbage.

`make` creates TMPDIR/nanotitan-elastic-XXXX (mode 0700, tempfile's) with an OWNER file naming the agent: its
pid, that process's start time (/proc/PID/stat, clock ticks since boot) and the boot's id. `sweep`, at every
agent's start and end, removes each such dir of this user whose owner is provably gone: no process with that pid,
a zombie (killed, not yet reaped), a process with that pid but another start time (the pid reused), or another
boot. A live agent's dir is never removed, nor one without a readable OWNER (being made, or made where /proc is
absent), nor another user's.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

PREFIX = "nanotitan-elastic-"
OWNER = "owner"  # "PID START_TICKS BOOT_ID"


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def start_ticks(pid: int, running: bool = False) -> int | None:
    """Process `pid`'s start time in clock ticks since boot (/proc/PID/stat, field 22), None if there is none (or,
    with `running`, if it is a zombie: dead, only not reaped yet by its parent)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if running and fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def make() -> Path:
    """This process's temp dir, its OWNER written (where /proc tells the start time: else never swept)."""
    d = Path(tempfile.mkdtemp(prefix=PREFIX))
    pid, ticks, boot = os.getpid(), start_ticks(os.getpid()), _boot_id()
    if ticks is not None and boot is not None:
        tmp = d / f".{OWNER}.tmp"  # whole or absent: a sweep never reads half an OWNER
        tmp.write_text(f"{pid} {ticks} {boot}\n")
        tmp.replace(d / OWNER)
    return d


def _owner_gone(d: Path, boot: str) -> bool:
    """Whether dir `d`'s OWNER names a process that is provably no more (False when it cannot be told)."""
    try:
        pid, ticks, owner_boot = (d / OWNER).read_text().split()
        pid, ticks = int(pid), int(ticks)
    except (OSError, ValueError):
        return False
    return owner_boot != boot or start_ticks(pid, running=True) != ticks


def sweep(parent: str | Path | None = None) -> list[Path]:
    """Remove the temp dirs under `parent` (default: TMPDIR) of agents of this user that are gone; the list."""
    boot = _boot_id()
    if boot is None:
        return []
    gone = []
    for d in Path(parent or tempfile.gettempdir()).glob(PREFIX + "*"):
        try:
            st = os.lstat(d)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or not _owner_gone(d, boot):
            continue
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d)
    return gone
