"""A one-host job in a network namespace of its own: its loopback is reachable by its own processes only
(docs/security.md, "Other local users").

Loopback (run/loopback.py) keeps other machines out, not other users of this one: any local process can connect to
127.0.0.1:PORT, read and write the job's TCPStore (torch's store has no access control, and lists its keys), and
from there sit in the ranks' rendezvous, where torch's object collectives (DCP's plan exchange) unpickle what it
sends. In a network namespace of the job's own, the store, the ranks' gloo/NCCL sockets, an elastic job's liveness
listener and snapshot transport listen on a loopback that no process outside the namespace can reach.

How: `unshare(CLONE_NEWNET)` (root), or `unshare(CLONE_NEWUSER | CLONE_NEWNET)` with this user's uid and gid
mapped to themselves (anyone, where the kernel allows unprivileged user namespaces: no capability outside it), then
the namespace's `lo` brought up. The process's children (the ranks) inherit it. The agents of a one-host elastic
job are separate commands: the first to create RUN_DIR/elastic.net (O_EXCL, mode 0600, this user's) makes the
namespace and writes its pid there; the others enter it (`setns` through /proc/PID/ns). A user namespace can only
be made or entered by a process with one thread: the CLI does this before it imports torch.

Where the kernel refuses (no user namespaces for unprivileged users, a seccomp profile), the job runs on the host's
loopback as before and says so in one line; so does a job that logs to W&B (run.wandb: its ranks need the network).

Only the standard library (called before torch is imported).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import socket
import stat
import struct
import time
from pathlib import Path

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
NET_FILE = "elastic.net"  # RUN_DIR/elastic.net: {pid, start} of the agent whose namespace a one-host job's agents share
ENV = "NANOTITAN_PRIVATE_NET"  # set once this process is in its job's namespace (its children are too)
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _map_self() -> None:
    """In a new user namespace: this uid and gid mapped to themselves (files made inside belong to the user)."""
    uid, gid = os.getuid(), os.getgid()
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
    Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")


def _lo_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def _new() -> None:
    """This process into a new network namespace (and a user namespace of its own unless root), `lo` up."""
    libc = _libc()
    if os.geteuid() == 0:
        _check(libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
    else:
        if _threads() > 1:
            raise OSError(errno.EINVAL, "a user namespace needs a process with one thread")
        _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNET), "unshare(CLONE_NEWUSER|CLONE_NEWNET)")
        _map_self()
    _lo_up()


def _enter(pid: int) -> None:
    """This process into the namespaces of `pid` (its user namespace first, unless root)."""
    libc = _libc()
    kinds = [("net", CLONE_NEWNET)] if os.geteuid() == 0 else [("user", CLONE_NEWUSER), ("net", CLONE_NEWNET)]
    if os.geteuid() != 0 and _threads() > 1:
        raise OSError(errno.EINVAL, "a user namespace needs a process with one thread")
    fds = [os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY) for name, _ in kinds]  # both open before either is entered
    try:
        for fd, (name, flag) in zip(fds, kinds):
            _check(libc.setns(fd, flag), f"setns({name} of pid {pid})")
    finally:
        for fd in fds:
            os.close(fd)


def _proc_start(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _owner(path: Path) -> int | None:
    """The pid the namespace file names: -1 while its writer has not written it yet, None when that process is gone
    (or its pid is another's now: the start time differs). The file must be this user's own (0600): one someone
    else wrote could name their namespace."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    with os.fdopen(fd) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise OSError(errno.EPERM, f"{path} is not this user's own 0600 file: remove it")
        text = f.read()
    try:
        info = json.loads(text)
        pid, start = int(info["pid"]), info["start"]
    except (ValueError, KeyError, TypeError):
        return -1
    return pid if _proc_start(pid) == start else None


def enter_private_net(shared: Path | None = None, timeout_s: float = 10.0) -> str:
    """Put this process (before it starts any thread, makes any socket or starts any rank) in its job's own network
    namespace: a new one, or with `shared` (RUN_DIR/elastic.net) the one the job's first agent made. Returns ''
    when it is in, else the one line saying why the job runs on the host's loopback instead."""
    if os.environ.get(ENV):
        return ""  # a rank (or a re-launch inside): its parent put it there
    try:
        if shared is None:
            _new()
        else:
            _shared(shared, timeout_s)
    except OSError as e:
        return (f"no network namespace of the job's own ({e.strerror or e}): the job listens on the host's loopback, "
                "which other local users can reach (docs/security.md)")
    os.environ[ENV] = "1"
    return ""


def _shared(path: Path, timeout_s: float) -> None:
    """The namespace RUN_DIR/elastic.net names, entered; made (and named there) when no live agent's is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    end = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pid = _owner(path)
            if pid is not None and pid >= 0:
                return _enter(pid)
            if pid is None or time.monotonic() > end:  # a gone agent's, or one that never finished writing it
                path.unlink(missing_ok=True)
                end = time.monotonic() + timeout_s
            time.sleep(0.05)
            continue
        with os.fdopen(fd, "w") as f:
            try:
                _new()
            except OSError:
                path.unlink(missing_ok=True)
                raise
            f.write(json.dumps({"pid": os.getpid(), "start": _proc_start(os.getpid())}))
        return
