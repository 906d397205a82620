"""--run.profile_steps A-B: a Chrome trace of exactly steps A..B per rank (shapes and memory recorded), the same
file where TensorBoard looks, and a table of the top operations and of the time in each axis's communication,
whose collectives carry the labels parallel/comm/collectives.py gives them."""

import json

import pytest
import torch

from nanotitan.config.config import ConfigError, load_config
from nanotitan.observe.profiling import StepProfiler, parse_steps
from nanotitan.resolve import resolve
from tests.helpers.tiny import tiny_args

TINY = tiny_args(n_layers=2)


def _trace_names(path) -> set:
    return {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}


def test_parse_steps():
    assert parse_steps("") is None
    assert parse_steps("3") == (3, 3) and parse_steps(" 2 - 5 ") == (2, 5)
    for bad in ("0-2", "5-3", "a-b", "2-"):
        with pytest.raises(ConfigError, match="run.profile_steps"):
            parse_steps(bad)
    with pytest.raises(ConfigError, match="train.steps=4"):
        load_config(None, ["--train.steps", "4", "--run.profile_steps", "3-5"])


def test_traces_exactly_the_chosen_steps_of_a_training_loop(tmp_path):
    """Five steps of a tiny MoE forward/backward/AdamW in one process, steps 2-3 profiled."""
    from tests.helpers.specs import build_shard_spec
    from nanotitan.model.transformer import Transformer

    torch.manual_seed(0)
    cfg = resolve(load_config(None, TINY))
    model = Transformer(cfg.model, build_shard_spec(cfg), seed=0)
    opt = torch.optim.AdamW(model.parameters())
    prof = StepProfiler("2-3", rank=0, run_dir=tmp_path, device=torch.device("cpu"))
    for step in range(1, 6):
        prof.step_begin(step)
        x = torch.randint(0, 300, (2, 16))
        ce, aux = model(x, x)
        (ce + 0.01 * aux).backward()
        opt.step()
        opt.zero_grad()
        prof.step_end(step)
    table = prof.close()
    trace = tmp_path / "profile" / "rank_0.json"
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and not {"ProfilerStep#1", "ProfilerStep#4"} & names
    assert "aten::mm" in names and "Optimizer.step#AdamW.step" in names
    assert any("Input Dims" in e.get("args", {}) for e in events)  # record_shapes
    assert any(e.get("name") == "[memory]" for e in events)  # profile_memory
    assert list((tmp_path / "profile" / "tb").glob("rank_0.*.pt.trace.json"))
    assert "steps 2-3" in table and "aten::mm" in table and "communication" in table
    assert (tmp_path / "profile" / "rank_0.txt").read_text().strip() == table
    assert prof.close() == table  # idempotent; nothing more is traced


def _labelled_collectives(rank, world, run_dir):
    from nanotitan.parallel.comm import collectives as comm

    prof = StepProfiler("1", rank=rank, run_dir=run_dir, device=torch.device("cpu"))
    prof.step_begin(1)
    t = torch.ones(1000)
    comm.all_reduce(t, axis="dp")
    comm.all_reduce(t, axis="dp", async_op=True).wait()
    out = torch.empty(1000)
    comm.all_to_all_single(out, t, axis="ep")
    if rank == 0:
        comm.send(t, dst=1)
    else:
        comm.recv(t, src=0)
    # the interleaved schedule's posted ring exchange (waited for later, after compute) goes through comm too
    from nanotitan.parallel.dims import ParallelDims
    from nanotitan.parallel.pp.comms import StageComms

    comms = StageComms(ParallelDims(1, 2, 1, rank).build_groups(), (1000,), torch.float32, "cpu")
    _, _, posted = comms.post_exchange(t if rank == 0 else None, t if rank == 1 else None, rank == 1, rank == 0)
    posted.wait()
    prof.step_end(1)
    return prof.close()


def test_collectives_carry_their_axis_label(tmp_path):
    from tests.helpers.mp import run_ranks

    tables = run_ranks(_labelled_collectives, world=2, args=(tmp_path,), timeout=120)
    for rank, table in enumerate(tables):
        names = _trace_names(tmp_path / "profile" / f"rank_{rank}.json")
        expected = {"DP all-reduce", "DP wait", "EP all-to-all", "PP send" if rank == 0 else "PP recv",
                    "PP send/recv", "PP wait"}
        assert expected <= names, names & {n for n in names if n and n[:3] in ("DP ", "EP ", "PP ")}
        for label in expected:
            assert label in table
        assert "DP " in table.split("communication")[1] and "EP " in table and "PP " in table


def test_real_two_stage_run_profiles_every_rank_logs_to_wandb_and_reports_tensor_memory(tmp_path, corpus_dir):
    """One `nanotitan train` job, PP=2 (1F1B, M=4), steps 2-3 profiled, W&B offline: a trace and a table per
    rank with the PP labels, the W&B run holding every record of metrics.jsonl, and summary.json's ranks
    holding each stage's live tensor bytes (its own parameters, fp32, AdamW's two moments and steps)."""
    import os
    import subprocess
    import sys

    from tests.helpers.specs import build_shard_spec
    from nanotitan.model.transformer import Transformer
    from tests.helpers.observe import _items, _wandb_records

    run_dir, wandb_dir = tmp_path / "run", tmp_path / "wandb_home"
    wandb_dir.mkdir()
    args = [*TINY, "--data.source", str(corpus_dir), "--train.seq_len", "16", "--train.micro_batch", "2",
            "--parallel.pp", "2", "--parallel.microbatches", "4", "--train.steps", "4", "--run.log_every", "1",
            "--run.profile_steps", "2-3", "--run.wandb", "true", "--run.dir", str(run_dir),
            "--run.progress", "false", "--run.tensorboard", "false", "--train.sample_tokens", "0",
            "--train.eval_every", "0", "--train.ckpt_at_end", "false"]
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(wandb_dir),
               WANDB_CONFIG_DIR=str(wandb_dir), WANDB_CACHE_DIR=str(wandb_dir), WANDB_DATA_DIR=str(wandb_dir))
    r = subprocess.run([sys.executable, "-m", "nanotitan.cli", "train", *args], env=env, capture_output=True,
                       text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cfg = resolve(load_config(None, args))
    for rank in (0, 1):
        names = _trace_names(run_dir / "profile" / f"rank_{rank}.json")
        assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#4" not in names
        assert "PP send/recv" in names or {"PP send", "PP recv"} & names, sorted(n for n in names if n[:3] == "PP ")
        assert f"[rank{rank}]:profile of rank {rank}, steps 2-3" in r.stdout
    jsonl = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run_file,) = (wandb_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history = [_items(x.history.item) for x in _wandb_records(run_file) if x.WhichOneof("record_type") == "history"]
    assert [{k: h[k] for k in line} for h, line in zip(history, jsonl)] == jsonl and len(history) == 4
    for rank, row in enumerate(json.loads((run_dir / "summary.json").read_text())["ranks"]):
        stage = Transformer(cfg.model, build_shard_spec(cfg, pp_rank=rank), seed=0)
        n, tensors = sum(q.numel() for q in stage.parameters()), len(list(stage.parameters()))
        assert (row["param_bytes"], row["grad_bytes"], row["optim_bytes"]) == (4 * n, 4 * n, 8 * n + 4 * tensors)
        assert 0 < row["act_peak_bytes"] < row["peak_mem_bytes"]
