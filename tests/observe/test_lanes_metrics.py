"""With parallel.ep_overlap_microbatches, metrics.jsonl carries the lanes' figures (pp.StepStats): ep_exposed_s (EP
wait no lane's compute hid) and lanes_overlap_s (a forward and a backward at once), means per step over the record's
interval; without the lanes neither column exists."""

import json

from tests.helpers.mp import run_ranks, train_once

ARGS = ["--model.d_model", "32", "--model.n_heads", "4", "--model.ffn_dim", "48", "--model.n_layers", "2",
        "--model.num_experts", "4", "--data.vocab_size", "300", "--train.seq_len", "16", "--train.micro_batch", "2",
        "--train.steps", "4", "--train.eval_every", "0", "--train.sample_tokens", "0", "--train.threads", "1",
        "--train.ckpt_at_end", "false", "--run.log_every", "2", "--run.progress", "false",
        "--run.tensorboard", "false", "--parallel.ep", "2", "--parallel.microbatches", "4"]


def _train(rank, world, corpus_dir, run_root):
    for lanes in ("true", "false"):
        train_once([*ARGS, "--data.source", corpus_dir, "--run.dir", f"{run_root}/{lanes}",
                    "--parallel.ep_overlap_microbatches", lanes])


def test_lanes_columns_in_metrics(corpus_dir, tmp_path):
    run_ranks(_train, 2, args=(str(corpus_dir), str(tmp_path)), timeout=180)
    on = [json.loads(line) for line in (tmp_path / "true" / "metrics.jsonl").read_text().splitlines()]
    off = [json.loads(line) for line in (tmp_path / "false" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in on] == [1, 2, 4]  # the first, every 2nd, the last: intervals of 1, 1 and 2 steps
    for r, steps in zip(on, (1, 1, 2)):
        assert 0.0 <= r["ep_exposed_s"] <= r["step_time_s"] and 0.0 <= r["lanes_overlap_s"] <= r["step_time_s"]
        # comm_ep_wait_s is the interval's summed exposed EP wait (pp.py brings it there), timed by comm.py
        assert abs(r["ep_exposed_s"] * steps - r["comm_ep_wait_s"]) <= 0.2 * r["comm_ep_wait_s"] + 0.005, r
    assert any(r["lanes_overlap_s"] > 0 for r in on), on  # the lanes ran at once in some step
    assert all("ep_exposed_s" not in r and "lanes_overlap_s" not in r for r in off)
