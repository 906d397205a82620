"""data.mix: the source of every sample is a fixed function of its global index, exact per period of the weights'
integer proportions and within k (sources) of the weights on any prefix; a batch is a function of (seed, step), so a
resume at any step and every layout's row slices see the same global batch; a mix of one source is that source's
loader; the sources share one tokenizer and must be prepared, or the run is refused in one line."""

from __future__ import annotations

from fractions import Fraction as F

import numpy as np
import pytest
import torch

from nanotitan.config.config import ConfigError, DataConfig, load_config
from nanotitan.config.parse import mix_counts, parse_mix
from nanotitan.data.indexed import IndexedBatches
from nanotitan.data.mix import MixedBatches, MixSchedule
from nanotitan.data.prepare import mix_dirs, mix_sources, prepare_mix, prepared_dir
from tests.helpers.data import make_docs, write_txt

S = 16


@pytest.mark.parametrize("weights", [[F(7, 10), F(3, 10)], [F(1), F(2), F(4)], [F(1, 3), F(0), F(1, 6), F(5, 7)],
                                     [F(5)], [F(999, 1000), F(1, 1000)]])
def test_every_period_holds_the_exact_counts_and_every_prefix_is_within_k(weights):
    sched = MixSchedule(weights)
    a, P, k = sched.counts, sched.period, len(weights)
    assert [F(c, P) for c in a] == [w / sum(weights) for w in weights]
    N = 3 * P + 11
    src = sched.sources(0, N)
    for q in range(N // P):  # aligned periods: exactly a_i of source i
        assert np.bincount(src[q * P:(q + 1) * P], minlength=k).tolist() == a
    counts_Nk = np.cumsum(np.eye(k, dtype=np.int64)[src], axis=0)
    ideal_Nk = np.arange(1, N + 1)[:, None] * np.array(a)[None, :] / P
    assert np.abs(counts_Nk - ideal_Nk).max() < k
    # a pure function of the index: any window of the stream, however far out, is the same samples
    assert np.array_equal(sched.sources(P + 5, 7), src[P + 5:P + 12])
    far = 10**13 * P  # int64 arithmetic without overflow at a long run's indices (a multiple of P: periodic)
    assert np.array_equal(sched.sources(far + 3, P), sched.sources(3, P))


def test_parse_mix_reads_exact_fractions_and_refuses_in_one_line():
    assert parse_mix("a:0.7, b:0.3") == [("a", F(7, 10)), ("b", F(3, 10))]
    assert parse_mix("data/x.txt:1/3,y:2") == [("data/x.txt", F(1, 3)), ("y", F(2))]
    assert mix_counts([F(7, 10), F(3, 10)]) == [7, 3]
    for spec, msg in [("a,b:1", "data.mix entry 'a' needs a source and a weight"),
                      ("a:x,b:1", "data.mix weight 'x' of 'a' is not a number"),
                      ("a:-1,b:1", "data.mix weight -1 of 'a' must be >= 0"),
                      ("a:0,b:0", "the weights sum to 0"), ("a:0.8;b:0.2", "separate the entries with commas"),
                      ("a:1,a:2", "data.mix names 'a' twice"),
                      ("a:0.1234567891,b:0.33333333331", "common denominator exceeds 2**31")]:
        with pytest.raises(ConfigError) as e:
            load_config(None, ["--data.mix", spec])
        assert msg in str(e.value) and "\n" not in str(e.value) and "--data.mix" in str(e.value)
    with pytest.raises(ConfigError, match="data.mix blends prepared sources by global index: --data.loader indexed"):
        load_config(None, ["--data.mix", "a:1", "--data.loader", "streaming"])


@pytest.fixture
def files(tmp_path):
    """Two token files whose ids tell the source (a: 0..29999, b: 40000..) and the position (consecutive ids)."""
    paths = []
    for i, (start, n) in enumerate([(0, 30_000), (40_000, 20_000)]):
        p = tmp_path / f"{i}.bin"
        np.arange(start, start + n).astype(np.uint16).tofile(p)
        paths.append(p)
    return paths


def _mix(files, seed=5, weights=(F(7, 10), F(3, 10))):
    return MixedBatches([IndexedBatches(p, "uint16", S, seed) for p in files], list(weights))


def test_rows_come_from_the_scheduled_source_and_are_that_sources_windows(files):
    mix, B = _mix(files), 10
    for step in (0, 3):
        x, y = mix.global_batch(step, B)
        src = MixSchedule([F(7, 10), F(3, 10)]).sources(step * B, B)
        assert torch.equal(y, x + 1) and torch.equal(torch.from_numpy(src), (x[:, 0] >= 40_000).long())
        for i, part in enumerate(mix.parts):  # row r of source i: the window source i's own loader draws for row r
            rows = torch.from_numpy(np.flatnonzero(src == i))
            assert torch.equal(x[rows], part.global_batch(step, B)[0][rows])
    one = MixedBatches([IndexedBatches(files[0], "uint16", S, 5)], [F(1)])  # a mix of one source is its loader
    assert torch.equal(one.global_batch(4, 8)[0], IndexedBatches(files[0], "uint16", S, 5).global_batch(4, 8)[0])


def test_layouts_and_resumes_see_the_same_global_batch(files):
    B = 12
    run = _mix(files)
    sequential = [run.global_batch(t, B) for t in range(9)]
    resumed = _mix(files)  # a fresh process whose first batch is step 7
    for t in (7, 8, 2):
        assert all(torch.equal(u, v) for u, v in zip(resumed.global_batch(t, B), sequential[t]))
    for world in (2, 3, 4):  # DP x EP data ranks each read their rows: together the global batch
        b = B // world
        for t in (0, 5):
            parts = [_mix(files).rank_batch(t, B, r, b) for r in range(world)]
            assert torch.equal(torch.cat([p[0] for p in parts]), sequential[t][0])
            assert torch.equal(torch.cat([p[1] for p in parts]), sequential[t][1])
    # context parallel: a rank reads only its positions of its rows
    runs = [(0, 4), (12, 4)]
    x, y = _mix(files).rank_batch(5, B, 1, 6, runs)
    cols = np.r_[0:4, 12:16]
    assert torch.equal(x, sequential[5][0][6:12][:, cols]) and torch.equal(y, sequential[5][1][6:12][:, cols])


def test_eval_batches_are_fixed_and_sliced_by_rank(files):
    mix, B = _mix(files), 8
    whole = mix.eval_batches(2, B)
    assert all(torch.equal(u[0], v[0]) for u, v in zip(whole, _mix(files, seed=99).eval_batches(2, B)))  # any seed
    halves = [mix.eval_batches(2, B, r, B // 2) for r in range(2)]
    for j in range(2):
        assert torch.equal(torch.cat([halves[0][j][0], halves[1][j][0]]), whole[j][0])
    src = MixSchedule([F(7, 10), F(3, 10)]).sources(0, 2 * B)
    assert torch.equal(torch.from_numpy(src), (torch.cat([x for x, _ in whole])[:, 0] >= 40_000).long())


def test_sources_share_one_tokenizer_and_must_be_prepared(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOTITAN_CACHE", str(tmp_path / "cache"))
    a = write_txt(tmp_path / "a", make_docs(6, seed=1))
    b = write_txt(tmp_path / "b", make_docs(6, seed=2))
    cfg = DataConfig(mix=f"{a}:2,{b}:1", vocab_size=300)
    with pytest.raises(ConfigError, match=rf"data.mix source '{a}' is not prepared with the mix's tokenizer: run "
                                          rf"`nanotitan data prepare --data.mix '{a}:2,{b}:1'`"):
        mix_dirs(cfg)
    dirs = prepare_mix(cfg, log=lambda line: None)
    assert mix_dirs(cfg) == dirs and prepared_dir(cfg) == dirs[0]  # the mix's tokenizer is the first source's BPE
    assert [w for _, w in mix_sources(cfg)] == [F(2), F(1)]
    assert (dirs[0] / "tokenizer.json").read_bytes() == (dirs[1] / "tokenizer.json").read_bytes()
