"""One verify run of a config on its world: every rank trains a few steps with the real Trainer, its first step
recorded by `Capture` (capture.py), and hands back its boxes and each step's figures.

`run_world(cfg, steps)` starts the ranks (run/spawn.py: local gloo ranks; the one-process reference is a world of
one) and returns their results in rank order; a rank's failure comes back as a `WorldFailed` with its last line,
a config error as the ConfigError it was.
"""

from __future__ import annotations

import contextlib
import io
import re
import time

from ..config.config import Config, ConfigError
from ..parallel.comm import fault as faults
from ..run import spawn
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
    from ..train import Trainer

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
                capture.finish(skipped=result.nonfinite)
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
              timeout: float = 900.0) -> list[dict]:
    """`run_rank` on cfg.world_size local ranks (gloo on CPU, NCCL with one GPU each on CUDA); their results in rank
    order."""
    return launch(run_rank, cfg.world_size, (cfg, steps, fault), cfg, start_method, timeout)


def launch(fn, world: int, args: tuple, cfg: Config, start_method: str, timeout: float) -> list:
    if start_method == "forkserver":
        spawn.start_forkserver(PRELOAD)
    try:
        return spawn.run_ranks(fn, world, args, timeout=timeout, pg_timeout=cfg.parallel.timeout_s,
                               threads=cfg.train.threads, start_method=start_method,
                               backend="nccl" if cfg.train.device == "cuda" else "gloo")  # GPU r for rank r
    except (RuntimeError, TimeoutError) as e:
        raise failure(str(e)) from None


def failure(text: str) -> Exception:
    """A rank's failure (run_ranks' message with its traceback) as the ConfigError it was, or a WorldFailed."""
    lines = [l for l in text.strip().splitlines() if l.strip()]
    config = [l for l in lines if re.match(r"\S*ConfigError: ", l)]
    if config:
        return ConfigError(config[-1].split("ConfigError: ", 1)[1])
    last = lines[-1] if lines else text
    return WorldFailed(last if len(lines) > 1 else lines[0][:300] if lines else text, text)
