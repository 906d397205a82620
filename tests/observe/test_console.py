"""The console of a run (observe/console.py): one plain line per record whenever the bar is off or stdout is not a
terminal, val loss on an eval's line; on a terminal the bar keeps the last val loss and each eval prints above it."""

import io
import re

from nanotitan.observe import console as console_mod
from nanotitan.observe.console import TrainConsole, step_line

RECORD = {"step": 10, "loss": 5.12345, "tokens_per_sec": 12345.6, "mfu": 0.031, "lr": 2.86e-3, "grad_norm": 0.8123}


def test_a_record_is_one_line_with_every_figure():
    assert step_line(RECORD, 300) == ("step  10/300 | loss 5.1235 | 12,346 tok/s | MFU 3.1% | lr 2.86e-03 | "
                                      "grad norm 0.812")
    evaluated = step_line({**RECORD, "val_loss": 5.2, "grad_norm": float("nan")}, 300)
    assert evaluated == ("step  10/300 | loss 5.1235 | val loss 5.2000 | 12,346 tok/s | MFU 3.1% | lr 2.86e-03 | "
                         "grad norm nan")
    assert step_line({**RECORD, "skipped": True, "skipped_steps": 2}, 300).endswith("| update skipped (2 so far)")


def test_plain_lines_without_a_terminal_or_with_the_bar_off(capsys, monkeypatch):
    for progress in (True, False):  # pytest's stdout is no terminal: the bar is never drawn
        c = TrainConsole(300, 0, is_main=True, progress=progress)
        c.update(9, None)
        c.update(10, RECORD)
        c.close()
        assert capsys.readouterr().out == step_line(RECORD, 300) + "\n"
    quiet = TrainConsole(300, 0, is_main=False, progress=False)  # other ranks show nothing
    quiet.update(10, RECORD)
    assert capsys.readouterr().out == ""


def test_on_a_terminal_the_bar_shows_val_loss_and_evals_print_above_it(monkeypatch):
    monkeypatch.setattr(console_mod.sys.stdout, "isatty", lambda: True, raising=False)
    c = TrainConsole(300, 0, is_main=True, progress=True)
    out = io.StringIO()
    c.bar.console.file = out  # what the bar's console prints above the bar
    c.update(10, {**RECORD, "val_loss": 5.2})
    c.update(20, {**RECORD, "step": 20})
    info = c.bar.tasks[0].fields["info"]
    c.close()
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # rich's colours
    assert "step 10/300 | eval: val loss 5.2000 (train loss 5.1235)" in shown
    assert info.startswith("loss 5.1235 | val loss 5.2000 | 12,346 tok/s | MFU 3.1% | lr 2.86e-03")
