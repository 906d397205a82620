"""The FP8 equivalence matrix's longest launch (slow tier), in a file of its own so that it runs on one pytest worker
while test_equivalence_fp8.py's run on the other: 2 ranks run DP2 zero 3, Muon at DP2 zero 1 and balanced placement
at EP2 at rowwise, DP2 zero 1 at tensorwise, EP2 at rowwise resumed from one process's fp8-off checkpoint, and at
both recipes TP2 with SP, CP2 ring, and EP2 and DP2 zero 3 with parallel.fp8_comm (against one process with it),
plus the planted TP2 row (the bar must catch it). The rows and the bar: tests/helpers/fp8_rows.py."""

import pytest

from tests.helpers.fp8_rows import WORLD2_SLOW, matrix, refs, run_root  # noqa: F401  (the fixtures)

pytest.importorskip("torchao")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fp8_rows_more(corpus_dir, run_root, refs):  # noqa: F811
    matrix(2, WORLD2_SLOW, corpus_dir, run_root, refs, timeout=1500)
