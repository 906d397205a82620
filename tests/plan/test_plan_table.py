"""What `nanotitan plan` prints (plan/table.py) and the what-if's advice (plan/advice.py): one row per layout, in the
order the header states, the recommendation named by its row, every change to the config's batch with its
consequence, advice computed from the command; and a search that validates each candidate once."""

from __future__ import annotations

import dataclasses
import re

import pytest

from nanotitan.config.config import load_config
from nanotitan.config.hardware import get_hardware
from nanotitan.plan import PlanOptions, plan, search
from nanotitan.plan.advice import advise
from nanotitan.plan.cli import main
from nanotitan.plan.table import SORTED_BY, batch_changes, format_table, layout_key, layout_rows, reason
from tests.helpers.plan import CPU, tiny

# configs/default.toml's shape in small: m = 2, M = 2 on DP2 x PP2 x EP2 (global batch 16)
ARGS = ["--hardware", "cpu-gloo", "--model.d_model", "64", "--model.n_heads", "4", "--model.ffn_dim", "128",
        "--model.n_layers", "4", "--model.num_experts", "4", "--data.vocab_size", "512", "--train.seq_len", "64",
        "--model.max_seq_len", "64", "--train.micro_batch", "2", "--parallel.microbatches", "2", "--parallel.dp", "2",
        "--parallel.pp", "2", "--parallel.ep", "2"]


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if re.match(r"\| \d+\*? \|", line)]


def test_one_row_per_layout_sorted_as_the_header_says_with_the_recommendation_marked():
    preds = plan(tiny(m=8), 4, CPU)
    rows = layout_rows(preds)
    keys = [layout_key(r.layout) for r in rows]
    assert len(keys) == len(set(keys)) == len({layout_key(p.layout) for p in preds})  # every layout, once
    assert sum(len(r.others) + 1 for r in rows) == len(preds)  # its schedules and zero levels folded into it
    order = [(not r.pred.fits, -r.pred.tokens_per_sec, r.pred.peak_mem) for r in rows]
    assert order == sorted(order) and [r.rank for r in rows] == list(range(1, len(rows) + 1))
    (rec,) = [r for r in rows if r.recommended]
    assert rec.pred is preds[0]  # the recommendation (plan's first), at its own place in the order
    text = format_table(rows, 5)
    assert SORTED_BY in text
    table = _rows(text)
    assert [int(c[0].rstrip("*")) for c in table] == list(range(1, 6)) and sum("*" in c[0] for c in table) <= 1
    # a recommendation below the shown rows is shown anyway, at its own number, after a gap
    rec.recommended, rows[-1].recommended = False, True
    text = format_table(rows, 3)
    assert [c[0] for c in _rows(text)] == ["1", "2", "3", f"{len(rows)}*"] and "| … |" in text


def test_a_recommendation_slower_than_row_1_says_why_and_names_only_shown_rows():
    preds = plan(tiny(m=8), 4, CPU)
    rows = layout_rows(preds)
    line = reason(rows)
    for n in re.findall(r"row (\d+)", line):  # every row it names is in the table (the recommended one is)
        assert int(n) <= 2 or any(r.rank == int(n) and r.recommended for r in rows)
    # a near-tie at a lower zero level is preferred: the faster row 1 is named with the slack that passed it over
    fast = dataclasses.replace(rows[0].pred, tokens_per_sec=rows[0].pred.tokens_per_sec * 1.02)
    slow = dataclasses.replace(fast, layout=dataclasses.replace(fast.layout, dp=99),
                               tokens_per_sec=fast.tokens_per_sec / 1.02)
    two = layout_rows([slow, fast])
    assert [r.recommended for r in two] == [False, True] and "slower than row 1" in reason(two)


def test_a_changed_micro_batch_is_named_as_a_different_model_and_kept_by_default(capsys):
    assert main(["--ranks", "8", "--top", "40", *ARGS]) == 0
    text = capsys.readouterr().out
    assert {c[7] for c in _rows(text)} == {"2"} and "DIFFERENT MODEL" not in text  # the config's m: its model
    assert main(["--ranks", "8", "--top", "40", "--micro-batch", "any", *ARGS]) == 0
    text = capsys.readouterr().out
    ms = {c[7] for c in _rows(text)}
    assert "2" in ms and any(m.endswith("(config 2)") for m in ms)  # other m, each marked against the config's
    best_m = re.search(r"--train.micro_batch (\d+)", text).group(1)
    assert best_m != "2" and f"train.micro_batch 2 -> {best_m}: a DIFFERENT MODEL" in text  # said, loudly
    cfg = load_config(None, ARGS[2:])
    lay = plan(cfg, 8, CPU, PlanOptions(micro_batch=2))[0].layout
    for M in (1, 4):  # M alone, at the same m and global batch: the same model, said
        (line,) = batch_changes(cfg, dataclasses.replace(lay, microbatches=M, dp=16 // (2 * M * lay.ep)),
                                PlanOptions())
        assert line.startswith(f"parallel.microbatches 2 -> {M}: the same model")


def test_what_if_advice_is_computed_from_the_command():
    h100 = get_hardware("h100-sxm")
    for dtype, ac in (("fp32", True), ("bf16", False)):
        cfg = tiny(n_layers=2, m=4)
        cfg.train.dtype = dtype
        opts = PlanOptions(activation_checkpointing=ac, nodes=1, global_batch=64)
        best = plan(cfg, 8, h100, opts)[0]
        advice = advise(cfg, opts, best, h100, [("compute", 0.9)])
        flags = {a["flags"] for a in advice}
        # bf16 and checkpointing off are offered only where the command does not already set them, each priced
        assert ("--train.dtype bf16" in flags) == (dtype == "fp32")
        assert ("--train.activation_checkpointing false" in flags) == ac
        for a in advice:
            if a["flags"]:
                assert a["tokens_per_sec"] > 0 and a["gain"] == pytest.approx(a["tokens_per_sec"] /
                                                                               best.tokens_per_sec - 1)
        if dtype == "bf16":
            assert flags == {None}  # nothing left to change for compute: said, not invented


def test_a_search_validates_each_candidate_once(monkeypatch):
    calls = []
    real = search.validate
    monkeypatch.setattr(search, "validate", lambda c, world_size=None: calls.append(world_size) or real(c, world_size))
    cfg = tiny(m=8)
    preds = plan(cfg, 8, CPU, PlanOptions(nodes=1))
    candidates = sum(len(search.layout_candidates(cfg, 8 // (tp * cp), 0, (0, 1, 2, 3)))
                     for cp in (1, 2, 4, 8) if cfg.train.seq_len % (2 * cp) == 0 for tp in (1, 2, 4, 8) if cp * tp <= 8)
    assert len(preds) <= len(calls) <= candidates  # one config built and validated per candidate, at most
    calls.clear()
    plan(cfg, 8, CPU, PlanOptions(nodes=1, micro_batch=8))
    assert len(calls) < candidates / 2  # a held m: the other m are never built
