"""One machine is private (docs/security.md): a job whose processes are all on this machine listens on the
loopback address only (its endpoint's: any of 127.0.0.0/8, or ::1).

torch's TCPStore server binds every interface whatever host it is given, and gloo binds the address the hostname
resolves to. Whoever reaches either can sit in the rendezvous, and torch's object collectives then unpickle what
that party sends: code in every rank. So a one-host job hands the store a socket it bound to 127.0.0.1 itself
(`master_listen_fd`) and points gloo and NCCL at the loopback interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME).
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta

HOST = "127.0.0.1"


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT -> (HOST, PORT); an IPv6 address is written in brackets ([::1]:29500) and returned without them."""
    host, _, port = endpoint.rpartition(":")
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host, int(port)


def join_endpoint(host: str, port: int) -> str:
    """(HOST, PORT) -> HOST:PORT, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def host_ip(host: str) -> str:
    """The address HOST names (IPv4 or IPv6: getaddrinfo's first answer); OSError when it names none."""
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]


def is_loopback(host: str) -> bool:
    """Whether HOST names a loopback address: any of 127.0.0.0/8 (a hostname mapped to 127.0.1.1, as Debian and
    Ubuntu do) or ::1."""
    try:
        return ipaddress.ip_address(host_ip(host)).is_loopback
    except (OSError, ValueError):
        return False


def family(ip: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in ip else socket.AF_INET


def loopback_ifname() -> str | None:
    """The loopback interface's name ("lo" on Linux), or None when this machine has none by that name."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return "lo" if "lo" in names else None


def loopback_env() -> dict[str, str]:
    """The environment that keeps a rank's gloo and NCCL sockets on loopback."""
    lo = loopback_ifname()
    return {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo} if lo else {}


def loopback_store(port: int = 0, timeout_s: float = 300.0, multi_tenant: bool = False, host: str = HOST, **kw):
    """A TCPStore server on HOST:PORT only, HOST a loopback address or a name of one (default 127.0.0.1; port 0: the
    kernel picks one; `.port` says which). With multi_tenant, torch's own TCPStore(HOST, PORT, is_master=True,
    multi_tenant=True) in this process (the c10d rendezvous of torchrun) shares this server instead of binding
    every interface. Raises OSError when the port is taken."""
    import torch.distributed as dist

    ip = host_ip(host)
    if not ipaddress.ip_address(ip).is_loopback:
        raise OSError(f"{host} ({ip}) is not a loopback address")
    sock = socket.socket(family(ip))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own bind: a TIME_WAIT port is free
        sock.bind((ip, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    # detach: the store owns the descriptor from here, and closes it with itself
    return dist.TCPStore(ip, sock.getsockname()[1], is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), multi_tenant=multi_tenant,
                         master_listen_fd=sock.detach(), **kw)
