"""What is on disk under RUN_DIR/checkpoints and whether it can be trusted: the layout of a checkpoint dir,
its manifest of checksums, verification, and the choice of what to resume from (the newest that verifies).

A checkpoint dir (step_N/) holds DCP's `.metadata` and `__<rank>_*.distcp` shards, `config.toml`, `state.json`,
`manifest.json` (every other file's size and xxh3-64) and, written last, `COMPLETE`. A save in progress is
`step_N.tmp/`. checkpoint.py writes them; this module reads them. Verification is collective: every rank
returns the same verdict (each file is checked by one rank, the results agreed by one all-reduce).

A checkpoint reads only itself (issue 49): every name its manifest gives is a plain file name in its dir, and each
file is opened without following a symlink and only if it is a regular file (`open_plain`), so a manifest or a
`.metadata` naming `../x`, `/etc/shadow` or `/dev/zero`, or a symlink or FIFO planted in the dir, is refused in
one line instead of being read (or hanging every rank's verification).
"""

from __future__ import annotations

import json
import os
import re
import stat
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

from ..config.errors import CheckpointError, ConfigError, first_line, os_reason
from ..config.hardware import fmt_bytes
from ..parallel.comm import collectives as comm
from .swap import aside_of

COMPLETE = "COMPLETE"
STATE_FILE = "state.json"
MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"
FORMAT_VERSION = 2  # 2: manifest.json with a checksum per file
STEP_DIR = re.compile(r"step_([0-9]+)")  # fullmatch, as the two below
_ENTRY = re.compile(r"step_([0-9]+)(\.tmp|\.old)?")  # a checkpoint dir, a save that never finished, a copy set aside
_SHARD = re.compile(r"__([0-9]+)_[0-9]+\.(distcp|raw)")  # rank r's shards: DCP's __r_<k>.distcp, a snapshot's __r_0.raw
_CHUNK = 8 << 20


# --- the checkpoints of a run ----------------------------------------------------------------------

def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _entries(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, dir) of every step_N and step_N.tmp under RUN_DIR/checkpoints, newest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), d) for d in root.iterdir() if (m := _ENTRY.fullmatch(d.name))]
    return sorted(out, key=lambda e: (e[0], e[1].name.endswith(".tmp")), reverse=True)


def complete_steps(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, dir) of each step whose step_N dir has a COMPLETE marker, else whose copy a re-save set aside
    (step_N.old, swap.py) has one; oldest first."""
    best: dict[int, Path] = {}
    for s, d in _entries(run_dir):
        if not d.name.endswith(".tmp") and (d / COMPLETE).is_file() and (s not in best or STEP_DIR.fullmatch(d.name)):
            best[s] = d
    return sorted(best.items())


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint of a run that has a COMPLETE marker, or None. Not verified: for
    choosing what to resume from use resolve_resume (it verifies)."""
    steps = complete_steps(run_dir)
    return steps[-1][1] if steps else None


def saved_checkpoint(run_dir: str | Path, step: int | None = None) -> Path:
    """A run's complete checkpoint, the newest or step's (what `export` and `eval` read), or a ConfigError line
    naming the flag to fix."""
    if step is None:
        path = latest_checkpoint(run_dir)
        if path is None:
            raise ConfigError(f"no complete checkpoint under {run_dir} (--run.dir of a run that saved one)")
        return path
    path = checkpoint_dir(run_dir) / f"step_{step}"
    if not (path / COMPLETE).is_file():
        raise ConfigError(f"{path} is not a complete checkpoint (--step of a saved step)")
    return path


# --- a checkpoint's own files: plain names, regular files, never through a symlink -------------------------

NOT_PLAIN = "is a symlink or not a regular file"  # how a line names a file that open_plain refused


def plain_name(name) -> bool:
    """Whether `name` names a file in the dir itself: no '/', not '.', '..', empty or absolute."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def open_plain(path: Path, buffering: int = 0):
    """`path` opened for reading (unbuffered by default) if it is a regular file and not a symlink (O_NOFOLLOW;
    O_NONBLOCK so a FIFO cannot block the open), else OSError naming it."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a symlink: ELOOP
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} {NOT_PLAIN}")
    return os.fdopen(fd, "rb", buffering=buffering)


def read_plain(path: Path) -> bytes:
    with open_plain(path) as f:
        return f.read()


def is_plain_file(path: Path) -> bool:
    """lstat: a regular file, not a symlink to one."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


# --- checksums and the manifest ------------------------------------------------------------------

def hash_file(path: Path) -> tuple[int, str]:
    """(bytes, xxh3-64 hex) of a file, read in 8 MiB chunks into one buffer. xxh3 runs at ~0.03 s/GiB
    over the read on our CPUs (crc32 0.23, blake2b 1.2; docs/checkpoint.md) and ships with `datasets`."""
    h, size = xxhash.xxh3_64(), 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open_plain(path) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def _to_i64(hexdigest: str) -> int:
    v = int(hexdigest, 16)
    return v - (1 << 64) if v >= 1 << 63 else v


def _from_i64(v: int) -> str:
    return format(v & ((1 << 64) - 1), "016x")


def _checker(name: str, world: int) -> int:
    """The rank that checksums a file: a shard's writer (its bytes are still in that host's page cache;
    mod world when a smaller job loads it), rank 0 for the small files."""
    m = _SHARD.fullmatch(name)
    return int(m.group(1)) % world if m else 0


def hash_shards(tmp: Path, files: list[str]) -> dict[str, dict]:
    """Collective, right after dcp.save: each rank checksums the shards it wrote (in parallel, instead of
    rank 0 reading the whole checkpoint again) and one all-reduce of a [files, 2] int64 table of
    (bytes, digest) gives every rank all of them. Also the barrier after the writes."""
    rank, world = comm.world_rank(), comm.world_size()
    table = torch.zeros(len(files), 2, dtype=torch.int64)
    for i, name in enumerate(files):
        if _checker(name, world) == rank:
            try:
                size, digest = hash_file(tmp / name)
                table[i] = torch.tensor([size, _to_i64(digest)])
            except OSError:
                table[i, 0] = -1  # agreed below: every rank fails the save, naming this file
    if comm.distributed():
        table = table.to(comm.collective_device())
        comm.all_reduce(table, axis="other")
    out = {}
    for name, (size, digest) in zip(files, table.tolist()):
        if size < 0:
            raise CheckpointError(f"could not read back {tmp / name} after writing it (disk full or lost?)")
        out[name] = {"bytes": int(size), "xxh3_64": _from_i64(int(digest))}
    return out


_PHASE1 = {1: "does not exist", 2: f"incomplete (no {COMPLETE} marker: its save did not finish)",

           3: f"{MANIFEST} is missing (a checkpoint saved before manifests loads with --train.verify_ckpt false)",
           4: f"{MANIFEST} cannot be read", 5: f"{MANIFEST} is garbled",
           6: f"{MANIFEST} {NOT_PLAIN} (refused: a checkpoint reads only its own files)",
           7: f"{MANIFEST} names a path that is not a plain file name in this dir (refused: a checkpoint reads only "
              "its own files)"}
_NOT_A_CHECKPOINT = (_PHASE1[1], _PHASE1[2])  # reasons that say "no checkpoint here", not "a damaged one"


def _read_manifest(path: Path, checksums: bool) -> tuple[dict | None, int, int]:
    """(files, problem code of _PHASE1 or 0, crc32 of the manifest bytes): phase 1, local to this rank."""
    if not path.is_dir():
        return None, 1, 0
    if not (path / COMPLETE).is_file():
        return None, 2, 0
    try:
        raw = read_plain(path / MANIFEST)
    except FileNotFoundError:
        return None, 0 if not checksums else 3, 0  # format 1 loads unverified only on request
    except OSError:
        return None, 4 if is_plain_file(path / MANIFEST) else 6, 0
    try:
        files = json.loads(raw)["files"]
        assert isinstance(files, dict) and all(
            isinstance(v["bytes"], int) and len(v["xxh3_64"]) == 16 for v in files.values())
    except (ValueError, KeyError, TypeError, AssertionError):
        return None, 5, zlib.crc32(raw)
    if not all(plain_name(n) for n in files):  # "/dev/zero" or "../x" would be read (forever) by every rank
        return None, 7, zlib.crc32(raw)
    return files, 0, zlib.crc32(raw)


def verify_checkpoint(path: str | Path, checksums: bool = True) -> str:
    """Collective: '' when checkpoint `path` can be trusted, else one short reason naming the file, e.g.
    "shard __1_0.distcp fails its checksum (xxh3_64; damaged)". Every rank returns the same line.

    Phase 1 (every rank alone, agreed by one all-reduce of problem codes): COMPLETE marker, manifest
    readable and the same bytes on every rank (a file system that shows ranks different files must not
    split their decisions). Phase 2 (each file checked by one rank, agreed by one all-reduce of a
    [files, 2] table of (problem code, actual size)): every file exists with its size and, with
    `checksums`, its xxh3-64. `checksums=False` checks sizes only, and accepts a checkpoint saved
    before manifests (format 1)."""
    path = Path(path)
    files, code, crc = _read_manifest(path, checksums)
    rows = comm.all_rows([float(code), float(crc)])
    failing = [int(row[0]) for row in rows if row[0]]
    if failing:
        return _PHASE1[failing[0]]
    if len({row[1] for row in rows}) > 1:
        return f"ranks read different {MANIFEST} files (is run.dir on a file system every rank sees?)"
    if files is None:
        return ""

    names = sorted(files)
    rank, world = comm.world_rank(), comm.world_size()
    codes = torch.zeros(len(names), 2, dtype=torch.int64)  # (0 ok | 1 missing | 2 size | 3 checksum | 4 I/O |
    # 5 a symlink or not a regular file, size)
    for i, name in enumerate(names):
        if _checker(name, world) != rank:
            continue
        want = files[name]
        try:
            st = os.lstat(path / name)
            size = st.st_size
            if not stat.S_ISREG(st.st_mode):
                codes[i, 0] = 5
            elif size != want["bytes"]:
                codes[i] = torch.tensor([2, size])
            elif checksums and hash_file(path / name)[1] != want["xxh3_64"]:
                codes[i, 0] = 3
        except FileNotFoundError:
            codes[i, 0] = 1
        except OSError:
            codes[i, 0] = 4
    if comm.distributed():
        codes = codes.to(comm.collective_device())
        comm.all_reduce(codes, axis="other")
    for name, (code, size) in zip(names, codes.tolist()):
        kind = "shard" if _SHARD.fullmatch(name) else "file"
        if code == 1:
            return f"{kind} {name} is missing"
        if code == 2:
            return f"{kind} {name} is {size} bytes, the manifest says {files[name]['bytes']} (truncated or replaced)"
        if code == 3:
            return f"{kind} {name} fails its checksum (xxh3_64; damaged)"
        if code == 4:
            return f"{kind} {name} cannot be read"
        if code == 5:
            return f"{kind} {name} {NOT_PLAIN} (refused: a checkpoint reads only its own files)"
    return comm.agree(extra_shard(path, files) if rank == 0 else "", f"verifying {path}")


def extra_shard(path: Path, files: dict) -> str:
    """'' or the line naming a shard in `path` that its manifest does not list (another save's, or planted). Only a
    non-empty one: a rank whose keys were all deduped may leave an empty file that no metadata points at."""
    try:
        extra = sorted(f.name for f in path.iterdir() if _SHARD.fullmatch(f.name) and f.name not in files
                       and f.lstat().st_size > 0)
    except OSError as e:
        return f"{path} cannot be listed ({os_reason(e)})"
    return f"shard {extra[0]} is not in {MANIFEST} (from another save, or planted: remove it)" if extra else ""


def unit_mismatch(d: Path) -> str:
    """'' when a snapshot unit dir `d` (elastic/snapshot.py) matches its manifest, else one line naming the file:
    the manifest is a table of plain file names to sizes and xxh3-64s, every file in `d` but the manifest is in it
    and has that size and checksum. The manifest's other files (the other nodes' shards) are not here: not checked."""
    try:
        files = json.loads(read_plain(d / MANIFEST))["files"]
        assert isinstance(files, dict) and all(isinstance(v, dict) and isinstance(v["bytes"], int)
                                               and isinstance(v["xxh3_64"], str) for v in files.values())
    except OSError as e:
        return f"{MANIFEST} cannot be read ({os_reason(e)})"
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"{MANIFEST} is garbled (not a table of file names to bytes and xxh3_64)"
    plain = next((n for n in files if not plain_name(n)), None)
    if plain is not None:
        return f"{MANIFEST} names {plain!r}, which is not a file of this unit"
    for f in sorted(d.iterdir()):
        if not is_plain_file(f):
            return f"{f.name} {NOT_PLAIN}"
        if f.name == MANIFEST or f.name == COMPLETE:
            continue
        if f.name not in files:
            return f"{f.name} is not in {MANIFEST}"
        size, digest = hash_file(f)
        if size != files[f.name]["bytes"]:
            return f"{f.name} is {size} bytes, {MANIFEST} says {files[f.name]['bytes']}"
        if digest != files[f.name]["xxh3_64"]:
            return f"{f.name} fails its checksum (xxh3_64)"
    return ""


def storage_outside(path: Path, storage_data: dict) -> str:
    """'' when every file that checkpoint `path`'s `.metadata` says holds a tensor's bytes (a `relative_path` of its
    storage_data) is a plain name that its manifest lists, else the line refusing it: `../x` or an absolute path
    would read any file into a tensor. A checkpoint saved before manifests (format 1) is held to plain names."""
    try:
        listed = json.loads(read_plain(path / MANIFEST))["files"]
    except FileNotFoundError:
        listed = None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{path / MANIFEST} is unreadable ({first_line(e)})"
    for info in storage_data.values():
        rel = getattr(info, "relative_path", None)
        if not plain_name(rel) or (listed is not None and rel not in listed):
            return (f"{path / DCP_METADATA} names {str(rel)[:200]!r} as where a tensor's bytes are, which is not a "
                    f"file that {MANIFEST} lists (refused: a checkpoint reads only its own files)")
    return ""


def _newest_verified(run_dir: Path, verify: bool) -> tuple[Path | None, list[str], bool]:
    """Collective: (the newest step_N under run_dir that verifies, 'step_N: reason' for each newer one,
    whether any of those is a complete checkpoint that failed verification). Rank 0's listing is
    broadcast so that every rank verifies the same candidates in the same order."""
    entries = _entries(run_dir) if comm.world_rank() == 0 else []
    steps = sorted({s for s, d in entries if not d.name.endswith(".tmp")}, reverse=True)  # step_N, or its aside copy
    if comm.distributed():
        n = torch.tensor([len(steps)], dtype=torch.int64, device=comm.collective_device())
        comm.broadcast(n, src=0)
        if n.item():
            t = torch.tensor(steps or [0] * int(n.item()), dtype=torch.int64, device=comm.collective_device())
            comm.broadcast(t, src=0)
            steps = t.tolist()
    root = checkpoint_dir(run_dir)
    unfinished = [(s, f"{d.name}: unfinished save") for s, d in entries if d.name.endswith(".tmp")]
    skipped, damaged = [], False
    for s in steps:
        path = root / f"step_{s}"
        reason = verify_checkpoint(path, checksums=verify)
        if reason:  # a re-save killed before its new copy was complete: the old copy it set aside (swap.py)
            aside = verify_checkpoint(aside_of(path), checksums=verify)
            if not aside:
                skipped.append((s, f"step_{s}: {reason} (a re-save cut short; the old copy was set aside)"))
                path, reason = aside_of(path), ""
            elif reason == _PHASE1[1] and aside != _PHASE1[1]:  # only the aside copy is there, and it fails
                reason = aside
        if not reason:
            lines = sorted(skipped + [u for u in unfinished if u[0] > s], reverse=True)
            return path, [line for _, line in lines], damaged
        skipped.append((s, f"step_{s}: {reason}"))
        damaged |= not reason.startswith(_NOT_A_CHECKPOINT)
    return None, [line for _, line in sorted(skipped + unfinished, reverse=True)], damaged


def resolve_resume(resume: str, run_dir: str | Path, verify: bool = True,
                   log: Callable[[str], None] | None = None) -> Path | None:
    """Collective when a process group exists (every rank calls it alike). train.resume -> a checkpoint
    that verifies: "" -> None; "auto" -> the newest in run_dir that verifies (None when there is none
    yet: a fresh start); a step dir -> itself; a run dir -> its newest that verifies. Newer checkpoints
    that were passed over are reported in one line through `log` (default: print on rank 0), e.g.
    "resume: skipped step_40: shard __1_0.distcp fails its checksum (xxh3_64; damaged); using step_30".
    Raises CheckpointError naming the file when the given step dir is damaged, and when complete
    checkpoints exist but none verifies (a run never silently restarts from step 0 over them)."""
    log = log or (lambda line: print(line, flush=True) if comm.world_rank() == 0 else None)
    if resume == "":
        return None
    p = Path(resume)
    if resume != "auto" and (STEP_DIR.fullmatch(p.name) or (p / COMPLETE).exists() or (p / DCP_METADATA).exists()):
        reason = verify_checkpoint(p, checksums=verify)
        if reason and not verify_checkpoint(aside_of(p), checksums=verify):  # a re-save cut short (swap.py)
            log(f"resume: {p.name}: {reason} (a re-save cut short); using {aside_of(p).name}, the old copy it set "
                "aside")
            return aside_of(p)
        if reason:
            raise CheckpointError(f"cannot resume from {p}: {reason} (choose another with --train.resume PATH, "
                                  "or --train.resume auto)")
        return p
    run_dir = Path(run_dir) if resume == "auto" else p
    if resume != "auto" and not checkpoint_dir(run_dir).is_dir():
        raise CheckpointError(f"train.resume={resume!r} is neither a checkpoint nor a run dir with checkpoints "
                              "(--train.resume auto|PATH)")
    path, skipped, damaged = _newest_verified(run_dir, verify)
    if path is None and (damaged or resume != "auto"):
        raise CheckpointError(f"no checkpoint under {checkpoint_dir(run_dir)} verifies"
                              + (f" ({'; '.join(skipped)})" if skipped else "")
                              + ": remove the damaged ones, resume from another with --train.resume PATH, "
                              "or start over with --run.overwrite true")
    if skipped:
        log(f"resume: skipped {'; '.join(skipped)}; " + (f"using {path.name}" if path else "none left: fresh start"))
    return path


# --- the disk: free space, and the one line of a write that failed or cannot fit ----------------------

def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the file system holding `path` (statvfs f_bavail)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def storage_line(run_dir: str | Path, what: str, removed: Path | None = None) -> str:
    """The one line of a write into a run dir that failed or cannot fit: `what`, the free space (this rank's
    view of the disk), the partial save `removed`, the newest good checkpoint and the way on."""
    root = checkpoint_dir(run_dir)
    try:
        free = f"{fmt_bytes(free_bytes(root))} free on {root}"
    except OSError as e:
        free = f"free space on {root} unknown ({os_reason(e)})"
    kept = latest_checkpoint(run_dir)
    removed = f"; removed the partial {removed.name}" if removed is not None else ""
    return (f"{what}; {free}{removed}; newest good checkpoint: {kept or 'none yet'} "
            f"(make room or choose another --run.dir, then continue with --train.resume auto)")
