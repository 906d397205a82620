"""Putting a written dir in place of an older copy of itself without a moment when no whole copy is on disk.

A checkpoint saved again at a step that already has one (a re-save after a resume), a snapshot unit pushed again,
a snapshot assembled again: the old way removed the old dir and then renamed the new one into place, and a kill
between the two left neither. `swap_in` renames the old copy aside (NAME.old), moves the new one into place,
marks it complete, and only then deletes the old one. A kill at any point leaves one whole copy: the old one in
place (before the first rename), the old one aside (between the renames, or before the new one's mark), or the
new one. Readers fall back to the aside copy (manifest.resolve_resume), and `settle` puts things back in order
where no job is writing (a run dir's owner at start, every save before it writes).

Only the standard library: the launcher calls `settle` (rundir.clean_stale_saves) before torch is imported.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ASIDE = ".old"  # step_N.old: the copy a re-save set aside until the new step_N is complete
COMPLETE = "COMPLETE"  # a checkpoint's last file (manifest.COMPLETE)


def aside_of(final: Path) -> Path:
    return final.with_name(final.name + ASIDE)


def _whole(d: Path, marked: bool) -> bool:
    """Whether `d` is a whole copy: marked COMPLETE (a checkpoint), or merely there (a snapshot unit: one appears
    only by the rename of a whole .tmp dir)."""
    return (d / COMPLETE).is_file() if marked else d.is_dir()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def swap_in(tmp: Path, final: Path, complete: str | None = None) -> None:
    """Make the written dir `tmp` visible as `final`. With `complete` (a checkpoint) COMPLETE is written into it once
    it is in place; without (a snapshot unit, or an assembled snapshot that carries its COMPLETE already) a dir at
    `final` is whole by being there. An older `final` is renamed aside first and deleted last."""
    old = aside_of(final)
    marked = complete is not None
    if old.exists():  # a swap that a kill cut short: of the two, the whole one stays
        shutil.rmtree(old if _whole(final, marked) else final, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if marked:
        with open(final / COMPLETE, "w", encoding="utf-8") as f:
            f.write(complete)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(final)
    fsync_dir(final.parent)  # the new one is durable before the old one goes
    shutil.rmtree(old, ignore_errors=True)


def settle(root: Path, marked: bool = True) -> list[str]:
    """Finish the swaps a kill cut short under `root` (call it where no job writes there): an aside copy whose
    replacement is whole is deleted; one whose replacement is not (missing, or without COMPLETE) goes back in
    its place. Returns one line per copy put back."""
    out = []
    if not root.is_dir():
        return out
    for old in sorted(root.glob(f"*{ASIDE}")):
        final = old.with_name(old.name.removesuffix(ASIDE))
        if not old.is_dir() or old.is_symlink():
            continue
        if _whole(final, marked):
            shutil.rmtree(old, ignore_errors=True)
            continue
        shutil.rmtree(final, ignore_errors=True)
        os.replace(old, final)
        out.append(f"{final.name}: its re-save did not finish; the copy it had set aside is back in place")
    return out
