"""The TCP ports a process tree listens on, read from /proc (what `ss -ltnp` shows, in each process's own network
namespace), for the one-host tests of docs/security.md: a job on one machine listens on loopback only, in a network
namespace of its own where the kernel allows."""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path


def tree(root: int) -> set[int]:
    """root and every process below it."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass  # gone meanwhile
    pids, grew = {root}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in pids} - pids
        pids |= more
        grew = bool(more)
    return pids


def _address(hex_addr: str) -> str:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = ipaddress.IPv4Address(raw[::-1])
    else:  # /proc/net/tcp6: four little-endian 32-bit words
        ip = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
        if ip.ipv4_mapped:
            ip = ip.ipv4_mapped
    return f"{ip}:{int(port, 16)}"


def listening(root: int) -> list[tuple[int, str]]:
    """(pid, ADDRESS:PORT) of every listening TCP socket held by the tree under `root`."""
    inodes: dict[str, int] = {}
    for pid in tree(root):
        try:
            for fd in os.scandir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(fd.path)
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes[link[8:-1]] = pid
        except OSError:
            pass
    out = set()
    for pid in set(inodes.values()):  # each process's own view: a job may run in a network namespace of its own
        for table in ("tcp", "tcp6"):
            try:
                lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                f = line.split()
                if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                    out.add((inodes[f[9]], _address(f[1])))
    return sorted(out)


def beyond_loopback(root: int) -> list[tuple[int, str]]:
    """The listening sockets of the tree that another machine could reach (not on a loopback address)."""
    return [(pid, a) for pid, a in listening(root) if not ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback]


def rank_envs(root: int) -> list[dict]:
    """The starting environment of each rank (RANK and WORLD_SIZE set) in the tree under `root`."""
    envs = []
    for pid in tree(root):
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        except OSError:
            continue
        if "RANK" in env and "WORLD_SIZE" in env:
            envs.append(env)
    return envs


def kill_tree(root: int) -> None:
    for pid in tree(root):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """A stranger's request to 127.0.0.1:PORT: send `data`, half-close, return everything the server answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(1 << 16):
            out += chunk
    return out
