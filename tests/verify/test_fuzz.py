"""The slow tier's fuzz: `nanotitan verify --fuzz` on a fixed seed (CI, <= 5 min on 2 cores): every case drawn from
the composition space passes or is refused by a row of the refusal table (docs/verify.md), and a resumed run skips
what its log holds. Cost: 12 cases (10 run: 3 one-process references, 2-8 ranks each), ~3 min."""

import json

import pytest

from nanotitan.verify import fuzz

SEED, CASES = 7, 12


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_fixed_seed_passes_or_is_refused_by_a_known_rule(corpus_dir, tmp_path):
    log = tmp_path / "fuzz.jsonl"
    seen = []
    entries = fuzz.fuzz(CASES, SEED, None, ["--data.source", str(corpus_dir)], str(log), say=seen.append)
    table = "\n".join(fuzz.table(entries))
    assert len(entries) == CASES and len(seen) == CASES, table
    assert all(e["result"] in ("passed", "refused") for e in entries), table
    assert all(e["reason"] != "other" for e in entries if e["result"] == "refused"), table
    assert sum(e["result"] == "passed" for e in entries) >= CASES // 2, table
    # the log holds every case: a second run has nothing left to do, and reports the same table
    again = fuzz.fuzz(CASES, SEED, None, ["--data.source", str(corpus_dir)], str(log), say=seen.append)
    assert len(seen) == CASES and again == entries
    assert [json.loads(line)["index"] for line in log.read_text().splitlines()] == list(range(CASES))


def test_every_refusal_row_is_in_the_docs():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "verify.md").read_text()
    missing = [key for key, *_ in fuzz.REFUSALS if f"`{key}`" not in doc]
    assert not missing, f"docs/verify.md's refusal table lacks {missing}"
