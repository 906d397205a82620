"""What a crash leaves behind is cleaned, with a line (issue 27, item 3): a torn last line of metrics.jsonl is
dropped when the run resumes (the file is strict JSON lines again), `nanotitan plot` reads a run whose last line
is still being written, and step_N.tmp dirs of a save that never finished are removed when a job starts."""

from __future__ import annotations

import json
import re

import pytest

from nanotitan.config.config import ConfigError
from nanotitan.observe.metrics import MetricsWriter, drop_torn_tail
from nanotitan.observe.plot import read_records
from nanotitan.run.rundir import clean_stale_saves, owned_run_dir

GOOD = b'{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.5}\n'


@pytest.mark.parametrize("tail,dropped", [
    (b"", 0),                                   # nothing torn
    (b'{"step": 3, "lo', 15),                   # a crash mid-write: no newline
    (b"\x00\x00\x00\x00", 4),                   # a crash that left NUL bytes (delayed allocation)
    (b'{"step": 3, "lo\x00\x00\n', 18),         # torn, then a newline: not JSON either
    (b'{"step": 3, "x": "' + b"y" * 100_000, 100_018),  # longer than the window read from the end
])
def test_torn_last_line_is_dropped(tmp_path, tail, dropped):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(GOOD + tail)
    line = drop_torn_tail(path)
    assert path.read_bytes() == GOOD
    if dropped:
        assert line == (f"warning: {path}: dropped a torn last line ({dropped} bytes, from a crash mid-write); the "
                        "file is strict JSON lines again")
    else:
        assert line == ""
    assert drop_torn_tail(path) == ""  # idempotent


def test_a_file_that_is_one_torn_line_becomes_empty(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "lo')
    assert drop_torn_tail(path) and path.read_bytes() == b""
    assert drop_torn_tail(tmp_path / "missing.jsonl") == ""


def test_resumed_writer_drops_the_torn_line_and_says_so(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(GOOD + b'{"step": 3, "lo')
    w = MetricsWriter(str(run), True, False, append=True)
    w.write({"step": 3, "loss": 4.0})
    w.close()
    out = capsys.readouterr().out
    assert len(re.findall(r"dropped a torn last line \(15 bytes", out)) == 1, out
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    MetricsWriter(str(run), True, False, append=True).close()  # a clean file: nothing said
    assert "torn" not in capsys.readouterr().out


def test_plot_reads_a_run_whose_last_line_is_torn(tmp_path):
    """A run still writing (or one that crashed mid-line) plots what it has; a bad line before the last is
    refused in one line naming it."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(GOOD + b'{"step": 3, "lo')
    assert [r["step"] for r in read_records(run)] == [1, 2]
    (run / "metrics.jsonl").write_bytes(GOOD + b"\x00\x00\n")
    assert [r["step"] for r in read_records(run)] == [1, 2]
    (run / "metrics.jsonl").write_bytes(b'{"step": 1, "lo\n' + GOOD)
    with pytest.raises(ConfigError, match=rf"^{run}/metrics\.jsonl:1: not a JSON line \(.*\); every line of "
                                          r"metrics\.jsonl is one JSON object"):
        read_records(run)


def test_stale_tmp_saves_are_removed_at_start_with_a_line(tmp_path, monkeypatch):
    """Holding the run dir's lock, a job removes step_N.tmp (never resumed from); complete and incomplete step
    dirs stay (resume auto names an incomplete one when it skips it)."""
    monkeypatch.delenv("NANOTITAN_RUN_DIR_LOCK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    root = tmp_path / "run" / "checkpoints"
    for name in ("step_4", "step_6", "step_6.tmp", "step_8.tmp"):
        (root / name).mkdir(parents=True)
    (root / "step_4" / "COMPLETE").write_text("step 4\n")
    (root / "step_8.tmp" / "__0_0.distcp").write_bytes(b"partial")
    lines: list[str] = []
    with owned_run_dir(tmp_path / "run", "auto", False, log=lines.append):
        pass
    assert lines == [f"removed step_6.tmp, step_8.tmp from {root}: unfinished saves of an earlier job that stopped "
                     "mid-save"]
    assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_6"]
    assert clean_stale_saves(tmp_path / "run") == "" and clean_stale_saves(tmp_path / "nowhere") == ""
