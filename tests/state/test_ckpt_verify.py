"""A damaged checkpoint never loads, nothing non-finite is ever saved, and one job owns a run dir.

Contracts (issue 12, items 2 and 3, and the checkpoint half of item 1):
- every file of a checkpoint is in its manifest with size and xxh3-64; load refuses a damaged one in one
  line naming the file, on every rank alike (only the rank that checks a shard sees its damage);
- `resume auto` takes the newest checkpoint that verifies and says in one line which newer ones it
  skipped and why; `resume PATH` on a damaged one raises CheckpointError naming the file;
- `save_checkpoint` refuses NaN/inf state on every rank before writing anything, and pruning keeps the
  newest good checkpoint;
- RunDirLock refuses a second live job naming it, takes over a dead holder's lock saying so;
  check_fresh refuses a fresh run over old checkpoints unless resume or overwrite.

Cost: one 2-rank launch (~8 s on 2 idle cores) plus in-process checks (~2 s).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanotitan.state import checkpoint as ckpt

from nanotitan.state import manifest
from nanotitan.run import rundir
from tests.helpers.specs import build_shard_spec
from nanotitan.parallel.dims import ParallelDims
from tests.helpers.mp import run_ranks
from tests.helpers.checkpoint import SAVE_KS, build, perturb, tiny_cfg
from tests.helpers.whole_state import keyed_tensors

LAYOUT = (1, 1, 2)  # EP=2: each rank writes its own experts, so each shard is checked by one rank only


def _ranks(rank, world, tmp, nan_key):
    """One launch for everything multi-rank (start-up is most of the cost):
    1. save steps 20, 30, 40; put NaN into one tensor of rank 1 and try step 50 with keep_last=1;
    2. rank 0 makes damaged copies of the run (step_40 damaged, step_30 intact), barrier;
    3. on each copy: resume PATH (step_40) and resume auto; load what auto chose in the first copy only
       (the loads are the same); then load_checkpoint on a damaged path directly.
    Returns (refusal line, state at step 40, [(status, name or error, extra, log lines)], fallback state,
    direct-load error)."""
    run = Path(tmp) / "run"
    dims = ParallelDims(*LAYOUT, rank).build_groups()
    cfg = tiny_cfg(LAYOUT)
    model, opt = build(cfg, build_shard_spec(cfg, dims.pp_rank, dims.ep_rank))
    perturb(model, opt, SAVE_KS)
    for step in (20, 30, 40):
        ckpt.save_checkpoint(run, step, model, opt, dims, cfg, {"samples_consumed": step}, keep_last=0)
    saved = {k: v.clone() for k, v in keyed_tensors(model, opt).items()}
    if rank == 1:
        keyed_tensors(model, opt)[nan_key].view(-1)[3] = float("nan")
    try:
        ckpt.save_checkpoint(run, 50, model, opt, dims, cfg, {"samples_consumed": 50}, keep_last=1)
        refusal = ""
    except ckpt.NonFiniteStateError as e:
        refusal = str(e)

    if rank == 0:
        _make_damaged_copies(run, Path(tmp))
    torch.distributed.barrier()
    results, fallback = [], None
    for name in [*_damages(), "both"]:
        copy = Path(tmp) / name
        for where in ([str(copy / "checkpoints" / "step_40")] if name != "both" else []) + ["auto"]:
            lines = []
            try:
                path = manifest.resolve_resume(where, copy, log=lines.append)
                extra = None
                if fallback is None:
                    model, opt = build(cfg, build_shard_spec(cfg, dims.pp_rank, dims.ep_rank))
                    extra = ckpt.load_checkpoint(path, model, opt, dims)
                    fallback = {k: v.clone() for k, v in keyed_tensors(model, opt).items()}
                results.append(("ok", path.name, extra, lines))
            except ckpt.CheckpointError as e:
                results.append(("error", str(e), None, lines))
    try:  # load_checkpoint itself (no resolve_resume first) refuses a damaged checkpoint as well
        ckpt.load_checkpoint(Path(tmp) / "overwrite4k" / "checkpoints" / "step_40", model, opt, dims)
        direct = ""
    except ckpt.CheckpointError as e:
        direct = str(e)
    return refusal, saved, results, fallback, direct


def _overwrite_mid(path: Path, n: int = 4096) -> None:
    size = path.stat().st_size
    assert size > 2 * n, size
    with open(path, "r+b") as f:
        f.seek(size // 2 - n // 2)
        f.write(os.urandom(n))


def _damages():
    """name -> (what to do to step_40, what the error/skip line must name)."""
    def truncate(p):
        os.truncate(p, p.stat().st_size // 2)

    return {
        "overwrite4k": ("__1_0.distcp", _overwrite_mid, "shard __1_0.distcp fails its checksum"),
        "truncated": ("__0_0.distcp", truncate, "shard __0_0.distcp is "),
        "emptied": ("__1_0.distcp", lambda p: p.write_bytes(b""), "shard __1_0.distcp is 0 bytes"),
        "deleted": ("__0_0.distcp", Path.unlink, "shard __0_0.distcp is missing"),
        "no_metadata": (".metadata", Path.unlink, "file .metadata is missing"),
        "garbled_metadata": (".metadata", lambda p: p.write_bytes(b"\x80garbage" * 40), "file .metadata is "),
        "no_state": ("state.json", Path.unlink, "file state.json is missing"),
        "garbled_state": ("state.json", lambda p: p.write_text("{not json" + " " * (p.stat().st_size - 9)),
                          "file state.json fails its checksum"),
        "no_complete": ("COMPLETE", Path.unlink, "step_40: incomplete (no COMPLETE marker"),
        "garbled_manifest": ("manifest.json", lambda p: p.write_text("{"), "manifest.json is garbled"),
    }


def _make_damaged_copies(run: Path, tmp: Path) -> None:
    """tmp/<damage>/checkpoints/{step_30, step_40 damaged}; tmp/both: step_30 damaged as well."""
    for name, (target, damage, _) in _damages().items():
        for step in (30, 40):
            shutil.copytree(manifest.checkpoint_dir(run) / f"step_{step}", tmp / name / "checkpoints" / f"step_{step}")
        damage(tmp / name / "checkpoints" / "step_40" / target)
    shutil.copytree(tmp / "overwrite4k", tmp / "both")
    _overwrite_mid(tmp / "both" / "checkpoints" / "step_30" / "__0_0.distcp")


NAN_KEY = "optim.layers.1.moe.experts.W_gate.3.exp_avg_sq"  # expert 3 lives on rank 1 (EP=2 of 4)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckv")
    return tmp, run_ranks(_ranks, 2, (str(tmp), NAN_KEY), timeout=120)


def test_nonfinite_save_refused_on_every_rank(launched):
    """NaN in one rank's optimizer state: both ranks refuse step 50 before writing; step_40 and older stay."""
    tmp, ((line0, *_), (line1, *_)) = launched
    assert f"refusing to save step 50: {NAN_KEY} holds NaN/inf on rank 1" in line1
    assert "refusing to save step 50: rank 1 holds NaN/inf state" in line0
    for line in (line0, line1):
        assert "nothing was written" in line and line.endswith("step_40") and "\n" not in line
    root = manifest.checkpoint_dir(tmp / "run")
    assert sorted(p.name for p in root.iterdir()) == ["step_20", "step_30", "step_40"]
    files = json.loads((root / "step_40" / manifest.MANIFEST).read_text())["files"]
    assert set(files) == {".metadata", "__0_0.distcp", "__1_0.distcp", "config.toml", "state.json"}
    for name, entry in files.items():
        assert (root / "step_40" / name).stat().st_size == entry["bytes"]
        assert manifest.hash_file(root / "step_40" / name)[1] == entry["xxh3_64"]


def test_damaged_checkpoints_are_named_and_skipped(launched):
    """Each damage to step_40: `resume PATH` fails naming the file, `resume auto` falls back to step_30
    with one line saying why, on both ranks alike; the fallback loads exactly the saved state."""
    _, per_rank = launched
    (_, saved0, r0, fallback0, direct0), (_, saved1, r1, fallback1, direct1) = per_rank
    assert [c[:3] for c in r0] == [c[:3] for c in r1]  # the same decisions, in the same words, on both ranks
    for i, (target, _, needle) in enumerate(_damages().values()):
        by_path, by_auto = r0[2 * i], r0[2 * i + 1]
        assert by_path[0] == "error" and needle in by_path[1] and "\n" not in by_path[1], (needle, by_path[1])
        assert by_path[1].startswith("cannot resume from ") and "step_40" in by_path[1]
        status, name, _, lines = by_auto
        assert (status, name) == ("ok", "step_30"), by_auto
        assert len(lines) == 1 and needle in lines[0] and lines[0].endswith("using step_30"), lines
        assert lines[0].startswith("resume: skipped step_40: ")
    # the fallback's state equals what the saving ranks held (step 30 == step 40: no update in between)
    assert r0[1][2] == {"samples_consumed": 30, "step": 30}
    for saved, fallback in ((saved0, fallback0), (saved1, fallback1)):
        assert fallback.keys() == saved.keys() and all(torch.equal(fallback[k], saved[k]) for k in saved)
    status, line, _, _ = r0[-1]
    assert status == "error" and "no checkpoint under" in line and "step_40: shard __1_0.distcp fails" in line
    assert "step_30: shard __0_0.distcp fails its checksum" in line
    assert direct0 == direct1 and direct0.startswith("cannot load checkpoint ")
    assert "__1_0.distcp fails its checksum" in direct0


def test_single_process_verification_and_pruning(launched, tmp_path):
    """Without a process group one process checks every file; keep_last never drops the newest good one,
    and a checkpoint newer than the one just saved (a left timeline) goes."""
    copy = tmp_path / "run"
    shutil.copytree(launched[0] / "run", copy)
    root = manifest.checkpoint_dir(copy)
    assert manifest.verify_checkpoint(root / "step_40") == ""
    _overwrite_mid(root / "step_40" / "__1_0.distcp")
    assert manifest.verify_checkpoint(root / "step_40") == "shard __1_0.distcp fails its checksum (xxh3_64; damaged)"
    assert manifest.verify_checkpoint(root / "step_40", checksums=False) == ""  # same size: only the checksum sees it
    (root / "step_50.tmp").mkdir()
    (root / "step_45").mkdir()  # no COMPLETE
    lines = []
    assert manifest.resolve_resume("auto", copy, log=lines.append) == root / "step_30"
    assert lines == [("resume: skipped step_50.tmp: unfinished save; step_45: incomplete (no COMPLETE marker: its "
                      "save did not finish); step_40: shard __1_0.distcp fails its checksum (xxh3_64; damaged); "
                      "using step_30")]
    with pytest.raises(ckpt.CheckpointError, match=r"cannot resume from .*step_45: incomplete"):
        manifest.resolve_resume(str(root / "step_45"), copy)
    with pytest.raises(ckpt.CheckpointError, match="neither a checkpoint nor a run dir"):
        manifest.resolve_resume(str(tmp_path), copy)
    # pre-manifest checkpoints load only with verification off
    (root / "step_30" / manifest.MANIFEST).unlink()
    assert "manifest.json is missing" in manifest.verify_checkpoint(root / "step_30")
    assert manifest.verify_checkpoint(root / "step_30", checksums=False) == ""

    # Resumed from step 20 (say 30 and 40 were judged damaged): saving 25 with keep_last=2 keeps 20 and 25,
    # and drops 30/40, which belong to the timeline the run left, and the unfinished dirs.
    cfg = tiny_cfg((1, 1, 1))
    model, opt = build(cfg, build_shard_spec(cfg, 0, 0))
    ckpt.load_checkpoint(root / "step_20", model, opt, None)
    ckpt.save_checkpoint(copy, 25, model, opt, None, cfg, {"samples_consumed": 25}, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_20", "step_25"]
    assert manifest.resolve_resume("auto", copy) == root / "step_25"
    # inf (not only NaN) in a parameter: refused in one process too, and nothing changes on disk
    with torch.no_grad():
        model.head.weight[0, 0] = float("inf")
    with pytest.raises(ckpt.NonFiniteStateError, match="refusing to save step 26: model.head.weight holds NaN/inf"):
        ckpt.save_checkpoint(copy, 26, model, opt, None, cfg, {}, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_20", "step_25"]


# --- the run dir ------------------------------------------------------------------------------------

HOLD = ("import sys, time; from nanotitan.run.rundir import RunDirLock; "
        "l = RunDirLock(sys.argv[1]); l.acquire(); print('held', flush=True); time.sleep(60)")


def test_lock_refuses_live_holder_and_takes_over_dead_one(tmp_path):
    """A second job into a held run dir refuses naming the holder; once the holder is SIGKILLed (no
    cleanup), the next job takes the lock over with a line saying so, and releases it at the end."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(rundir.RunDirError) as e:
            rundir.RunDirLock(tmp_path).acquire()
        msg = str(e.value)
        assert f"run dir {tmp_path} is in use by pid {holder.pid} on " in msg and "--run.dir" in msg
        assert "\n" not in msg
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with rundir.RunDirLock(tmp_path) as line:
        assert f"took over the lock of {tmp_path} from pid {holder.pid}" in line and "a process that is gone" in line
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    assert not (tmp_path / ".lock").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(rundir.RunDirError, match=r"run.dir=.*/file/run cannot be created: Not a directory"):
        rundir.RunDirLock(tmp_path / "file" / "run").acquire()


def test_lock_reused_pid_other_host_and_same_job(tmp_path, monkeypatch):
    """A live PID whose start time differs is a reused PID (stale); a lock from another host cannot be
    probed (refuse); a lock left by an earlier attempt of the same torchrun job is taken over."""
    lock = rundir.RunDirLock(tmp_path)
    me = dict(lock.info)
    (tmp_path / ".lock").write_text(json.dumps({**me, "proc_start": (me["proc_start"] or 0) + 1, "job": ""}))
    assert "a process that is gone" in rundir.RunDirLock(tmp_path).acquire()
    (tmp_path / ".lock").write_text(json.dumps({**me, "host": "elsewhere", "job": "j1"}))
    with pytest.raises(rundir.RunDirError, match="on elsewhere .*another host: cannot tell"):
        rundir.RunDirLock(tmp_path).acquire()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "j1")
    assert "an earlier attempt of this torchrun job" in rundir.RunDirLock(tmp_path).acquire()


def test_fresh_run_refuses_old_checkpoints_unless_resume_or_overwrite(tmp_path, monkeypatch):
    """check_fresh and owned_run_dir: refuse, resume, overwrite; the launcher's ranks skip the lock."""
    root = manifest.checkpoint_dir(tmp_path)
    for name in ("step_10", "step_20"):
        (root / name).mkdir(parents=True)
    assert rundir.check_fresh(tmp_path / "empty", "", False) == ""
    with pytest.raises(rundir.RunDirError) as e:
        rundir.check_fresh(tmp_path, "", False)
    assert str(e.value) == (f"run dir {tmp_path} holds checkpoints of an earlier run (step_10..step_20) and this "
                            "is a fresh run: continue it with --train.resume auto, delete them with "
                            "--run.overwrite true, or choose another --run.dir")
    assert rundir.check_fresh(tmp_path, "auto", False) == ""
    assert rundir.check_fresh(tmp_path, str(root / "step_10"), True) == ""  # resumes from it: never deleted
    with pytest.raises(rundir.RunDirError, match="a run resuming from /elsewhere/step_5"):
        rundir.check_fresh(tmp_path, "/elsewhere/step_5", False)
    assert (root / "step_20").is_dir()

    monkeypatch.delenv(rundir.LOCK_ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    lines = []
    with rundir.owned_run_dir(tmp_path, "", True, log=lines.append):
        assert lines == [(f"run.overwrite=true: deleted 2 checkpoint dirs of an earlier run in {tmp_path} "
                          "(step_10..step_20)")]
        assert not list(root.iterdir()) and (tmp_path / ".lock").is_file()
        # a rank started by this launcher finds the lock is its launcher's and does nothing
        with rundir.owned_run_dir(tmp_path, "", False):
            pass
    assert not (tmp_path / ".lock").exists() and rundir.LOCK_ENV not in os.environ
