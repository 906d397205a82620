"""Storage faults end in one line with nothing lost (issue 27, item 1), and each kind of error has its exit code
(issue 22, item 7: a damaged checkpoint is not a config error).

- A save that cannot fit (the newest checkpoint's size against the file system's free space) is refused before
  anything is written; one that fails while writing (no space, quota, permission) removes its partial save.
  Either way one StorageError line names what failed, where, the free space and the newest good checkpoint.
- A run dir or output dir that cannot be written is refused in one line before anything runs.

The faults are real where a root process can meet them: statvfs's real free space against a checkpoint made
large by a sparse file (no disk used), sysfs (/sys/kernel refuses new files even to root). A disk filling up
mid-write is injected here (ENOSPC from the writer); tests/run/test_faults.py makes it real with RLIMIT_FSIZE.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from nanotitan.state import checkpoint as ckpt

from nanotitan.state import manifest
from nanotitan.config.config import ConfigError
from nanotitan.config.errors import EXIT_CODES, CheckpointError, StorageError, TrainingError
from nanotitan.observe.metrics import MetricsWriter
from nanotitan.model.spec import ModelShardSpec
from nanotitan.run.rundir import RunDirError, RunDirLock, writable_dir
from tests.helpers.checkpoint import build, tiny_cfg

FREE = r"[\d.]+ (B|KiB|MiB|GiB|TiB) free on \S+/checkpoints"


def _save(run: Path, step: int, model, opt, cfg):
    return ckpt.save_checkpoint(run, step, model, opt, None, cfg, {"step": step})


@pytest.fixture
def saved(tmp_path):
    """A run dir holding one good checkpoint (step_1) of a tiny model, and what saves the next one."""
    cfg = tiny_cfg()
    model, opt = build(cfg, ModelShardSpec.full(cfg.model))
    run = tmp_path / "run"
    _save(run, 1, model, opt, cfg)
    return run, model, opt, cfg


def test_each_kind_of_error_has_its_own_exit_code():
    """A damaged checkpoint is not bad input: CheckpointError is not a ConfigError (which prints "config error" and
    exits 2); storage and checkpoint errors have codes of their own."""
    assert not issubclass(CheckpointError, (ConfigError, ValueError))
    assert issubclass(ckpt.NonFiniteStateError, CheckpointError) and ckpt.CheckpointError is CheckpointError
    assert not issubclass(StorageError, (ConfigError, CheckpointError))
    assert {TrainingError.kind, CheckpointError.kind, StorageError.kind} < set(EXIT_CODES)
    assert sorted(EXIT_CODES.values()) == [1, 2, 3, 4]


def test_a_save_that_cannot_fit_is_refused_before_writing(saved):
    """The newest checkpoint is padded with a sparse file larger than the free space (statvfs, not faked): the next
    save is refused, nothing is written, and the line names both sizes' source and the checkpoint kept."""
    run, model, opt, cfg = saved
    step1 = run / "checkpoints" / "step_1"
    pad = step1 / "padding"
    pad.touch()
    os.truncate(pad, shutil.disk_usage(run).free + (1 << 30))  # apparent size only: no block is allocated
    with pytest.raises(StorageError) as e:
        _save(run, 2, model, opt, cfg)
    assert re.fullmatch(rf"saving step 2: refused before writing: step_1 took [\d.]+ (GiB|TiB) and there is less "
                        rf"free; nothing was written; {FREE}; newest good checkpoint: {step1} \(make room or choose "
                        r"another --run.dir, then continue with --train.resume auto\)", str(e.value)), str(e.value)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1"]
    pad.unlink()
    assert manifest.verify_checkpoint(step1) == ""
    assert _save(run, 2, model, opt, cfg).name == "step_2"  # room again: the save goes through


def test_a_save_that_fails_writing_removes_its_partial_save(saved, monkeypatch):
    """The disk fills while rank 0 writes the small files (ENOSPC from the writer): the partial step_2.tmp is
    removed, the line says why, where and what is kept, and step_1 still verifies."""
    run, model, opt, cfg = saved
    write = ckpt._write_text

    def full(path, text):
        if path.name == manifest.MANIFEST:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        write(path, text)

    monkeypatch.setattr(ckpt, "_write_text", full)
    with pytest.raises(StorageError) as e:
        _save(run, 2, model, opt, cfg)
    tmp = run / "checkpoints" / "step_2.tmp"
    assert re.fullmatch(rf"saving step 2: writing {tmp / manifest.MANIFEST} failed: No space left on device \(ENOSPC\); "
                        rf"{FREE}; removed the partial step_2\.tmp; newest good checkpoint: {run}/checkpoints/step_1 "
                        r"\(.*--train\.resume auto\)", str(e.value)), str(e.value)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1"]
    assert manifest.verify_checkpoint(run / "checkpoints" / "step_1") == ""


def test_write_failures_are_told_from_other_errors():
    """DCP wraps each rank's error in CheckpointException (a BaseException); torch.save's zip writer reports a full
    disk without an errno. Both are storage failures; anything else is not."""
    def wrapped(e):
        return CheckpointException("save failed", {0: (e, None)})

    assert ckpt._write_failure(wrapped(OSError(errno.EDQUOT, "Disk quota exceeded"))) == "Disk quota exceeded (EDQUOT)"
    assert "disk full?" in ckpt._write_failure(
        wrapped(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 832 vs 768")))
    cause = RuntimeError("writer thread failed")
    cause.__cause__ = PermissionError(errno.EACCES, "Permission denied")
    assert ckpt._write_failure(wrapped(cause)) == "Permission denied (EACCES)"
    assert ckpt._write_failure(wrapped(ValueError("a planner bug"))) == ""
    assert ckpt._write_failure(KeyError("x")) == ""


def test_metrics_write_that_the_disk_refuses_is_one_line(tmp_path):
    writer = MetricsWriter(str(tmp_path / "run"), True, False)

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            pass

    writer.f = Full()
    with pytest.raises(StorageError, match=rf"^writing {tmp_path}/run/metrics\.jsonl failed: No space left on device "
                                           r"\(ENOSPC\); [\d.]+ \w+ free on \S+; newest good checkpoint: none yet"):
        writer.write({"step": 1, "loss": 1.0})


def _sysfs_refuses() -> bool:
    try:
        fd = os.open("/sys/kernel/.nanotitan-probe", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except OSError:
        return True
    os.close(fd)
    os.unlink("/sys/kernel/.nanotitan-probe")
    return False


needs_sysfs = pytest.mark.skipif(not _sysfs_refuses(), reason="this machine lets us create files in /sys/kernel")


@needs_sysfs
def test_unwritable_run_and_output_dirs_are_refused_in_one_line(tmp_path):
    """sysfs refuses new files even to root: a real permission fault, with nothing to clean up."""
    with pytest.raises(RunDirError, match=r"^run\.dir=/sys/kernel is not writable: cannot create /sys/kernel/\.lock "
                                          r"\(Permission denied \(EACCES\)\); choose a writable --run\.dir$"):
        RunDirLock("/sys/kernel").acquire()
    with pytest.raises(RunDirError, match=r"^--out=/sys/kernel/plots is not writable \(in /sys/kernel\): Permission "
                                          r"denied \(EACCES\); choose another --out$"):
        writable_dir("/sys/kernel/plots", "--out")
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirError, match=r"^--out=\S+/file/out is not writable \(in \S+/file\): Not a directory"):
        writable_dir(tmp_path / "file" / "out", "--out")
    assert writable_dir(tmp_path / "a" / "b", "--out") == tmp_path / "a" / "b"
    assert list(tmp_path.iterdir()) == [tmp_path / "file"]  # probing created nothing
