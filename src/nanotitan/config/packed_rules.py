"""The config rules of packed documents and SFT data (model/docs.py, data/sft.py, docs/packed.md): what they
compose with. A leaf like config.py, which calls it from `validate`."""

from __future__ import annotations

from .errors import check as _check


def check_packed(cfg) -> None:
    """data.format=sft reads prepared examples by index from one source."""
    d = cfg.data
    if d.format == "text":
        return
    _check(d.loader == "indexed" and not d.mix,
           "data.format=sft reads prepared examples by index from one source: --data.loader indexed, no --data.mix")
