"""The fault matrix (issue 12): real `nanotitan train` processes meet the faults a long run meets.

Each fault must end with the right exit code, ONE line saying what happened (a regex; no traceback on the
console), within a wall-time bound, and lose nothing: metrics.jsonl parses line by line as strict JSON, and
the newest checkpoint verifies, holds only finite tensors and continues the uninterrupted loss curve.

Shared: one corpus and prepared data cache (conftest), one uninterrupted 40-step baseline whose checkpoints
are copied per fault. Every run uses a constant learning rate after warmup (min_lr_ratio 1), so a run's loss
at step t does not depend on its `train.steps`, and B = 4 sequences (dp*M*m), so dp=2 and single-process runs
train the same model (DESIGN §4). Faults that fail before any rank starts are parametrized single processes.
Stalls use parallel.timeout_s 10 and must be named within 1.5 x 10 s of the SIGSTOP.

Cost: ~3 min on 2 idle cores (three stalls ~20 s each; the rest 1-12 s per fault). With
NANOTITAN_FAULTS_REPORT=FILE the measured table (fault, exit code, line, seconds) is written there
(docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from nanotitan.state.manifest import latest_checkpoint, verify_checkpoint
from tests.helpers.tiny import TINY

BASE_STEPS = 40
COMMON = [*TINY, "--train.threads", "1", "--train.min_lr_ratio", "1", "--run.log_every", "1",
          "--train.keep_last", "0"]
SINGLE = ["--parallel.microbatches", "2"]  # B = 1*2*2: the same global batch as dp=2 with M=1
DP2 = ["--parallel.dp", "2"]
TIMEOUT_S = 10.0
REPORT: list[dict] = []


# --- helpers ---------------------------------------------------------------------------------------

def _cmd(corpus_dir, run_dir, args) -> list[str]:
    return [sys.executable, "-m", "nanotitan.cli", "train", *COMMON, "--data.source", str(corpus_dir),
            "--run.dir", str(run_dir), *args]


def train(corpus_dir, run_dir, *args, timeout=240, preexec=None) -> tuple[int, str, float]:
    """Run a job to its end: (exit code, stdout+stderr, seconds). `preexec` runs in the child before exec (limits)."""
    t0 = time.monotonic()
    r = subprocess.run(_cmd(corpus_dir, run_dir, args), capture_output=True, text=True, timeout=timeout, check=False,
                       preexec_fn=preexec)
    return r.returncode, r.stdout + r.stderr, time.monotonic() - t0


def strict_lines(run_dir) -> list[dict]:
    """Every line of metrics.jsonl, each strict JSON, and the file ends with a newline (no torn line left)."""
    text = (Path(run_dir) / "metrics.jsonl").read_text()
    assert text.endswith("\n"), repr(text[-200:])
    return [json.loads(line, parse_constant=_no_nan) for line in text.splitlines()]


def start(corpus_dir, run_dir, *args, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(_cmd(corpus_dir, run_dir, args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env={**os.environ, **(env or {})})


def wait_for_steps(p: subprocess.Popen, run_dir: Path, n: int, timeout=180) -> None:
    metrics, deadline = Path(run_dir) / "metrics.jsonl", time.monotonic() + timeout
    while not (metrics.exists() and sum(1 for r in records(run_dir) if "loss" in r) >= n):
        assert p.poll() is None, f"job ended before step {n}:\n{p.stdout.read()}"
        assert time.monotonic() < deadline, f"no step {n} after {timeout} s"
        time.sleep(0.05)


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the ranks a launcher started (its children, torchrun sets RANK in their environment)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != launcher_pid:
                continue
            env = dict(kv.split(b"=", 1) for kv in (stat.parent / "environ").read_bytes().split(b"\0") if b"=" in kv)
            out[int(env[b"RANK"])] = int(stat.parent.name)
        except (OSError, ValueError, KeyError, IndexError):
            pass
    return out


def _state(pid: int) -> str:
    """R, S, T (stopped), ... of a process; "gone" when it has exited."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def kill_all(p: subprocess.Popen, pids) -> None:
    """Leave nothing behind, whatever the test saw: the launcher's session and the ranks we knew of."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _no_nan(token):
    raise ValueError(f"metrics.jsonl holds a bare {token}: not JSON")


def records(run_dir) -> list[dict]:
    """metrics.jsonl, each line parsed as strict JSON (a NaN/Infinity token fails)."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    # a line being written right now may be partial: only complete lines count
    return [json.loads(line, parse_constant=_no_nan) for line in lines if line.endswith("}")]


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def one_line(out: str, pattern: str) -> re.Match:
    """The console shows exactly one `nanotitan:` line, matching `pattern`, and no traceback."""
    lines = [line for line in out.splitlines() if line.startswith("nanotitan:")]
    assert "Traceback" not in out, out[-3000:]
    assert len(lines) == 1, f"expected one nanotitan: line, got {lines}\n{out[-3000:]}"
    m = re.search(pattern, lines[0])
    assert m, f"{lines[0]!r} does not match {pattern!r}"
    return m


def finite_checkpoint(path: Path) -> bool:
    """Every floating tensor of a checkpoint is finite (read back through DCP by its own metadata)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if hasattr(m, "size")}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=FileSystemReader(path), no_dist=True)
    return all(bool(t.isfinite().all()) for t in state.values() if t.is_floating_point())


def newest_is_good(run_dir) -> Path:
    ck = latest_checkpoint(run_dir)
    assert ck is not None, f"no complete checkpoint in {run_dir}"
    assert verify_checkpoint(ck) == "", verify_checkpoint(ck)
    assert finite_checkpoint(ck)
    return ck


def continues(run_dir, baseline: dict[int, float], steps) -> None:
    got = losses(run_dir)
    for s in steps:
        assert s in got and abs(got[s] - baseline[s]) <= 1e-5 * abs(baseline[s]), (s, got.get(s), baseline[s])


def report(fault: str, code: int, out: str, seconds: float, lost_nothing: str) -> None:
    """One row of the table in docs/reliability.md: the console's nanotitan: line (else `out` itself)."""
    line = next((ln for ln in out.splitlines() if ln.startswith("nanotitan:")), out.splitlines()[0] if out else "")
    REPORT.append({"fault": fault, "exit": code, "line": line, "seconds": round(seconds, 1),
                   "lost_nothing": lost_nothing})


@pytest.fixture(scope="module", autouse=True)
def _write_report():
    yield
    if os.environ.get("NANOTITAN_FAULTS_REPORT") and REPORT:
        Path(os.environ["NANOTITAN_FAULTS_REPORT"]).write_text(json.dumps(REPORT, indent=1))


@pytest.fixture(scope="module")
def baseline(corpus_dir, tmp_path_factory):
    """The uninterrupted single-process run: checkpoints every 2 steps, its loss per step."""
    run = tmp_path_factory.mktemp("baseline")
    code, out, _ = train(corpus_dir, run, *SINGLE, "--train.steps", str(BASE_STEPS), "--train.ckpt_every", "2")
    assert code == 0, out[-3000:]
    curve = losses(run)
    assert sorted(curve) == list(range(1, BASE_STEPS + 1))
    return run, curve


def copy_newest(baseline_run: Path, dst: Path, n: int = 2) -> Path:
    """A run dir holding the baseline's newest n checkpoints."""
    (dst / "checkpoints").mkdir(parents=True)
    for d in sorted((baseline_run / "checkpoints").iterdir(), key=lambda d: int(d.name.split("_")[1]))[-n:]:
        shutil.copytree(d, dst / "checkpoints" / d.name)
    return dst / "checkpoints" / f"step_{BASE_STEPS}"


# --- faults that fail before any rank starts (one cheap process each) ------------------------------

def _toml_string_for_number(tmp, corpus):
    (tmp / "c.toml").write_text('[train]\nlr = "0.001"\n')
    return ["--config", str(tmp / "c.toml")]


def _malformed_jsonl(tmp, corpus):
    (tmp / "d.jsonl").write_text('{"text": "the king speaks"}\n{"text": broken\n')
    return ["--data.source", str(tmp / "d.jsonl")]


def _binary_text(tmp, corpus):
    (tmp / "b.txt").write_bytes(bytes(range(256)) * 64)
    return ["--data.source", str(tmp / "b.txt")]


def _run_dir_under_a_file(tmp, corpus):
    (tmp / "file").write_text("x")
    return ["--run.dir", str(tmp / "file" / "run")]


def _locked_run_dir(tmp, corpus):
    """A live job (any process on this host) holds the run dir's lock."""
    from nanotitan.run.rundir import LOCK_FILE, _proc_start

    holder = subprocess.Popen(["sleep", "120"])
    _HOLDERS.append(holder)
    (tmp / "run").mkdir()
    (tmp / "run" / LOCK_FILE).write_text(json.dumps({
        "pid": holder.pid, "host": socket.gethostname(), "started": "now", "proc_start": _proc_start(holder.pid),
        "job": "", "cmd": "nanotitan train (the other job)"}))
    return []


def _fresh_run_over_checkpoints(tmp, corpus):
    (tmp / "run" / "checkpoints" / "step_4").mkdir(parents=True)
    (tmp / "run" / "checkpoints" / "step_4" / "COMPLETE").write_text("step 4\n")
    return []


def _sysfs_refuses() -> bool:
    """sysfs refuses new files and dirs even to root: a real permission fault that leaves nothing to clean up."""
    try:
        os.close(os.open("/sys/kernel/.nanotitan-probe", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except OSError:
        return True
    os.unlink("/sys/kernel/.nanotitan-probe")
    return False


def _prepared(tmp, corpus):
    """The job's data prepared into a cache of its own (the shared one must stay good), and its directory."""
    from nanotitan.config.config import DataConfig
    from nanotitan.data.prepare import load_meta, prepare_data

    out = prepare_data(DataConfig(source=str(corpus), vocab_size=300, cache_dir=str(tmp / "cache")), log=lambda s: None)
    return out, load_meta(out)


def _id_past_vocab(tmp, corpus):
    import numpy as np

    out, meta = _prepared(tmp, corpus)
    tokens = np.memmap(out / "train.bin", dtype=meta["dtype"], mode="r+")
    tokens[1001] = 65535
    tokens.flush()
    return ["--data.cache_dir", str(tmp / "cache")]


def _ids_swapped(tmp, corpus):
    import numpy as np

    out, meta = _prepared(tmp, corpus)
    tokens = np.memmap(out / "val.bin", dtype=meta["dtype"], mode="r+")
    tokens[7] = (int(tokens[7]) + 1) % meta["vocab_size"]  # still a valid id: only the checksum can tell
    tokens.flush()
    return ["--data.cache_dir", str(tmp / "cache")]


_HOLDERS: list[subprocess.Popen] = []

CHEAP = [  # (fault, setup -> extra args, exit code, the one line, seconds)
    ("TOML string for a number", _toml_string_for_number, 2, r"c\.toml: train\.lr must be a number", 20),
    ("malformed jsonl", _malformed_jsonl, 2, r"d\.jsonl:2: not valid JSON", 60),
    ("binary text file", _binary_text, 2, r"b\.txt: looks binary", 60),
    ("eval_batches 0", lambda t, c: ["--train.eval_batches", "0", "--train.eval_every", "5"], 2,
     r"train\.eval_batches=0 .*--train\.eval_batches", 20),
    ("threads -1", lambda t, c: ["--train.threads", "-1"], 2, r"train\.threads=-1 must be >= 0", 20),
    ("beta1 1.5", lambda t, c: ["--train.beta1", "1.5"], 2, r"train\.beta1=1\.5 must be in \[0, 1\)", 20),
    ("lr inf", lambda t, c: ["--train.lr", "inf"], 2, r"train\.lr=inf must be a finite number", 20),
    ("ckpt_every -5", lambda t, c: ["--train.ckpt_every", "-5"], 2, r"train\.ckpt_every=-5 must be >= 0", 20),
    ("run dir under a file", _run_dir_under_a_file, 2, r"file is a file, not a directory", 20),
    ("second job into a locked run dir", _locked_run_dir, 2, r"run dir \S+ is in use by pid \d+ on ", 20),
    ("fresh run into a dir with checkpoints", _fresh_run_over_checkpoints, 2,
     r"holds checkpoints of an earlier run \(step_4, its step_4/config\.toml is unreadable\) and this is a fresh "
     r"run: continue it with --train\.resume auto, delete them with --run\.overwrite true", 20),
    ("run dir without write permission", lambda t, c: ["--run.dir", "/sys/kernel"], 2,
     r"run\.dir=/sys/kernel is not writable: cannot create /sys/kernel/\.lock \(Permission denied \(EACCES\)\); "
     r"choose a writable --run\.dir$", 20),
    ("data cache that cannot be created", lambda t, c: ["--data.cache_dir", "/sys/kernel/nanotitan-cache"], 2,
     r"cannot create the data cache /sys/kernel/nanotitan-cache/prepared \(Operation not permitted\); point "
     r"--data\.cache_dir \(or \$NANOTITAN_CACHE\) at a writable directory$", 60),
    ("prepared data with an id past the vocabulary", _id_past_vocab, 2,
     r"prepared data \S+/train\.bin is damaged: token id 65535 at offset 1001 \(tokens\) is >= the tokenizer's "
     r"vocab_size 300; re-prepare it: delete \S+ and run `nanotitan data prepare` \(or `nanotitan train`\) with the "
     r"same --data options$", 60),
    ("prepared data with ids changed inside the vocabulary", _ids_swapped, 2,
     r"prepared data \S+/val\.bin is damaged: tokens from offset 0 to \d+ fail their checksum \(xxh3_64 of "
     r"meta\.json\); re-prepare it: delete ", 60),
]


@pytest.mark.parametrize("fault,setup,code,pattern,bound", CHEAP, ids=[c[0] for c in CHEAP])
def test_fails_before_ranks_start(fault, setup, code, pattern, bound, tmp_path, corpus_dir):
    run = tmp_path / "run"
    if "/sys/kernel" in pattern and not _sysfs_refuses():
        pytest.skip("this machine lets us write into /sys/kernel: no permission fault to meet")
    try:
        got, out, secs = train(corpus_dir, run, *DP2, *setup(tmp_path, corpus_dir))
    finally:
        for h in _HOLDERS:
            h.kill()
            h.wait()
        _HOLDERS.clear()
    assert got == code, out[-3000:]
    one_line(out, rf"^nanotitan: config error: .*{pattern}")
    assert secs < bound, secs
    assert not (run / "logs").exists(), "a rank started"
    if fault == "fresh run into a dir with checkpoints":  # the old run's checkpoint is untouched
        assert (run / "checkpoints" / "step_4" / "COMPLETE").exists()
    if fault.startswith("prepared data"):  # refused as found: nothing rewritten, no rank ever drew a batch
        bad = re.search(r"delete (\S+) and run", out).group(1)
        assert Path(bad).is_dir() and not list(tmp_path.glob("run/metrics.jsonl"))
    report(fault, got, out, secs, "nothing written")


# --- damaged checkpoints: resume auto falls back, resume PATH refuses in one line -------------------

def _overwrite_4k(ck: Path):
    shard = ck / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(os.urandom(4096))


def _truncate(ck: Path):
    shard = ck / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)


DAMAGE = [  # (fault, damage, what resume auto says about step 40)
    ("4 KiB overwritten mid-shard", _overwrite_4k, r"shard __0_0\.distcp fails its checksum"),
    ("truncated shard", _truncate, r"shard __0_0\.distcp is \d+ bytes, the manifest says \d+"),
    ("deleted .metadata", lambda ck: (ck / ".metadata").unlink(), r"file \.metadata is missing"),
    ("deleted COMPLETE", lambda ck: (ck / "COMPLETE").unlink(), r"incomplete \(no COMPLETE marker"),
]


@pytest.mark.parametrize("fault,damage,why", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_resume_auto_falls_back(fault, damage, why, tmp_path, corpus_dir, baseline):
    """The damaged newest checkpoint is skipped in one line; the one before continues the loss curve."""
    base_run, curve = baseline
    run = tmp_path / "run"
    damage(copy_newest(base_run, run))
    code, out, secs = train(corpus_dir, run, *SINGLE, "--train.steps", str(BASE_STEPS), "--train.ckpt_every", "2",
                            "--train.resume", "auto")
    assert code == 0, out[-3000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("resume:")]
    assert len(lines) == 1 and re.search(rf"skipped step_{BASE_STEPS}: {why}.*; using step_{BASE_STEPS - 2}$",
                                         lines[0]), lines
    continues(run, curve, [BASE_STEPS - 1, BASE_STEPS])
    assert newest_is_good(run).name == f"step_{BASE_STEPS}"  # re-saved over the damaged one
    assert secs < 120, secs
    report(f"{fault}, resume auto", code, lines[0], secs, "yes: falls back, loss curve continues")


def test_resume_path_on_damaged_checkpoint(tmp_path, corpus_dir, baseline):
    """Two ranks refuse a damaged checkpoint named by --train.resume: one line naming the file, shown once."""
    base_run, _ = baseline
    run = tmp_path / "run"
    ck = copy_newest(base_run, run)
    _overwrite_4k(ck)
    code, out, secs = train(corpus_dir, run, *DP2, "--train.steps", str(BASE_STEPS), "--train.resume", str(ck))
    assert code == 3, out[-3000:]  # a damaged checkpoint is not a config error (docs/reliability.md)
    one_line(out, rf"^nanotitan: checkpoint error: cannot resume from \S+step_{BASE_STEPS}: shard __0_0\.distcp "
                  r"fails its checksum")
    assert not (run / "metrics.jsonl").exists() or not losses(run)
    assert secs < 120, secs
    report("resume PATH on a damaged checkpoint (2 ranks)", code, out, secs, "yes: nothing written")


def test_stale_lock_is_taken_over(tmp_path, corpus_dir, baseline):
    """A lock left by a dead process: taken over with a line saying so, and the run continues."""
    from nanotitan.run.rundir import LOCK_FILE

    base_run, curve = baseline
    run = tmp_path / "run"
    shutil.rmtree(copy_newest(base_run, run))  # step 38 only: the run trains steps 39 and 40
    dead = subprocess.Popen(["true"])
    dead.wait()
    (run / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "then",
                                             "proc_start": 1, "job": "", "cmd": "a job that crashed"}))
    code, out, secs = train(corpus_dir, run, *SINGLE, "--train.steps", str(BASE_STEPS), "--train.resume", "auto")
    assert code == 0, out[-3000:]
    assert re.search(rf"took over the lock of {run} from pid {dead.pid} .*: a process that is gone", out), out[-2000:]
    assert not (run / LOCK_FILE).exists(), "the lock outlived the job"
    continues(run, curve, [BASE_STEPS - 1, BASE_STEPS])
    assert secs < 120, secs
    report("stale lock (dead PID)", code, next(ln for ln in out.splitlines() if "took over the lock" in ln), secs,
           "yes: resumed, lock released at exit")


# --- storage faults: a save that cannot be written ends in one line, the newest good checkpoint kept -----

FSIZE_LIMIT = 512 << 10  # bytes per file: above metrics.jsonl and the logs of a short run, below a shard (~1 MB)
STORAGE = (r"; [\d.]+ (B|KiB|MiB|GiB|TiB) free on \S+/checkpoints{removed}; newest good checkpoint: "
           r"(?P<kept>\S+/step_\d+) \(make room or choose another --run\.dir, then continue with --train\.resume auto\)$")


def _file_size_limit():
    """In the job's processes (inherited by its ranks): a write past FSIZE_LIMIT fails with EFBIG, which is what a
    quota or a full disk does to a writer (Python ignores SIGXFSZ, so the write returns the error)."""
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, FSIZE_LIMIT))


def _storage_row(fault, run, code, out, secs, baseline_curve, corpus_dir, m) -> None:
    """What every storage fault must keep: no partial save, the named checkpoint verifies and is the newest, and a
    plain `resume auto` afterwards continues the loss curve from it."""
    kept = newest_is_good(run)
    assert str(kept) == m.group("kept") and kept.name == f"step_{BASE_STEPS - 2}"
    assert not list((run / "checkpoints").glob("*.tmp")), list((run / "checkpoints").iterdir())
    strict_lines(run)
    code2, out2, _ = train(corpus_dir, run, *DP2, "--train.steps", str(BASE_STEPS), "--train.ckpt_every", "2",
                           "--train.resume", "auto")
    assert code2 == 0, out2[-3000:]
    continues(run, baseline_curve, [BASE_STEPS - 1, BASE_STEPS])
    assert newest_is_good(run).name == f"step_{BASE_STEPS}"
    report(fault, code, out, secs, f"yes: {kept.name} verifies, resume auto continues the curve")


def test_disk_full_during_a_save(tmp_path, corpus_dir, baseline):
    """Two ranks whose files may not grow past 512 KiB (RLIMIT_FSIZE: EFBIG, a real failed write) save step 40:
    exit 4 with one line naming the write, the free space, the removed partial save and step_38, kept."""
    base_run, curve = baseline
    run = tmp_path / "run"
    shutil.rmtree(copy_newest(base_run, run))  # step_38 only: steps 39 and 40 train, then the save of 40 fails
    code, out, secs = train(corpus_dir, run, *DP2, "--train.steps", str(BASE_STEPS), "--train.ckpt_every", "2",
                            "--train.resume", "auto", preexec=_file_size_limit)
    assert code == 4, out[-3000:]
    m = one_line(out, rf"^nanotitan: storage error: saving step {BASE_STEPS}: writing \S+/step_{BASE_STEPS}\.tmp "
                      r"failed: File too large \(EFBIG\)"
                      + STORAGE.format(removed=rf"; removed the partial step_{BASE_STEPS}\.tmp"))
    assert secs < 120, secs
    _storage_row("disk full during a save (RLIMIT_FSIZE, 2 ranks)", run, code, out, secs, curve, corpus_dir, m)


def test_save_that_cannot_fit_is_refused_before_writing(tmp_path, corpus_dir, baseline):
    """The previous checkpoint is larger than the free space (a sparse file pads step_38 past statvfs's real free
    bytes; no block is used): the save of step 40 is refused before anything is written, exit 4."""
    base_run, curve = baseline
    run = tmp_path / "run"
    shutil.rmtree(copy_newest(base_run, run))
    pad = run / "checkpoints" / f"step_{BASE_STEPS - 2}" / "padding"
    pad.touch()
    os.truncate(pad, shutil.disk_usage(run).free + (1 << 30))
    try:
        code, out, secs = train(corpus_dir, run, *DP2, "--train.steps", str(BASE_STEPS), "--train.ckpt_every", "2",
                                "--train.resume", "auto")
    finally:
        size = pad.stat().st_size
        pad.unlink()  # "make room"
    assert code == 4, out[-3000:]
    m = one_line(out, rf"^nanotitan: storage error: saving step {BASE_STEPS}: refused before writing: "
                      rf"step_{BASE_STEPS - 2} took [\d.]+ (GiB|TiB) and there is less free; nothing was written"
                      + STORAGE.format(removed=""))
    assert size > shutil.disk_usage(run).free
    assert secs < 120, secs
    _storage_row("save that cannot fit (free-space check, 2 ranks)", run, code, out, secs, curve, corpus_dir, m)


# --- crash residue: a torn metrics line, a save that never finished ---------------------------------------

def test_torn_metrics_line_is_dropped_on_resume(tmp_path, corpus_dir, baseline):
    """A crash mid-write left half a JSON line: `nanotitan plot` still reads the run, and resume auto drops the
    torn line with one warning, so metrics.jsonl is strict JSON lines again and the curve continues."""
    base_run, curve = baseline
    run = tmp_path / "run"
    shutil.rmtree(copy_newest(base_run, run))
    lines = (base_run / "metrics.jsonl").read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= BASE_STEPS - 2]
    torn = lines[len(kept)][: len(lines[len(kept)]) // 2]
    (run / "metrics.jsonl").write_text("".join(kept) + torn)
    r = subprocess.run([sys.executable, "-m", "nanotitan.cli", "plot", str(run)], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0 and (run / "plots" / "loss.png").is_file(), r.stdout + r.stderr
    code, out, secs = train(corpus_dir, run, *SINGLE, "--train.steps", str(BASE_STEPS), "--train.resume", "auto")
    assert code == 0, out[-3000:]
    warned = [ln for ln in out.splitlines() if "dropped a torn" in ln]
    assert warned == [f"warning: {run}/metrics.jsonl: dropped a torn last line ({len(torn.encode())} bytes, from a "
                      "crash mid-write); the file is strict JSON lines again"], warned
    recs = strict_lines(run)
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, BASE_STEPS + 1))
    continues(run, curve, range(1, BASE_STEPS + 1))
    report("torn last line of metrics.jsonl, resume auto", code, warned[0], secs,
           "yes: strict JSON lines again, curve continues; plot read it before")


def test_unwritable_plot_output_is_refused(tmp_path, baseline):
    if not _sysfs_refuses():
        pytest.skip("this machine lets us write into /sys/kernel: no permission fault to meet")
    base_run, _ = baseline
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "nanotitan.cli", "plot", str(base_run), "--out", "/sys/kernel/plots"],
                       capture_output=True, text=True, timeout=120, check=False)
    secs = time.monotonic() - t0
    assert r.returncode == 2, r.stdout + r.stderr
    one_line(r.stdout + r.stderr, r"^nanotitan: config error: --out=/sys/kernel/plots is not writable \(in "
                                  r"/sys/kernel\): Permission denied \(EACCES\); choose another --out$")
    report("plot into an unwritable --out", r.returncode, r.stderr, secs, "nothing written")


def test_stale_tmp_save_is_removed_at_start(tmp_path, corpus_dir, baseline):
    """A step_N.tmp left by a job killed mid-save is removed when the next job takes the run dir, with a line;
    resume auto uses the newest complete checkpoint and the curve continues."""
    base_run, curve = baseline
    run = tmp_path / "run"
    shutil.rmtree(copy_newest(base_run, run))
    stale = run / "checkpoints" / f"step_{BASE_STEPS - 1}.tmp"
    shutil.copytree(run / "checkpoints" / f"step_{BASE_STEPS - 2}", stale)
    (stale / "__0_0.distcp").write_bytes(b"half a shard")
    (stale / "COMPLETE").unlink()
    code, out, secs = train(corpus_dir, run, *SINGLE, "--train.steps", str(BASE_STEPS), "--train.resume", "auto")
    assert code == 0, out[-3000:]
    line = [ln for ln in out.splitlines() if ln.startswith("removed ")]
    assert line == [f"removed step_{BASE_STEPS - 1}.tmp from {run}/checkpoints: unfinished save of an earlier job "
                    "that stopped mid-save"], out[-2000:]
    assert not stale.exists()
    continues(run, curve, [BASE_STEPS - 1, BASE_STEPS])
    report("stale step_N.tmp at start", code, line[0], secs, "yes: removed, resumed from the newest complete one")


# --- faults in a running job -----------------------------------------------------------------------

def test_divergence_stops_without_saving_nonfinite(tmp_path, corpus_dir):
    """lr 1e6 on two ranks: exit 1 with one line naming the step; every checkpoint finite; strict JSON."""
    run = tmp_path / "run"
    code, out, secs = train(corpus_dir, run, *DP2, "--train.lr", "1e6", "--train.steps", "30", "--train.ckpt_every", "1")
    assert code == 1, out[-3000:]
    m = one_line(out, r"^nanotitan: step (\d+): non-finite .*stopped without saving it")
    bad = int(m.group(1))
    recs = records(run)  # strict JSON
    assert recs and recs[-1]["step"] == bad and max(r["step"] for r in recs) == bad
    cks = sorted(int(d.name.split("_")[1]) for d in (run / "checkpoints").glob("step_*")) \
        if (run / "checkpoints").exists() else []
    # the steps before the divergence were finite and saved (ckpt_every 1): the newest is the one before it
    assert cks and cks[-1] == bad - 1 and all(s < bad for s in cks), (cks, bad)
    newest_is_good(run)
    assert secs < 120, secs
    report("divergence (lr 1e6, 2 ranks)", code, out, secs, f"yes: {len(cks)} finite checkpoints, strict JSON")


def test_kill9_during_a_save(tmp_path, corpus_dir, baseline):
    """SIGKILL while a checkpoint is being written: resume auto takes the newest complete one, and the run
    continues the loss curve; the unfinished save is gone after the next one."""
    _, curve = baseline
    run = tmp_path / "run"
    p = start(corpus_dir, run, *SINGLE, "--train.steps", str(BASE_STEPS - 2), "--train.ckpt_every", "1")
    root, seen = run / "checkpoints", None
    try:
        deadline = time.monotonic() + 180
        while seen is None and p.poll() is None and time.monotonic() < deadline:
            if (root / "step_3" / "COMPLETE").exists():  # a save after the third: one to fall back to
                seen = next((d.name for d in os.scandir(root) if d.name.endswith(".tmp")), None)
            if seen is None:
                time.sleep(0.001)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    finally:
        kill_all(p, [])
    assert seen, "never saw a save in progress"
    killed_at = int(seen.split("_")[1].split(".")[0])
    assert killed_at < BASE_STEPS - 2
    target = killed_at + 2
    code, out, secs = train(corpus_dir, run, *SINGLE, "--train.steps", str(target), "--train.ckpt_every", "1",
                            "--train.resume", "auto")
    assert code == 0, out[-3000:]
    m = re.search(r"resumed from \S+step_(\d+) at step", out)
    assert m, out[-3000:]
    resumed = int(m.group(1))
    assert resumed in (killed_at - 1, killed_at), (resumed, killed_at)  # the save finished, or it did not
    continues(run, curve, range(resumed + 1, target + 1))
    assert not list(root.glob("*.tmp")), list(root.iterdir())
    assert newest_is_good(run).name == f"step_{target}"
    report("kill -9 during a save", -9, f"(killed in {seen}) then resume auto: resumed from step_{resumed}", secs,
           "yes: newest complete checkpoint continues the curve")


@pytest.mark.parametrize("sig,extra,code,pattern", [
    (signal.SIGINT, [], 130, (r"^nanotitan: interrupted \(SIGINT\); newest complete checkpoint (\S+/step_(\d+)); "
                              r"resume with: nanotitan train .* --train\.resume auto$")),
    (signal.SIGTERM, ["--train.ckpt_on_signal", "true"], 143,
     r"^nanotitan: stopped by SIGTERM; saved (\S+/step_(\d+)); resume with: nanotitan train .* --train\.resume auto$"),
], ids=["SIGINT", "SIGTERM with ckpt_on_signal"])
def test_clean_stop(sig, extra, code, pattern, tmp_path, corpus_dir, baseline):
    """Ctrl-C / a scheduler's SIGTERM on a 2-rank job: one line naming the checkpoint and how to resume, the
    exit code of the signal, no rank left; resuming continues the loss curve."""
    _, curve = baseline
    run = tmp_path / "run"
    p = start(corpus_dir, run, *DP2, "--train.steps", str(BASE_STEPS - 2), "--train.ckpt_every", "3", *extra)
    pids = {}
    try:
        wait_for_steps(p, run, 7)
        pids = rank_pids(p.pid)
        os.kill(p.pid, sig)
        t0 = time.monotonic()
        out, _ = p.communicate(timeout=120)
        secs = time.monotonic() - t0
    finally:
        kill_all(p, pids.values())
    assert p.returncode == code, out[-3000:]
    m = one_line(out, pattern)
    assert secs < (10 if sig == signal.SIGINT else 30), secs
    assert len(pids) == 2 and not any(Path(f"/proc/{pid}").exists() for pid in pids.values()), "a rank outlived it"
    ck = newest_is_good(run)
    assert str(ck) == m.group(1)
    stopped_at = int(m.group(2))
    if sig == signal.SIGTERM:  # saved at the step it stopped after: nothing after it was trained
        assert max(losses(run)) == stopped_at
    continues(run, curve, sorted(losses(run)))  # the job itself was on the curve up to the stop
    code2, out2, _ = train(corpus_dir, run, *SINGLE, "--train.steps", str(stopped_at + 2), "--train.resume", "auto")
    assert code2 == 0, out2[-3000:]
    continues(run, curve, [stopped_at + 1, stopped_at + 2])
    report(f"{signal.Signals(sig).name}{' with ckpt_on_signal' if extra else ''} (2 ranks)", code, out, secs,
           f"yes: step_{stopped_at} verifies, resume continues the curve")


@pytest.mark.parametrize("axis,layout,stop_at,waits", [  # stop_at: rank 1 stops itself entering that call
    ("DP", DP2, "1:dp:all-reduce:17", r"rank 0 waits in DP all-reduce #17 \(backward\)"),
    ("PP", ["--parallel.pp", "2"], "1:pp::25", r"rank 0 waits in PP (send|recv|send/recv) #\d+ \((to|from) rank 1[^)]*\)"),
    ("EP", ["--parallel.ep", "2"], "1:ep:all-to-all:175",
     r"rank 0 waits in EP all-to-all #175 \((layer \d+, )?(forward|backward)\)"),
])
def test_stall_is_named(axis, layout, stop_at, waits, tmp_path, corpus_dir):
    """A rank of a 2-rank job SIGSTOPs itself inside step 9 (NANOTITAN_STOP_AT, parallel/comm/stall.py), with
    parallel.timeout_s 10: within 15 s the job exits 1 with one line naming the stopped rank, the call the
    other waits in, and where the stopped one was."""
    run = tmp_path / "run"
    p = start(corpus_dir, run, *layout, "--parallel.microbatches", "2", "--train.micro_batch", "1",
              "--train.steps", "100000", "--train.ckpt_every", "4", "--parallel.timeout_s", str(TIMEOUT_S),
              env={"NANOTITAN_STOP_AT": stop_at})
    pids = {}
    try:
        deadline = time.monotonic() + 180
        while True:  # the stall starts when rank 1 is stopped ("T" in /proc/PID/stat)
            pids = pids if 1 in pids else rank_pids(p.pid)
            if 1 in pids and _state(pids[1]) == "T":
                break
            assert p.poll() is None and time.monotonic() < deadline, f"rank 1 never stopped:\n{p.stdout.read()}"
            time.sleep(0.02)
        t0 = time.monotonic()
        out, _ = p.communicate(timeout=120)
        secs = time.monotonic() - t0
    finally:
        kill_all(p, pids.values())
    assert p.returncode == 1, out[-3000:]
    one_line(out, rf"^nanotitan: rank 1 stalled: {waits}; rank 1 last entered [A-Z]+ \S+ #\d+.*, silent for "
                  r"\d+ s \(stopped or hung\)")
    assert secs <= 1.5 * TIMEOUT_S, f"{secs:.1f} s > 1.5 x timeout_s"
    assert json.loads((run / "logs" / "stall_rank_0.json").read_text())["error"]  # the live rank wrote its entries
    assert newest_is_good(run).name == "step_8"
    records(run)
    report(f"SIGSTOP on a {axis} rank (timeout_s 10)", p.returncode, out, secs,
           f"yes: step_8 verifies; detection {secs / TIMEOUT_S:.2f} x timeout_s")


# --- the stall record itself (in-process) -------------------------------------------------------------

class _Collective(torch.autograd.Function):
    """Stands in for EP's all-to-all: enters the record in forward and in backward, as ep.py does."""

    @staticmethod
    def forward(ctx, x, record):
        ctx.record = record
        record.leave(record.enter("ep", "all-to-all", (x,)))
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        ctx.record.leave(ctx.record.enter("ep", "all-to-all", (g,)))
        return g, None


def test_record_names_layer_and_phase():
    """label_layers: a collective inside block k is "layer k, forward" going forward and "layer k, backward"
    when backward reaches that block."""
    from nanotitan.parallel.comm.stall import CommRecord, label_layers

    record = CommRecord()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return _Collective.apply(self.lin(x), record), x.new_zeros(())

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleDict({"0": Block(), "1": Block()})

        def forward(self, x):
            for block in self.layers.values():
                x, _ = block(x)
            return x.sum()

    model = Model()
    label_layers(model)
    model(torch.randn(2, 4)).backward()
    assert [e["ctx"] for e in record.entries()] == ["layer 0, forward", "layer 1, forward", "layer 1, backward",
                                                   "layer 0, backward"]
    assert [e["seq"] for e in record.entries()] == [1, 2, 3, 4]
