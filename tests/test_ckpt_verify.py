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

Cost: two 2-rank launches (~6 s each on 2 idle cores) plus in-process checks (~2 s).
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

from nanotitan import checkpoint as ckpt
from nanotitan import rundir
from nanotitan.model.spec import build_shard_spec
from nanotitan.parallel.dims import ParallelDims
from tests.mp import run_ranks
from tests.test_checkpoint import SAVE_KS, build, perturb, tiny_cfg

LAYOUT = (1, 1, 2)  # EP=2: each rank writes its own experts, so each shard is checked by one rank only


def _shard(rank, world, run_dir, nan_key):
    """Save steps 10..40 (keep_last 0); then put NaN into one tensor of rank 1 and try step 50 with
    keep_last=1. Returns each rank's refusal line and its state at step 40 (for the load check)."""
    dims = ParallelDims(*LAYOUT, rank).build_groups()
    cfg = tiny_cfg(LAYOUT)
    model, opt = build(cfg, build_shard_spec(cfg, dims.pp_rank, dims.ep_rank))
    perturb(model, opt, SAVE_KS)
    for step in (10, 20, 30, 40):
        ckpt.save_checkpoint(run_dir, step, model, opt, dims, cfg, {"samples_consumed": step}, keep_last=0)
    saved = {k: v.clone() for k, v in ckpt.keyed_tensors(model, opt).items()}
    if rank == 1:
        ckpt.keyed_tensors(model, opt)[nan_key].view(-1)[3] = float("nan")
    try:
        ckpt.save_checkpoint(run_dir, 50, model, opt, dims, cfg, {"samples_consumed": 50}, keep_last=1)
        refusal = ""
    except ckpt.NonFiniteStateError as e:
        refusal = str(e)
    return refusal, saved


def _load_cases(rank, world, cases):
    """For each (run_dir, path_or_auto): resolve_resume, then load what it chose; collect lines/errors."""
    dims = ParallelDims(*LAYOUT, rank).build_groups()
    cfg = tiny_cfg(LAYOUT)
    out = []
    for run_dir, where in cases:
        lines = []
        model, opt = build(cfg, build_shard_spec(cfg, dims.pp_rank, dims.ep_rank))
        try:
            path = ckpt.resolve_resume(where, run_dir, log=lines.append)
            extra = ckpt.load_checkpoint(path, model, opt, dims)
            state = {k: v.clone() for k, v in ckpt.keyed_tensors(model, opt).items()}
            out.append(("ok", path.name, extra, lines, state))
        except ckpt.CheckpointError as e:
            out.append(("error", str(e), None, lines, None))
    # load_checkpoint itself (no resolve_resume first) refuses a damaged checkpoint as well
    model, opt = build(cfg, build_shard_spec(cfg, dims.pp_rank, dims.ep_rank))
    try:
        ckpt.load_checkpoint(Path(cases[0][0]) / "checkpoints" / "step_40", model, opt, dims)
        out.append(("ok",))
    except ckpt.CheckpointError as e:
        out.append(("error", str(e)))
    return out


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


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """One 2-rank launch: checkpoints 10..40 and a refused NaN save of step 50."""
    run = tmp_path_factory.mktemp("run")
    nan_key = "optim.layers.1.moe.experts.W_gate.3.exp_avg_sq"  # expert 3 lives on rank 1 (EP=2 of 4)
    results = run_ranks(_shard, 2, (str(run), nan_key), timeout=90)
    return run, nan_key, results


def test_nonfinite_save_refused_on_every_rank(saved_run):
    """NaN in one rank's optimizer state: both ranks refuse step 50 before writing; step_40 and older stay."""
    run, nan_key, results = saved_run
    (line0, _), (line1, _) = results
    assert f"refusing to save step 50: {nan_key} holds NaN/inf on rank 1" in line1
    assert "refusing to save step 50: rank 1 holds NaN/inf state" in line0
    for line in (line0, line1):
        assert "nothing was written" in line and line.endswith("step_40") and "\n" not in line
    root = ckpt.checkpoint_dir(run)
    assert sorted(p.name for p in root.iterdir()) == ["step_10", "step_20", "step_30", "step_40"]
    manifest = json.loads((root / "step_40" / ckpt.MANIFEST).read_text())["files"]
    assert set(manifest) == {".metadata", "__0_0.distcp", "__1_0.distcp", "config.toml", "state.json"}
    for name, entry in manifest.items():
        assert (root / "step_40" / name).stat().st_size == entry["bytes"]
        assert ckpt._hash_file(root / "step_40" / name)[1] == entry["xxh3_64"]


def test_damaged_checkpoints_are_named_and_skipped(saved_run, tmp_path):
    """Each damage to step_40: `resume PATH` fails naming the file, `resume auto` falls back to step_30
    with one line saying why, on both ranks alike; the fallback loads exactly the saved state."""
    run, _, results = saved_run
    saved = [s for _, s in results]
    cases, expect = [], []
    for name, (target, damage, needle) in _damages().items():
        copy = tmp_path / name
        (copy / "checkpoints").mkdir(parents=True)
        for step in (30, 40):
            shutil.copytree(ckpt.checkpoint_dir(run) / f"step_{step}", copy / "checkpoints" / f"step_{step}")
        damage(copy / "checkpoints" / "step_40" / target)
        cases += [(str(copy), str(copy / "checkpoints" / "step_40")), (str(copy), "auto")]
        expect.append(needle)
    # both checkpoints damaged: auto refuses to restart from scratch, naming both
    both = tmp_path / "both"
    shutil.copytree(tmp_path / "overwrite4k", both)
    _overwrite_mid(both / "checkpoints" / "step_30" / "__0_0.distcp")
    cases.append((str(both), "auto"))
    # the first case's dir is also the target of the plain load_checkpoint call
    per_rank = run_ranks(_load_cases, 2, (cases,), timeout=90)

    r0, r1 = per_rank
    for i, needle in enumerate(expect):
        by_path, by_auto = r0[2 * i], r0[2 * i + 1]
        assert by_path[0] == "error" and needle in by_path[1] and "\n" not in by_path[1], (needle, by_path[1])
        assert by_path[1].startswith("cannot resume from ") and "step_40" in by_path[1]
        status, name, extra, lines, state = by_auto
        assert (status, name, extra) == ("ok", "step_30", {"samples_consumed": 30, "step": 30}), by_auto[:3]
        assert len(lines) == 1 and needle in lines[0] and lines[0].endswith("using step_30"), lines
        assert lines[0].startswith("resume: skipped step_40: ")
        # the other rank reached the same decisions, with the same words
        assert [c[:3] for c in r1[2 * i:2 * i + 2]] == [c[:3] for c in (by_path, by_auto)]
    # the fallback's state equals what the saving ranks held (step 30 == step 40: no update in between)
    for rank, rows in enumerate(per_rank):
        state = rows[1][4]
        assert all(torch.equal(state[k], saved[rank][k]) for k in state if not k.startswith("rng."))
    status, line, *_ = r0[-2]
    assert status == "error" and "no checkpoint under" in line and "step_40: shard __1_0.distcp fails" in line
    assert "step_30: shard __0_0.distcp fails its checksum" in line and r1[-2][1] == line
    assert r0[-1] == r1[-1] and r0[-1][0] == "error" and "cannot load checkpoint" in r0[-1][1]
    assert "__1_0.distcp fails its checksum" in r0[-1][1]


def test_single_process_verification_and_pruning(saved_run, tmp_path):
    """Without a process group one process checks every file; keep_last never drops the newest good one,
    and a checkpoint newer than the one just saved (a left timeline) goes."""
    run, _, _ = saved_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    root = ckpt.checkpoint_dir(copy)
    assert ckpt.verify_checkpoint(root / "step_40") == ""
    _overwrite_mid(root / "step_40" / "__1_0.distcp")
    assert ckpt.verify_checkpoint(root / "step_40") == "shard __1_0.distcp fails its checksum (xxh3_64; damaged)"
    assert ckpt.verify_checkpoint(root / "step_40", checksums=False) == ""  # same size: only the checksum sees it
    (root / "step_50.tmp").mkdir()
    (root / "step_45").mkdir()  # no COMPLETE
    lines = []
    assert ckpt.resolve_resume("auto", copy, log=lines.append) == root / "step_30"
    assert lines == [("resume: skipped step_50.tmp: unfinished save; step_45: incomplete (no COMPLETE marker: its "
                      "save did not finish); step_40: shard __1_0.distcp fails its checksum (xxh3_64; damaged); "
                      "using step_30")]
    with pytest.raises(ckpt.CheckpointError, match=r"cannot resume from .*step_45: incomplete"):
        ckpt.resolve_resume(str(root / "step_45"), copy)
    with pytest.raises(ckpt.CheckpointError, match="neither a checkpoint nor a run dir"):
        ckpt.resolve_resume(str(tmp_path), copy)
    # pre-manifest checkpoints load only with verification off
    (root / "step_30" / ckpt.MANIFEST).unlink()
    assert "manifest.json is missing" in ckpt.verify_checkpoint(root / "step_30")
    assert ckpt.verify_checkpoint(root / "step_30", checksums=False) == ""

    # Resumed from step 20 (say 30 and 40 were judged damaged): saving 25 with keep_last=2 keeps 20 and 25,
    # and drops 30/40, which belong to the timeline the run left, and the unfinished dirs.
    cfg = tiny_cfg((1, 1, 1))
    model, opt = build(cfg, build_shard_spec(cfg, 0, 0))
    ckpt.load_checkpoint(root / "step_20", model, opt, None)
    ckpt.save_checkpoint(copy, 25, model, opt, None, cfg, {"samples_consumed": 25}, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_20", "step_25"]
    assert ckpt.resolve_resume("auto", copy) == root / "step_25"
    # inf (not only NaN) in a parameter: refused in one process too, and nothing changes on disk
    with torch.no_grad():
        model.head.weight[0, 0] = float("inf")
    with pytest.raises(ckpt.NonFiniteStateError, match="refusing to save step 26: model.head.weight holds NaN/inf"):
        ckpt.save_checkpoint(copy, 26, model, opt, None, cfg, {}, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_20", "step_25"]


# --- the run dir ------------------------------------------------------------------------------------

HOLD = ("import sys, time; from nanotitan.rundir import RunDirLock; "
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
    root = ckpt.checkpoint_dir(tmp_path)
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
