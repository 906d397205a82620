"""What training shows on the console, on global rank 0: a progress bar on a terminal with run.progress, else one
plain line per record (a log file, Slurm's output, `run.progress false`), so a log is never empty.

    step    10/300 | loss 5.1234 | val loss 5.2001 | 12,345 tok/s | MFU 3.1% | lr 2.86e-03 | grad norm 0.812

A record is written every run.log_every steps, at the first and last steps and at every eval (train.eval_every), so
an eval's result prints as it happens: on its record's line, or above the bar.
"""

from __future__ import annotations

import math
import sys


def step_line(record: dict, total: int) -> str:
    """One record as a line: step, loss, val loss (an eval step's), tokens/s, MFU, lr and the grad norm."""
    parts = [f"step {record['step']:>{len(str(total))}}/{total}", f"loss {_num(record['loss'], '.4f')}"]
    if record.get("val_loss") is not None:
        parts.append(f"val loss {_num(record['val_loss'], '.4f')}")
    parts += [f"{record['tokens_per_sec']:,.0f} tok/s", f"MFU {100 * record['mfu']:.1f}%", f"lr {record['lr']:.2e}",
              f"grad norm {_num(record['grad_norm'], '.3f')}"]
    if record.get("skipped"):
        parts.append(f"update skipped ({record.get('skipped_steps', 1)} so far)")
    return " | ".join(parts)


def _num(x, fmt: str) -> str:
    return format(x, fmt) if x is not None and math.isfinite(x) else "nan"


class TrainConsole:
    """Rank 0's view of a run from `start` to `total` steps: `update(step, record)` after each step (record None on a
    step without one), `close()` at the end. Other ranks show nothing."""

    def __init__(self, total: int, start: int, is_main: bool, progress: bool):
        self.total, self.start, self.enabled = total, start, is_main
        self.bar = None
        self.val = ""  # the last eval's loss, kept on the bar until the next
        if is_main and progress and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=total - start, info="")
            self.bar.start()

    def update(self, step: int, record: dict | None) -> None:
        """Step `step` (1-based) is done; `record` is its record, if it wrote one."""
        if not self.enabled:
            return
        if self.bar is None:
            if record is not None:
                print(step_line(record, self.total), flush=True)
            return
        if record is None:
            self.bar.update(self.task, completed=step - self.start)
            return
        if record.get("val_loss") is not None:
            self.val = f" | val loss {_num(record['val_loss'], '.4f')}"
            self.bar.console.print(f"step {step}/{self.total} | eval: val loss {_num(record['val_loss'], '.4f')} "
                                   f"(train loss {_num(record['loss'], '.4f')})")
        info = (f"loss {_num(record['loss'], '.4f')}{self.val} | {record['tokens_per_sec']:,.0f} tok/s | "
                f"MFU {100 * record['mfu']:.1f}% | lr {record['lr']:.2e}")
        self.bar.update(self.task, completed=step - self.start, info=info)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
