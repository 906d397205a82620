"""`--run.profile_steps A-B`: torch.profiler traces of steps A..B on every rank, and a short table per rank.

    RUN_DIR/profile/rank_N.json           Chrome trace: open it in https://ui.perfetto.dev or chrome://tracing
    RUN_DIR/profile/tb/rank_N.*.json      the same file where TensorBoard's profiler plugin looks for it
                                          (pip install torch-tb-profiler; tensorboard --logdir RUN_DIR/profile/tb)
    RUN_DIR/profile/rank_N.txt            the table `close()` returns: time inside each axis's communication
                                          (the `record_function` labels of parallel/comm/) and the top operations

Steps are numbered as in metrics.jsonl (1-based: step 1 is the first optimizer step). The profiled steps run
slower than the others (record_shapes and profile_memory cost), so read throughput from the other steps.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

from ..config.parse import parse_steps  # run.profile_steps is parsed, and checked, with the config

# Labels parallel/comm/ puts on every collective: "DP all-reduce", "EP all-to-all", "PP send", "DP wait", ...
COMM_LABEL = re.compile(r"^(DP|EP|PP|OTHER) ")
STEP_LABEL = "ProfilerStep#"  # the name TensorBoard's plugin splits a trace into steps by
STEP_KEY = "ProfilerStep"  # key_averages() folds "ProfilerStep#N" into "ProfilerStep*"


class StepProfiler:
    """torch.profiler around steps A..B of one rank: `step_begin(step)` / `step_end(step)` around every step
    (cheap no-ops outside A..B), `close()` at the end returns this rank's table ('' if nothing was profiled)."""

    def __init__(self, spec: str, rank: int, run_dir: str | Path, device):
        self.range = parse_steps(spec)
        self.rank, self.device = rank, device
        self.dir = Path(run_dir) / "profile"
        self.prof = None  # the running torch.profiler.profile, between steps A and B
        self.step_fn = None  # the open ProfilerStep#N record_function
        self.table = ""

    def step_begin(self, step: int):
        if self.range is None or not self.range[0] <= step <= self.range[1]:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function

        if self.prof is None:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=activities, record_shapes=True, profile_memory=True)
            self.prof.start()
            self.t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's kernels, not the previous step's, land in it
        self.step_fn = record_function(f"{STEP_LABEL}{step}")
        self.step_fn.__enter__()

    def step_end(self, step: int):
        if self.step_fn is None:
            return
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        self.step_fn.__exit__(None, None, None)
        self.step_fn = None
        if step >= self.range[1]:
            self._finish(step)

    def close(self) -> str:
        """Stops a profile still running (the run ended inside A..B) and returns this rank's table."""
        if self.step_fn is not None:
            self.step_fn.__exit__(None, None, None)
            self.step_fn = None
        if self.prof is not None:
            self._finish(None)
        return self.table

    def _finish(self, last_step: int | None):
        prof, self.prof = self.prof, None
        prof.stop()
        wall = time.perf_counter() - self.t0
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"rank_{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        tb = self.dir / "tb"
        tb.mkdir(exist_ok=True)
        tb_trace = tb / f"rank_{self.rank}.{int(time.time() * 1000)}.pt.trace.json"  # the plugin's file name
        try:
            os.link(trace, tb_trace)  # same bytes, no second copy on disk
        except OSError:
            shutil.copyfile(trace, tb_trace)
        first = self.range[0]
        last = last_step if last_step is not None else first
        self.table = summarize(prof.key_averages(), self.rank, (first, last), wall, trace,
                               cuda=self.device.type == "cuda")
        (self.dir / f"rank_{self.rank}.txt").write_text(self.table + "\n")


def summarize(events, rank: int, steps: tuple[int, int], wall_s: float, trace: Path, cuda: bool = False,
              top: int = 10) -> str:
    """Per-step milliseconds inside each communication label (and per axis), and the top operations by self
    time, from a profiler's `key_averages()`."""
    step_evts = [e for e in events if e.key.startswith(STEP_KEY)]
    n_steps = max(1, sum(e.count for e in step_evts))
    step_ms = sum(e.cpu_time_total for e in step_evts) / 1e3 / n_steps or wall_s * 1e3 / n_steps
    comm = sorted((e for e in events if COMM_LABEL.match(e.key)), key=lambda e: -e.cpu_time_total)
    per_axis: dict[str, float] = {}
    for e in comm:
        axis = e.key.split()[0]
        per_axis[axis] = per_axis.get(axis, 0.0) + e.cpu_time_total / 1e3 / n_steps
    lines = [f"profile of rank {rank}, steps {steps[0]}-{steps[1]}: {step_ms:.1f} ms/step (profiled) -> {trace}",
             "  communication, ms/step inside the call (% of the step): "
             + ("  ".join(f"{a} {ms:.2f} ({100 * ms / step_ms:.0f}%)" for a, ms in per_axis.items()) or "none")]
    for e in comm:
        lines.append(f"    {e.key:<22} {e.count / n_steps:>6.1f} calls  {e.cpu_time_total / 1e3 / n_steps:>9.2f} ms")
    self_time = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    ops = sorted((e for e in events if not e.key.startswith(STEP_KEY) and not COMM_LABEL.match(e.key)),
                 key=lambda e: -self_time(e))[:top]
    lines.append(f"  top operations by self {'CUDA' if cuda else 'CPU'} time, per step:")
    for e in ops:
        lines.append(f"    {e.key[:40]:<40} {e.count / n_steps:>7.1f} calls  {self_time(e) / 1e3 / n_steps:>9.2f} ms")
    return "\n".join(lines)
