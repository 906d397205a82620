"""Layout-independent, verified checkpoints through torch.distributed.checkpoint (DCP).

Every tensor is stored under a global key that does not depend on the (dp, pp, ep) layout:
  model.<param name>                  non-expert parameter (names already carry global layer indices)
  model.<param name>.<expert id>      one entry per global expert of an expert tensor [E_local, ...]
  optim.<param name>[.<expert id>].<state>   AdamW exp_avg / exp_avg_sq (split like the parameter)
  optim.<param name>.step             AdamW step (a scalar, the same for every expert of a tensor)
  rng.cpu.<rank>                      each rank's torch CPU RNG state (restored only into the same layout)
A rank writes only its pieces of each tensor (`GradSync.sharded_state`: the live tensors whole at zero 0 and
for ZeRO-1/2's params, this rank's slices of the optimizer state at zero 1/2 and of everything at zero 3), each
a DCP chunk at its offsets in the whole tensor, so the files and keys do not depend on the zero level and no
rank gathers what it does not hold. Replicas of a piece (same key, same offsets) are written once: DCP dedups
identical write items across ranks (`dedup_save_plans`). A rank reads back only the parts of each tensor it
holds *now*, straight into its live state: DCP reads by key and offsets, so any layout and zero level can read
a checkpoint written by any other, including those written whole before the pieces.

On disk (RUN_DIR/checkpoints/step_N/): DCP's `.metadata` + `__<rank>_*.distcp` shards, `config.toml`
(the resolved config), `state.json` (step, trainer extras such as the data position, saved layout),
`manifest.json` (every other file's size and xxh3-64 checksum) and `COMPLETE`. Atomicity: ranks write
`step_N.tmp/`, then rank 0 renames it and writes `COMPLETE`; a re-save of a step first sets the old copy aside and
deletes it only once the new one is complete (swap.py). Trust: nothing is loaded before every file
matches the manifest (manifest.py: checksums, verification, what to resume from), `.metadata` is unpickled
only through an allow-list (metadata.py: a checkpoint's bytes never run as code), and nothing non-finite is
ever saved. See docs/checkpoint.md and docs/security.md.
The keys live in keys.py; a snapshot's raw shards and their packing in packing.py.

Every decision that a rank could reach alone (a file it checked, a tensor it holds) is agreed by an
all-reduce before anyone acts on it, so a rank-local failure never leaves the others inside a collective.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner, DefaultSavePlanner,
                                                          create_default_local_load_plan)
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from ..config.config import Config, to_toml
from ..config.errors import CheckpointError, StorageError, first_line, os_reason
from ..config.hardware import fmt_bytes
from .manifest import (COMPLETE, DCP_METADATA, FORMAT_VERSION, MANIFEST, STATE_FILE, STEP_DIR, checkpoint_dir,
                       complete_steps, dir_bytes, free_bytes, hash_shards, latest_checkpoint, read_plain,
                       storage_line, storage_outside, verify_checkpoint)
from ..parallel.comm import collectives as comm
from ..parallel.dims import ParallelDims
from ..parallel.shard import token_axes
from .keys import Chunks, keyed_state, rng_key
from .metadata import UnsafeMetadataError, metadata_name, safe_load_metadata
from .packing import CheckpointReader
from .swap import ASIDE, fsync_dir, settle, swap_in


class NonFiniteStateError(CheckpointError):
    """save_checkpoint refused: some model or optimizer tensor holds NaN/inf. Nothing was written."""


# --- DCP's planners over this rank's pieces (keys.py) ------------------------------------------------

class _SaveChunks(DefaultSavePlanner):
    """DCP's planner, finding a key's box by its offsets (replicas of a box, same key and offsets, are written
    once: DCP's dedup of identical write items across ranks)."""

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return _own_storage(obj.box(index.offset)) if isinstance(obj, Chunks) else super().lookup_object(index)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` (contiguous) over a storage of exactly its bytes that aliases its own: DCP's writer copies a tensor
    whose storage is larger (an expert of a stacked tensor, a slice of ZeRO's flat state, FSDP's shard of its
    padded buffer) and keeps every tensor of a file until the file is written, so those copies added up to the
    rank's whole state (1.6x its steady state on MID). The live state outlives the save: the alias is safe."""
    if t.untyped_storage().nbytes() == t.nbytes or not t.is_contiguous() or t.device.type != "cpu":
        return t  # (on CUDA DCP copies every tensor to the host anyway)
    start = t.storage_offset() * t.element_size()
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage()[start:start + t.nbytes], 0, t.shape, t.stride())


class _LoadChunks(DefaultLoadPlanner):
    """DCP's planner reading straight into this rank's boxes (no staging copy of the state)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # the default set-up would turn our Chunks into None (it only knows tensors); the dict is flat already
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator, self.mappings = metadata, is_coordinator, {}

    def create_local_plan(self) -> LoadPlan:
        return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)

    def load_bytes(self, read_item: ReadItem, value) -> None:
        # DCP's default torch.loads the bytes with weights_only=False (code); nanoTitan never saves bytes entries
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is bytes, not a tensor: refused")

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.box(index.offset) if isinstance(obj, Chunks) else super().lookup_tensor(index)



# --- small helpers --------------------------------------------------------------------------------

@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it runs without a process group; in one process that is the intent."""
    with warnings.catch_warnings():
        if not comm.distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def layout_dict(dims: ParallelDims | None) -> dict:
    if dims is None:
        return {"dp": 1, "pp": 1, "ep": 1}
    return {"dp": dims.dp, "pp": dims.pp, "ep": dims.ep, **token_axes(dims)}


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:  # the bytes the manifest hashes, whatever the locale
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def small_files(cfg: Config, step: int, extra: dict, layout: dict, **more) -> dict[str, str]:
    """A checkpoint's config.toml and state.json (rank 0 writes them; the manifest covers them)."""
    return {"config.toml": to_toml(cfg), STATE_FILE: json.dumps({
        "format": FORMAT_VERSION, "step": step, "extra": extra, "layout": layout, "world_size": comm.world_size(),
        "optimizer": cfg.train.optimizer, "torch": torch.__version__, **more}, indent=1)}


def write_small_files(tmp: Path, small: dict[str, str | bytes], manifest: dict) -> None:
    """Write each small file and add its size and xxh3-64 to `manifest` (the shards' entries), then manifest.json
    itself: the list of every file that a checkpoint's verification reads."""
    for name, data in small.items():
        if isinstance(data, str):
            _write_text(tmp / name, data)
            data = data.encode()
        else:
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        manifest[name] = {"bytes": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)}
    _write_text(tmp / MANIFEST, json.dumps({"format": FORMAT_VERSION, "files": manifest}, indent=1))


# --- save -----------------------------------------------------------------------------------------

def _first_nonfinite(state: dict[str, torch.Tensor]) -> str:
    """'' when every floating tensor is finite, else the first offending key. One fused inf-norm per
    (device, dtype) group (NaN propagates through the max, inf is inf) and one host sync per group; the
    per-key scan runs only when something is wrong."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in state.values():
        if t.is_floating_point() and t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    if all(bool(torch.stack(torch._foreach_norm(ts, float("inf"))).isfinite().all()) for ts in groups.values()):
        return ""
    return next(k for k, t in state.items() if t.is_floating_point() and not bool(t.isfinite().all()))


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None, dims: ParallelDims | None, cfg: Config,
                    extra: dict | None = None, keep_last: int = 0, shard=None) -> Path:
    """Collective (every rank calls it): write RUN_DIR/checkpoints/step_<step>/ atomically, with a
    manifest of checksums, and prune to the newest `keep_last` complete checkpoints (0 keeps all).
    `shard` (the trainer's ModelShard) is needed at parallel.zero >= 1: each rank saves only the pieces it
    holds (`GradSync.sharded_state`) at their offsets in the whole tensors, so any zero level and layout can
    load it.
    `extra` is JSON-serialisable trainer state (e.g. {"samples_consumed": ...}); `load_checkpoint`
    returns it with "step" added. When this returns on any rank the checkpoint is complete on disk.
    Raises NonFiniteStateError on every rank, before writing anything, if any rank's model or optimizer
    state holds NaN/inf; StorageError on every rank if the save cannot fit (checked against the newest
    checkpoint's size before writing) or any rank fails to write (no space, quota, permission): the partial
    save is removed and the line names the newest good checkpoint. Returns the path."""
    try:  # fail on every rank alike, before any collective: every rank gets the same extra
        extra_json = json.dumps(dict(extra or {}), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint extra {extra!r} is not strict JSON: {e}") from None
    root = checkpoint_dir(run_dir)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    rank = comm.world_rank()
    t0 = time.perf_counter()

    # Nothing non-finite is ever written: a NaN checkpoint would be resumed into, and would rotate
    # the last good one out (issue 12). Agreed, so every rank raises and none waits in the save.
    state: dict = keyed_state(model, optimizer, shard)  # this rank's pieces: views of the live state, nothing gathered
    key = _first_nonfinite({k: t for k, c in state.items() for t in c.boxes.values()})
    bad = comm.any_rank(bool(key))
    if bad >= 0:
        kept = latest_checkpoint(run_dir)
        what = f"{key} holds NaN/inf on rank {rank}" if key else f"rank {bad} holds NaN/inf state (see its error)"
        raise NonFiniteStateError(f"refusing to save step {step}: {what}; nothing was written, the newest "
                                  f"checkpoint stays {kept or 'none'}")

    # A save that cannot fit is refused before it starts: the previous one's size is known (issue 27). Then a
    # tmp dir left by a crashed save of the same step must go before anyone writes into it.
    err = ""
    if rank == 0:
        err = _no_room(run_dir, step)
        try:
            settle(root)  # a re-save a kill cut short: its old copy back in place (swap.py)
            if not err and tmp.exists():
                shutil.rmtree(tmp)
            if not err:
                tmp.mkdir(parents=True)
        except OSError as e:
            err = storage_line(run_dir, f"saving step {step}: cannot create {tmp}: {os_reason(e)}")
    if err := comm.agree(err, f"saving step {step}"):
        raise StorageError(err)

    state[rng_key(rank)] = torch.get_rng_state()
    try:
        with _quiet_single_process():
            meta = dcp.save(state, storage_writer=FileSystemWriter(tmp), planner=_SaveChunks(),
                            no_dist=not comm.distributed())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP agrees failures itself: every rank raises
        # (DCP's CheckpointException is a BaseException: `except Exception` alone let torch's traceback through)
        if why := _write_failure(e):
            raise _failed_save(run_dir, step, f"writing {tmp} failed: {why}", tmp) from None
        raise CheckpointError(f"saving {tmp} failed: {first_line(_cause(e))}") from None
    # Only the files the metadata points at (a rank whose keys were all deduped may leave an empty one).
    shards = sorted({s.relative_path for s in meta.storage_data.values()})
    try:
        manifest = hash_shards(tmp, shards + [DCP_METADATA])  # collective: all shards and .metadata are written
    except CheckpointError as e:  # a shard that cannot be read back: lost to a full or failing disk
        raise _failed_save(run_dir, step, str(e), tmp) from None

    err = ""
    if rank == 0:
        try:
            small = small_files(cfg, step, json.loads(extra_json), layout_dict(dims),
                                save_s=round(time.perf_counter() - t0, 3))
            write_small_files(tmp, small, manifest)
            fsync_dir(tmp)
            swap_in(tmp, final, f"step {step}\n")  # a re-save sets the old step_N aside until the new one is COMPLETE
            _prune(run_dir, keep_last, step)
        except OSError as e:
            err = f"writing {Path(e.filename or tmp)} failed: {os_reason(e)}"
    if err := comm.agree(err, f"saving step {step}"):  # nobody moves on (or exits) before the checkpoint is complete
        raise _failed_save(run_dir, step, err, tmp)
    return final


# --- save failures: one line with what failed, where, the free space and what is kept --------------------

# torch.save's zip writer reports a full disk as "[enforce fail at inline_container.cc] unexpected pos ..." or
# "PytorchStreamWriter failed writing file ...", without an errno.
_ZIP_WRITE_FAILED = ("inline_container", "PytorchStreamWriter failed")


def _cause(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (which holds one per failed rank)."""
    if isinstance(e, CheckpointException) and e.failures:
        return next(iter(e.failures.values()))[0]
    return e


def _write_failure(e: BaseException) -> str:
    """Why a write failed, when `e` (or what caused it) is one: lack of space, quota, permission, a read-only
    or failing file system; '' for anything else (a bug, not the disk)."""
    exc = _cause(e)
    while exc is not None:
        if isinstance(exc, OSError):
            return os_reason(exc)
        if isinstance(exc, RuntimeError) and any(m in str(exc) for m in _ZIP_WRITE_FAILED):
            return f"{first_line(exc)} (torch's writer could not grow the file: disk full?)"
        exc = exc.__cause__ or exc.__context__
    return ""


def _no_room(run_dir: str | Path, step: int) -> str:
    """'' when the file system has room for another checkpoint as large as the newest one, else the line
    refusing the save (nothing written). The first save has nothing to go by: a failure then is caught as
    it happens."""
    prev = latest_checkpoint(run_dir)
    if prev is None:
        return ""
    try:
        need, free = dir_bytes(prev), free_bytes(checkpoint_dir(run_dir))
    except OSError:
        return ""  # cannot tell: let the write itself decide
    if free >= need:
        return ""
    return storage_line(run_dir, f"saving step {step}: refused before writing: {prev.name} took {fmt_bytes(need)} "
                                 "and there is less free; nothing was written")


def _failed_save(run_dir: str | Path, step: int, what: str, tmp: Path) -> StorageError:
    """Collective, after every rank saw the save fail: rank 0 removes the partial save (the tmp dir, and the
    step dir if the rename happened but COMPLETE was not written), every rank waits for that, and each gets
    the same one-line StorageError. What verified before is untouched."""
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    if comm.world_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            settle(final.parent)  # an old copy set aside by this re-save goes back in place
        if final.is_dir() and not (final / COMPLETE).exists():
            shutil.rmtree(final, ignore_errors=True)
    comm.barrier()
    return StorageError(storage_line(run_dir, f"saving step {step}: {what}", tmp))


def _prune(run_dir: str | Path, keep_last: int, step: int) -> None:
    """After saving `step`: keep it and the newest `keep_last - 1` older complete checkpoints (0 keeps
    all); drop leftovers of crashed saves, and checkpoints *newer* than `step`. Those belong to a timeline
    this run left when it resumed from an older step (they failed verification, or the user chose an older
    one); kept, `resume auto` would jump back to them. The checkpoint just written, verified as it was
    read back for its manifest, is never removed."""
    root = checkpoint_dir(run_dir)
    complete = complete_steps(run_dir)
    newer = [d for s, d in complete if s > step]
    older = [d for s, d in complete if s <= step]
    doomed = newer + (older[:-keep_last] if keep_last > 0 else [])
    for d in root.iterdir():
        if d.name.endswith((".tmp", ASIDE)) or (STEP_DIR.fullmatch(d.name) and not (d / COMPLETE).exists()):
            doomed.append(d)  # one job owns a run dir (rundir.py) and its save has finished: these are stale
    if newer:
        print(f"removed {', '.join(d.name for d in newer)}: newer than step {step}, from a timeline this run "
              "left when it resumed from an older checkpoint", flush=True)
    for d in doomed:
        if d != root / f"step_{step}":
            shutil.rmtree(d, ignore_errors=True)


# --- load -----------------------------------------------------------------------------------------

def _check_fits(path: Path, want: dict[str, torch.Tensor], meta: dict) -> str:
    """'' if every key this rank needs is in the checkpoint with the same shape, else one line."""
    hint = f"compare {path / 'config.toml'} with this run's config"
    for key, t in want.items():
        if key not in meta:
            return f"checkpoint {path} has no tensor {key!r} that this model needs ({hint})"
        if not isinstance(meta[key], TensorStorageMetadata):  # DCP would torch.load a bytes entry: never saved here
            return f"checkpoint {path} stores {key!r} as bytes, not as a tensor: not a checkpoint of nanoTitan's"
        saved = list(meta[key].size)
        if saved != list(t.shape):
            return (f"checkpoint tensor {key!r} has shape {saved} but this model's is {list(t.shape)} "
                    f"({hint})")
    return ""


def _check_optimizer(path: Path, optimizer: torch.optim.Optimizer | None, info: dict) -> str:
    """'' if the checkpoint's optimizer state is this run's kind (the optimizer declares it, optim/adamw.py: each
    kind has its own state), else one line. A checkpoint from before the field holds AdamW's."""
    saved = info.get("optimizer", "adamw")
    if optimizer is None or saved == optimizer.kind:
        return ""
    want = optimizer.kind
    return (f"checkpoint {path} holds {saved} optimizer state but train.optimizer={want} (--train.optimizer {saved}, "
            f"or --train.reset_optimizer true to keep the weights and start {want}'s state fresh)")


def _check_counts(path: Path, model: torch.nn.Module, meta: dict) -> str:
    """Global check every rank can do alone: the checkpoint has no more layers/experts than the model."""
    layers = {int(m.group(1)) for k in meta if (m := re.match(r"model\.layers\.([0-9]+)\.", k))}
    expert_key = r"model\.layers\.[0-9]+\.moe\.experts\.W_gate\.([0-9]+)"
    experts = {int(m.group(1)) for k in meta if (m := re.fullmatch(expert_key, k))}
    cfg = model.cfg
    if layers and max(layers) + 1 != cfg.n_layers + cfg.mtp_layers:  # the MTP blocks follow the decoder's
        mtp = f" + model.mtp_layers={cfg.mtp_layers}" if cfg.mtp_layers else ""
        return (f"checkpoint {path} has {max(layers) + 1} layers but model.n_layers={cfg.n_layers}{mtp} "
                f"(--model.n_layers {max(layers) + 1 - cfg.mtp_layers}, MTP blocks counted in)")
    if experts and max(experts) + 1 != cfg.num_experts:
        return (f"checkpoint {path} has {max(experts) + 1} experts but model.num_experts={cfg.num_experts} "
                f"(--model.num_experts {max(experts) + 1})")
    return ""


def _read_small(path: Path) -> tuple[dict | None, object, str]:
    """(state.json, DCP's Metadata, error) of a checkpoint: one line naming the file, never a traceback. The load
    hands DCP this Metadata, the one checked here (storage_outside), and never reads the file again."""
    try:
        info = json.loads(read_plain(path / STATE_FILE))
        int(info["step"]), info["extra"], info["layout"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, None, f"checkpoint {path / STATE_FILE} is unreadable ({first_line(e)})"
    try:  # through the allow-list (metadata.py): a .metadata that names anything else is refused, never called
        md = safe_load_metadata(read_plain(path / DCP_METADATA), metadata_name(path))
    except UnsafeMetadataError as e:
        return None, None, str(e)
    except (OSError, CheckpointError) as e:
        return None, None, f"checkpoint {path / DCP_METADATA} is unreadable ({first_line(e)})"
    if err := storage_outside(path, md.storage_data):  # its tensors' bytes come from its own listed files only
        return None, None, err
    return info, md, ""


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    dims: ParallelDims | None, verify: bool = True, shard=None) -> dict:
    """Collective: load a checkpoint saved in any layout into this rank's current shard (its layers,
    its expert ids) and its optimizer (state created if it has not stepped). Returns the saved
    `extra` dict with "step" added. Before reading any tensor, on every rank alike: the checkpoint is
    verified against its manifest (`verify=False`: sizes only) and checked to fit the model; either
    failure raises CheckpointError (exit 3, errors.py) with one line naming the file or the tensor.
    `shard` (the trainer's ModelShard) is needed at parallel.zero >= 1: each rank reads only the parts of each
    tensor it holds (`GradSync.sharded_state`), straight into its live state."""
    path = Path(path)
    reason = verify_checkpoint(path, checksums=verify)
    if reason:
        raise CheckpointError(f"cannot load checkpoint {path}: {reason}")
    live: dict = keyed_state(model, optimizer, shard)

    # Shape/key checks before any read: a mismatch seen by one rank (say, the stage owning the
    # head) must stop every rank, or the others would wait in dcp.load until the timeout.
    info, checked, err = _read_small(path)
    meta = checked.state_dict_metadata if checked is not None else None
    err = (err or _check_optimizer(path, optimizer, info) or _check_fits(path, live, meta)
           or _check_counts(path, model, meta))
    bad = comm.any_rank(bool(err))
    if bad >= 0:
        raise CheckpointError(err or f"checkpoint {path} does not fit this model (see rank {bad}'s error)")

    # DCP reads each stored chunk that overlaps one of this rank's boxes (one at a time) and copy_s the overlap
    # into the live tensor: CUDA params and Adam's `step` (CPU float, or float32 on device when fused) included.
    rank = comm.world_rank()
    if info["layout"] == layout_dict(dims) and rng_key(rank) in meta:  # a rank's stream means nothing in another layout
        live[rng_key(rank)] = rng = torch.empty_like(torch.get_rng_state())
    try:
        with _quiet_single_process():
            dcp.load(live, storage_reader=CheckpointReader(path, metadata=checked), planner=_LoadChunks(),
                     no_dist=not comm.distributed())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP agrees failures itself: every rank raises
        raise CheckpointError(f"reading checkpoint {path} failed: {first_line(_cause(e))}") from None
    if rng_key(rank) in live:
        torch.set_rng_state(rng)
    comm.barrier()
    return {**info["extra"], "step": int(info["step"])}
