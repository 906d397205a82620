"""Layout-independent checkpoints through torch.distributed.checkpoint (DCP).

Every tensor is stored under a global key that does not depend on the (dp, pp, ep) layout:
  model.<param name>                  non-expert parameter (names already carry global layer indices)
  model.<param name>.<expert id>      one entry per global expert of an expert tensor [E_local, ...]
  optim.<param name>[.<expert id>].<state>   AdamW exp_avg / exp_avg_sq (split like the parameter)
  optim.<param name>.step             AdamW step (a scalar, the same for every expert of a tensor)
  rng.cpu.<rank>                      each rank's torch CPU RNG state (restored only into the same layout)
A rank saves what it owns; replicated keys (same key on several DP/EP replicas) are written once
because DCP's planner dedups identical keys across ranks (`dedup_save_plans`). A rank loads what it
owns *now*: DCP reads by key, so any layout can read a checkpoint written by any other.

On disk (RUN_DIR/checkpoints/step_N/): DCP's `.metadata` + `__<rank>_*.distcp` shards, `config.toml`
(the resolved config), `state.json` (step, trainer extras such as the data position, saved layout)
and `COMPLETE`. Atomicity: ranks write `step_N.tmp/`, then rank 0 renames it and writes `COMPLETE`;
`latest_checkpoint` only trusts directories that have it. See docs/checkpoint.md.
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
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from .config import Config, to_toml
from .model.transformer import is_expert_param
from .parallel import comm
from .parallel.dims import ParallelDims

COMPLETE = "COMPLETE"
STATE_FILE = "state.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


# --- keyed state: what this rank owns, under global names ---------------------------------------

def _ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create zero Adam(W) state for params that have none yet, exactly as Adam's lazy init would
    (zero moments, step 0; `step` is a float32 tensor on the param's device when fused/capturable,
    else on CPU), so an optimizer that has not stepped can be saved or loaded into."""
    for group in optimizer.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            st = optimizer.state[p]
            if st:
                continue
            st["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if on_device
                          else torch.tensor(0.0, dtype=torch.float64 if torch.get_default_dtype() == torch.float64
                                            else torch.float32))
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def keyed_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """{global key: tensor view} for everything this rank owns (params, then optimizer state).

    Expert tensors are split into per-expert views `t[l]` keyed by global id expert_start + l.
    The views alias the live tensors (used for saving; loading goes through staging buffers).
    """
    expert_start = model.spec.expert_start
    out: dict[str, torch.Tensor] = {}

    def put(prefix: str, name: str, t: torch.Tensor, suffix: str = "") -> None:
        t = t.detach()
        if is_expert_param(name) and t.dim() > 0:
            for l in range(t.shape[0]):
                out[f"{prefix}.{name}.{expert_start + l}{suffix}"] = t[l]
        else:
            out[f"{prefix}.{name}{suffix}"] = t

    for name, t in model.state_dict(keep_vars=True).items():
        put("model", name, t)
    if optimizer is not None:
        _ensure_adam_state(optimizer)
        name_of = {id(p): n for n, p in model.named_parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                assert id(p) in name_of, "optimizer holds a tensor that is not a parameter of the model"
                for k, v in optimizer.state[p].items():
                    if torch.is_tensor(v):
                        put("optim", name_of[id(p)], v, f".{k}")
    return out


def _rng_key(rank: int) -> str:
    return f"rng.cpu.{rank}"


# --- small helpers --------------------------------------------------------------------------------

@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it runs without a process group; in one process that is the intent."""
    with warnings.catch_warnings():
        if not _dist():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _barrier() -> None:
    """Barrier over the default group as a one-element all-reduce (works on gloo, and on NCCL with a
    CUDA tensor; `dist.barrier` on NCCL guesses a device), accounted under the "other" axis."""
    if not _dist():
        return
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    comm.all_reduce(torch.zeros(1, device=dev), axis="other")


def _any_rank(flag: bool) -> int:
    """Lowest rank for which `flag` is true (-1 when none); collective over the default group."""
    if not _dist():
        return 0 if flag else -1
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.zeros(dist.get_world_size(), device=dev)
    t[dist.get_rank()] = float(flag)
    comm.all_reduce(t, axis="other")
    bad = t.nonzero().flatten().tolist()
    return int(bad[0]) if bad else -1


def _layout(dims: ParallelDims | None) -> dict:
    return {"dp": dims.dp, "pp": dims.pp, "ep": dims.ep} if dims else {"dp": 1, "pp": 1, "ep": 1}


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _complete_steps(run_dir: str | Path) -> list[tuple[int, Path]]:
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and (d / COMPLETE).is_file():
            out.append((int(m.group(1)), d))
    return sorted(out)


# --- save -----------------------------------------------------------------------------------------

def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None, dims: ParallelDims | None, cfg: Config,
                    extra: dict | None = None, keep_last: int = 0) -> Path:
    """Collective (every rank calls it): write RUN_DIR/checkpoints/step_<step>/ atomically and prune
    to the newest `keep_last` complete checkpoints (0 keeps all). `extra` is JSON-serialisable trainer
    state (e.g. {"samples_consumed": ...}); `load_checkpoint` returns it with "step" added. When this
    returns on any rank the checkpoint is complete on disk. Returns the checkpoint path."""
    extra = dict(extra or {})
    extra_json = json.dumps(extra)  # fail on every rank, before any collective, if not serialisable
    root = checkpoint_dir(run_dir)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    rank = _rank()
    layout = _layout(dims)
    t0 = time.perf_counter()

    # A tmp dir left by a crashed save of the same step must go before anyone writes into it.
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()

    state = keyed_tensors(model, optimizer)
    state[_rng_key(rank)] = torch.get_rng_state()
    with _quiet_single_process():
        dcp.save(state, storage_writer=FileSystemWriter(tmp), no_dist=not _dist())
    _barrier()  # every rank's shards and rank 0's .metadata are written

    if rank == 0:
        _write_text(tmp / "config.toml", to_toml(cfg))
        _write_text(tmp / STATE_FILE, json.dumps({
            "format": FORMAT_VERSION, "step": step, "extra": json.loads(extra_json), "layout": layout,
            "world_size": dist.get_world_size() if _dist() else 1, "torch": torch.__version__,
            "save_s": round(time.perf_counter() - t0, 3)}, indent=1))
        _fsync_dir(tmp)
        if final.exists():  # re-save of the same step (e.g. after a resume): the new one wins
            shutil.rmtree(final)
        os.replace(tmp, final)  # atomic on POSIX
        _write_text(final / COMPLETE, f"step {step}\n")
        _fsync_dir(final)
        _fsync_dir(root)
        _prune(run_dir, keep_last)
    _barrier()  # nobody moves on (or exits) before the checkpoint is complete
    return final


def _prune(run_dir: str | Path, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; drop leftovers of crashed saves."""
    root = checkpoint_dir(run_dir)
    complete = _complete_steps(run_dir)
    doomed = [d for _, d in complete[:-keep_last]] if keep_last > 0 else []
    for d in root.iterdir():
        if d.name.endswith(".tmp") or (_STEP_DIR.match(d.name) and not (d / COMPLETE).exists()):
            doomed.append(d)  # only one job writes a run dir and its save has finished: these are stale
    for d in doomed:
        shutil.rmtree(d, ignore_errors=True)


# --- find -----------------------------------------------------------------------------------------

def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run (highest step with a COMPLETE marker), or None."""
    steps = _complete_steps(run_dir)
    return steps[-1][1] if steps else None


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """train.resume -> checkpoint path: "" -> None; "auto" -> latest in run_dir (None when there is
    none yet: a fresh start); a step dir -> itself; a run dir -> its latest. Raises ValueError otherwise."""
    if resume == "":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    p = Path(resume)
    if (p / COMPLETE).is_file():
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        raise ValueError(f"train.resume={resume!r} is neither a complete checkpoint (no {COMPLETE} marker) "
                         f"nor a run dir with one (--train.resume auto|PATH)")
    return latest


# --- load -----------------------------------------------------------------------------------------

def _check_fits(path: Path, want: dict[str, torch.Tensor], meta: dict) -> str:
    """'' if every key this rank needs is in the checkpoint with the same shape, else one line."""
    hint = f"compare {path / 'config.toml'} with this run's config"
    for key, t in want.items():
        if key not in meta:
            return f"checkpoint {path} has no tensor {key!r} that this model needs ({hint})"
        saved = list(meta[key].size)
        if saved != list(t.shape):
            return (f"checkpoint tensor {key!r} has shape {saved} but this model's is {list(t.shape)} "
                    f"({hint})")
    return ""


def _check_counts(path: Path, model: torch.nn.Module, meta: dict) -> str:
    """Global check every rank can do alone: the checkpoint has no more layers/experts than the model."""
    layers = {int(m.group(1)) for k in meta if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    experts = {int(m.group(1)) for k in meta if (m := re.match(r"model\.layers\.\d+\.moe\.experts\.W_gate\.(\d+)$", k))}
    cfg = model.cfg
    if layers and max(layers) + 1 != cfg.n_layers:
        return (f"checkpoint {path} has {max(layers) + 1} layers but model.n_layers={cfg.n_layers} "
                f"(--model.n_layers {max(layers) + 1})")
    if experts and max(experts) + 1 != cfg.num_experts:
        return (f"checkpoint {path} has {max(experts) + 1} experts but model.num_experts={cfg.num_experts} "
                f"(--model.num_experts {max(experts) + 1})")
    return ""


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    dims: ParallelDims | None) -> dict:
    """Collective: load a checkpoint saved in any layout into this rank's current shard (its layers,
    its expert ids) and its optimizer (state created if it has not stepped). Returns the saved
    `extra` dict with "step" added. A checkpoint that does not fit the model raises ValueError on
    every rank, naming the tensor, before anything is read."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no {COMPLETE} marker; --train.resume)")
    info = json.loads((path / STATE_FILE).read_text())
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    live = keyed_tensors(model, optimizer)

    # Shape/key checks before any read: a mismatch seen by one rank (say, the stage owning the
    # head) must stop every rank, or the others would wait in dcp.load until the timeout.
    err = _check_fits(path, live, meta) or _check_counts(path, model, meta)
    bad = _any_rank(bool(err))
    if bad >= 0:
        raise ValueError(err or f"checkpoint {path} does not fit this model (see rank {bad}'s error)")

    # Stage through fresh buffers in the checkpoint's dtype on CPU, then copy_ into the live
    # tensors: handles CUDA params and Adam's `step` (CPU float, or float32 on device when fused).
    stage = {k: torch.empty(t.shape, dtype=meta[k].properties.dtype) for k, t in live.items()}
    rank = _rank()
    layout = _layout(dims)
    if info["layout"] == layout and _rng_key(rank) in meta:  # a rank's stream means nothing in another layout
        stage[_rng_key(rank)] = torch.empty_like(torch.get_rng_state())
    with _quiet_single_process():
        dcp.load(stage, storage_reader=FileSystemReader(path), no_dist=not _dist())

    with torch.no_grad():
        for k, t in live.items():
            t.copy_(stage[k])
    if _rng_key(rank) in stage:
        torch.set_rng_state(stage[_rng_key(rank)])
    _barrier()
    return {**info["extra"], "step": int(info["step"])}
