"""The multi-rank test harness is the package's own: `run_ranks(fn, world, args=(...), timeout=...)` runs
fn(rank, world, *args) on `world` gloo processes (see nanotitan/spawn.py)."""

import socket

from nanotitan.spawn import run_ranks

__all__ = ["run_ranks", "free_port"]


def free_port() -> int:
    """A port free right now, for launchers that need one up front (torchrun's --rdzv-endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
