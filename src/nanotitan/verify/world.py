"""One verify run of a config on its world: every rank trains a few steps with the real Trainer, its first step
recorded by `Capture` (capture.py), and hands back its boxes and each step's figures.

`run_world(cfg, steps)` starts the ranks (run/spawn.py: local gloo ranks, or NCCL's with a GPU each; the one-process
reference is a world of one) and returns their results in rank order; a rank's failure comes back as a `WorldFailed`
with its last line and traceback, a config error as the ConfigError it was.
"""

from __future__ import annotations

import contextlib
import io
import re
import time

from ..config.config import Config, ConfigError
from ..parallel.comm import fault as faults
from ..run import spawn
from ..train import Trainer
from .capture import Capture

# What a verify rank imports, preloaded once in the forkserver its ranks fork from (start_method="forkserver").
PRELOAD = ["nanotitan.train", "nanotitan.parallel.dp.fsdp", "nanotitan.verify.world"]


class WorldFailed(RuntimeError):
    """A rank of the run raised or died: `line` is its error's last line."""

    def __init__(self, line: str, detail: str):
        super().__init__(line)
        self.line, self.detail = line, detail


def figures(result) -> dict:
    """A step's figures as the record has them (observe/report.py: loss = ce + aux + mtp)."""
    losses = result.losses
    mtp = losses.mtp if losses is not None else None
    ce, aux = (losses.ce, losses.aux) if losses is not None else (None, None)
    return {"lr": result.lr, "ce": ce, "aux": aux, "mtp": mtp,
            "loss": None if ce is None else ce + aux + (mtp or 0.0), "grad_norm": float(result.grad_norm),
            "skipped": bool(result.nonfinite), "qk_max": result.qk_max}


def run_rank(rank: int, world: int, cfg: Config, steps: int, fault: str | None) -> dict:
    """One rank: build the Trainer, plant the fault (if asked: parallel/comm/fault.py), train `steps` steps with the
    first one captured. {"steps": [figures], "tensors": {key: (size, boxes)}, "order": [module], "sliced": [param]}"""
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer's own lines (layout, data, placement) stay out
        return _train(Trainer(cfg), cfg, steps, fault)


def _train(trainer, cfg: Config, steps: int, fault: str | None) -> dict:
    capture = Capture(trainer)
    planted = faults.plant(fault) if fault else None
    out = []
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            result = trainer.train_step(step)
            if step == 0:
                capture.finish(skipped=result.nonfinite, replayed=result.replayed)
            out.append({**figures(result), "seconds": time.perf_counter() - t0})
            if result.nonfinite and cfg.train.on_nonfinite == "stop":
                break
    finally:
        faults.unplant()
        capture.close()
        trainer.writer.close()
        trainer.shard.close()  # not trainer.close(): the world may run another case (tests share one)
    return {"steps": out, "tensors": capture.tensors, "order": capture.order, "sliced": capture.sliced,
            "fault": planted.planted if planted else "", "capture_s": capture.seconds}


def _ready(rank: int, world: int) -> None:
    return None


def start(start_method: str = "forkserver") -> None:
    """The ranks' server started and its imports done (a world of one that does nothing): timed apart from the runs."""
    if start_method == "forkserver":
        spawn.start_forkserver(PRELOAD)
        spawn.run_ranks(_ready, 1, timeout=600, start_method=start_method)


def run_cases(rank: int, world: int, cases: list[tuple[Config, int, str | None]]) -> list[dict]:
    """Several runs one after another on the same ranks (one process start for all: the tests')."""
    return [run_rank(rank, world, cfg, steps, fault) for cfg, steps, fault in cases]


def run_world(cfg: Config, steps: int, fault: str | None = None, start_method: str = "forkserver",
              timeout: float | None = None) -> list[dict]:
    """`run_rank` on cfg.world_size local ranks (gloo on CPU, NCCL with one GPU each on CUDA); their results in rank
    order. timeout: for the whole run (default: 10 minutes of start-up, then a collective's timeout per step)."""
    timeout = timeout or 600.0 + steps * cfg.parallel.timeout_s
    if start_method == "forkserver":
        spawn.start_forkserver(PRELOAD)
    try:
        return spawn.run_ranks(run_rank, cfg.world_size, (cfg, steps, fault), timeout=timeout,
                               pg_timeout=cfg.parallel.timeout_s, threads=cfg.train.threads, start_method=start_method,
                               backend="nccl" if cfg.train.device == "cuda" else "gloo")  # GPU r for rank r
    except TimeoutError as e:  # its first line names the ranks still running; their stacks follow
        raise WorldFailed(str(e).splitlines()[0], str(e)) from None
    except RuntimeError as e:
        raise failure(str(e)) from None


def failure(text: str) -> Exception:
    """A failed rank's message (run_ranks': its traceback) as the ConfigError it was, or a WorldFailed named by the
    traceback's last line (the exception)."""
    lines = [line for line in text.strip().splitlines() if line.strip()] or [text]
    config = [line for line in lines if re.match(r"\S*ConfigError: ", line)]
    if config:
        return ConfigError(config[-1].split("ConfigError: ", 1)[1])
    return WorldFailed(lines[-1][:300], text)
