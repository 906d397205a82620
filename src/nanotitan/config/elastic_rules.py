"""The config rules of elastic jobs (elastic/, docs/elastic.md). A leaf like config.py, which calls it from
`validate`."""

from __future__ import annotations

import re

from .errors import check as _check
from .parse import elastic_nodes


def check_elastic(cfg) -> None:
    """An elastic job (elastic/): its node range, endpoint and id, and the loader it resumes by step."""
    e = cfg.elastic
    _check(e.nproc_per_node >= 1, f"elastic.nproc_per_node={e.nproc_per_node} must be >= 1 (--elastic.nproc_per_node)")
    _check(e.join_timeout_s > 0, f"elastic.join_timeout_s={e.join_timeout_s} must be > 0 (--elastic.join_timeout_s)")
    _check(e.snapshot_every >= 0,
           f"elastic.snapshot_every={e.snapshot_every} must be >= 0 (--elastic.snapshot_every, 0 = off)")
    if not (e.endpoint or e.nodes):
        return
    _check(bool(e.endpoint) and bool(e.nodes), "an elastic job needs both --elastic.nodes MIN:MAX and "
           "--elastic.endpoint HOST:PORT (node 0's address)")
    elastic_nodes(e.nodes)
    host, _, port = e.endpoint.rpartition(":")
    _check(bool(host) and port.isdigit() and 0 < int(port) < 65536,
           f"elastic.endpoint={e.endpoint!r} must be HOST:PORT (--elastic.endpoint node0:29500)")
    _check(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", e.id)),
           f"elastic.id={e.id!r} must be letters, digits, . _ - (--elastic.id)")
    _check(cfg.data.loader == "indexed", "an elastic job resumes by step: --data.loader indexed")
