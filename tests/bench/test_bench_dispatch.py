"""`nanotitan bench dispatch`: static against dynamic side by side under the emulator, at a tiny size here (the
figures come from the default sizes, docs/experiments/static-dispatch-emulated-2026-12-06.md)."""

import json
from pathlib import Path

import pytest

from nanotitan.bench import dispatch

CONFIG = str(Path(__file__).parents[2] / "configs" / "bench.toml")  # its model cut down to TINY's
TINY = ["--data.vocab_size", "300", "--model.d_model", "32", "--model.n_heads", "4", "--model.ffn_dim", "48",
        "--model.n_layers", "2", "--model.num_experts", "4", "--model.top_k", "2", "--train.seq_len", "16",
        "--train.warmup_steps", "1", "--train.micro_batch", "8"]


def test_layout_names():
    assert dispatch.parse_layout("ep4", 16, 2) == (1, 4, 2)
    assert dispatch.parse_layout("dp2ep4", 16, 2) == (2, 4, 1)
    with pytest.raises(SystemExit, match="dpDepE"):
        dispatch.parse_layout("pp2ep4", 16, 2)
    with pytest.raises(SystemExit, match="--micro-batch"):
        dispatch.parse_layout("dp2ep4", 16, 4)


@pytest.mark.slow  # two training launches under the emulator: 24 s alone, minutes under load
def test_the_bench_runs_both_dispatches_side_by_side(corpus_dir, tmp_path, capsys):
    out = tmp_path / "dispatch.json"
    assert dispatch.main(["--layouts", "ep2", "--topology", "h100-sxm:2", "--steps", "3", "--warmup", "1",
                          "--repeats", "1", "--capacity", "1.0", "--config", CONFIG, "--out", str(out),
                          "--data.source", str(corpus_dir), *TINY]) == 0
    res = json.loads(out.read_text())["results"]["ep2 h100-sxm:2"]
    dyn, stat = res["runs"]["dynamic"][0], res["runs"]["static 1"][0]
    assert dyn["steps"] == stat["steps"] == 2 and dyn["replays"] == 0
    # a try's buffers hold at least every assignment (capacity 1: T*K rows over EP peers), dynamic sends at most that;
    # a replayed step's bytes are both tries', apart
    assert (stat["ep_bytes"] is None) == (stat["replays"] == stat["steps"])
    assert (stat["ep_bytes_replayed"] is None) == (stat["replays"] == 0)
    assert min(b for b in (stat["ep_bytes"], stat["ep_bytes_replayed"]) if b is not None) >= dyn["ep_bytes"] > 0
    assert 1 <= dyn["skew"] <= 2  # the busiest of 2 ranks receives at most all
    assert res["planned"]["static 1"]["ratio"] > 0 and 0 <= res["planned"]["static 1"]["overflow"] <= 1
    printed = capsys.readouterr().out
    assert "| static 1 |" in printed and "median step ÷ dynamic" in printed
    assert out.with_suffix(".md").read_text().startswith("Command: `nanotitan bench dispatch --layouts ep2")
