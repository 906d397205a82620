"""`nanotitan bench packed`: its windows hold documents of the asked mean length, and it prints both sides and their
ratio (tiny sizes here; the figures come from the default sizes on a quiet machine)."""

from nanotitan.bench import packed
from nanotitan.model.docs import doc_starts


def test_windows_cut_documents_of_the_asked_mean_length():
    S = 1 << 16
    for mean in (512, 2048):
        starts = doc_starts(packed.window(S, mean), packed.EOT)[0]
        docs = len(starts.unique())
        assert 0.7 < S / docs / mean < 1.4, (mean, S / docs)  # 32 or 128 draws of a geometric length


def test_the_bench_prints_each_shape_with_its_ratio(capsys):
    assert packed.main(["--seq", "256", "--mean", "32,128", "--reps", "1", "--heads", "2", "--head-dim", "16"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[:2] for r in rows] == [["256", "32"], ["256", "128"]]
    assert all(float(r[-1]) > 0 and float(r[-2]) > 0 for r in rows)
