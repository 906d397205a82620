"""The training loop, readable top to bottom: one rank of a DP x PP x EP x TP x CP job (or a single process).

    setup: identity -> validate -> threads, device, emulated links -> data -> process groups (run/setup.py)
           -> parallelize (shard, TP, EP, broadcasts, gradient sync) -> optimizer -> resume
    step:  LR -> this data rank's microbatches -> forward_backward -> finish grads -> clip -> agree -> optimizer
           step -> from the step's routing counts: router biases, the experts' placement, QK-clip, and on a record's
           step the losses and figures over the world (parallel/step.py: every collective of the step is there)
    loop:  step -> eval -> log -> checkpoint -> stop

How each step works in a given layout lives in parallel/ (parallelize.py builds, step.py runs); what the
user sees in observe/ (the record and the summary table: report.py; the step lines and the bar: console.py).
"""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import torch.distributed as dist

from .state import checkpoint as ckpt
from .observe import report
from .observe.console import TrainConsole
from .optim.qk_clip import QKClip
from .config.config import Config, to_toml
from .config.errors import TrainingError
from .observe.metrics import job_peak_flops
from .model.transformer import num_moe_layers
from .parallel.comm import stall
from .interop.hf import export_checkpoint, shard_loader
from .optim.build import build_optimizer
from .parallel.parallelize import parallelize
from .parallel.compile import graphs_step_begins
from .parallel.step import (StepEnd, StepResult, after_update, agree_on_step, clip_grads, evaluate, finish_grads,
                            replay_on_overflow,
                            forward_backward)
from .resolve import resolve
from .run.setup import resume_step, setup_rank


def lr_at(step: int, cfg: Config) -> float:
    """The learning rate of step (0-based), a pure function of it: linear warmup over train.warmup_steps, then
    train.lr_schedule: cosine decays from lr to lr * min_lr_ratio over the rest of train.steps; wsd holds lr (stable)
    until its last `wsd_decay_steps` steps, which decay on a cosine to lr * min_lr_ratio at the last step (DeepSeek-V3's
    and Kimi K2's shape); constant holds lr."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    if t.lr_schedule == "wsd":
        start = max(t.warmup_steps, t.steps - wsd_decay_steps(cfg))
        if step < start:
            return t.lr
        progress = min(1.0, (step + 1 - start) / max(1, t.steps - start))  # 1 at the last step: trained at the floor
    else:
        span = max(1, t.steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def wsd_decay_steps(cfg: Config) -> int:
    """train.lr_schedule=wsd: the steps of its decay, train.lr_decay_frac of train.steps (rounded, at least 1; the
    warmup is never cut: a decay longer than what follows it starts when it ends)."""
    return max(1, round(cfg.train.lr_decay_frac * cfg.train.steps))


def eval_due(step: int, cfg: Config) -> bool:
    """Whether step (0-based) ends with an eval on the fixed val batches (train.eval_every; 0: never)."""
    return bool(cfg.train.eval_every) and (step + 1) % cfg.train.eval_every == 0


class NonFiniteGuard:
    """train.on_nonfinite: "stop" at the first non-finite step, "skip" up to max_skips in a row. Every rank sees the
    same agreed flag, so every rank takes the same decision."""

    def __init__(self, policy: str, max_skips: int):
        self.policy, self.max_skips = policy, max_skips
        self.skipped, self.in_a_row = 0, 0

    def check(self, step: int, nonfinite: bool, log) -> str | None:
        """None to go on; else why to stop (the step made no update on any rank)."""
        if not nonfinite:
            self.in_a_row = 0
            return None
        self.skipped, self.in_a_row = self.skipped + 1, self.in_a_row + 1
        if self.policy == "stop":
            return f"step {step}: non-finite loss or grad norm"
        if self.in_a_row > self.max_skips:
            return (f"step {step}: non-finite loss or grad norm ({self.in_a_row} in a row > "
                    f"train.max_skips={self.max_skips})")
        log(f"step {step}: non-finite loss or grad norm, update skipped on every rank")
        return None

    @staticmethod
    def failure_line(failure: str, record: dict) -> str:
        """The TrainingError's line for a stop (`check`'s answer), with the step's record."""
        return (f"{failure} (loss {record['loss']:.4g}, grad norm {record['grad_norm']:.4g}); stopped without saving "
                "it (lower --train.lr, or --train.on_nonfinite skip)")


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg = resolve(cfg)  # concrete (resolve.py); the CLI hands over a config it resolved already
        t = cfg.train
        # --- this process: identity, threads, device, emulated links, data, process groups (run/setup.py) -------
        rs = setup_rank(cfg)
        self.rank, self.world, self.device, self.links, self.dims = rs.rank, rs.world, rs.device, rs.links, rs.dims
        self.data, self.B, self.is_main = rs.data, cfg.layout_batch, rs.rank == 0  # data: b = M*m of each step's B

        # --- this rank's shard, identical replicas, gradient sync; then the optimizer over the shard -----
        self.shard = parallelize(cfg, self.dims, self.device, shard_loader(cfg))
        self.model = self.shard.model
        stall.label_layers(self.model)  # a stalled collective is named with its layer ("layer 2, backward")
        self.optimizer = build_optimizer(self.shard, cfg)

        # --- bookkeeping ---------------------------------------------------------------------------------
        self.aux_weight = 1.0 / max(1, num_moe_layers(cfg.model))  # layer mean; each MoE layer weights its own terms
        self.step_end = StepEnd(self.shard, cfg, self.aux_weight, QKClip(self.shard, t.qk_clip))  # after each update
        self.peak_flops = job_peak_flops(self.device, t.dtype, t.threads, self.world, t.peak_flops)
        self.run_dir = Path(cfg.run.dir)
        # metrics.jsonl (+ TensorBoard, W&B) on rank 0, the profiler of run.profile_steps, the memory meters
        self.writer, self.profiler, self.meters = report.observers(cfg, self.rank, self.device, self.model)
        self.start_step, self.stop_requested, self.stop_cause = 0, False, ""
        if t.ckpt_on_signal:
            signal.signal(signal.SIGTERM, lambda signum, frame: self.request_stop("SIGTERM"))
        if t.resume not in ("", "never"):
            self.resume(t.resume)
        self.writer.start_run(to_toml(cfg), self.start_step)  # only once a resume has succeeded (rank 0)
        self.log(report.layout_line(cfg, self.shard.num_params(), self.peak_flops, self.links))

    def log(self, msg: str):
        if self.is_main:
            print(msg, flush=True)

    def request_stop(self, cause: str) -> None:
        """Stop after this step (all ranks agree, agree_on_step), saving with train.ckpt_on_signal; first cause kept."""
        self.stop_requested, self.stop_cause = True, self.stop_cause or cause

    def resume(self, where: str):
        optimizer = None if self.cfg.train.reset_optimizer else self.optimizer  # fresh state: weights and step only
        self.start_step = resume_step(where, self.cfg, self.shard, optimizer, self.data, lr_at, self.log)

    def save(self, step: int):
        t0 = time.perf_counter()
        path = ckpt.save_checkpoint(self.run_dir, step, self.model, self.optimizer, self.dims, self.cfg,
                                    {"step": step, "samples": step * self.B, **self.shard.checkpoint_extra()},
                                    self.cfg.train.keep_last, shard=self.shard, provenance=self.data.fingerprints)
        self.log(f"saved {path} in {time.perf_counter() - t0:.2f}s")

    def logs(self, step: int) -> bool:
        """The one rule for a record: the run's first and last steps, every run.log_every-th and every eval step
        (and a non-finite one, known at its end: `_step`)."""
        return (step + 1) % self.cfg.run.log_every == 0 or step in (self.start_step, self.cfg.train.steps - 1) \
            or eval_due(step, self.cfg)

    def train_step(self, step: int) -> StepResult:
        """One optimizer step, every collective of it issued here (parallel/step.py); non-finite and stop agreed by
        all ranks. The first two steps and every run.peak_every-th logged step are metered (memory.StepMeters)."""
        logged = self.logs(step)
        with self.meters.step(logged) as metered:
            with self.meters.host_syncs(metered):  # the step proper's host reads (observe/host_syncs.py)
                batch = self.data.batch(step)  # once: a replay (static EP dispatch) trains the same batch
                result = replay_on_overflow(lambda: self._step(step, metered, *batch), self.shard,
                                            self.cfg.parallel.ep_dispatch == "static", self.step_end.qk)
            # After the update, from the step's routing counts: router biases, the experts' placement, QK-clip; a step
            # that writes a record (a non-finite one too) gets its losses (means over all DP*EP*M microbatches),
            # router figures and the interval's step peak
            return self.step_end(step, result, self.optimizer, logged or result.nonfinite,
                                 self.meters.take_interval_peak, self.meters.take_interval_syncs)

    def _step(self, step: int, metered: bool, xs, ys, ds) -> StepResult:
        """One step on this rank's microbatches; ds: each one's document starts (model.attn_mask=doc) or None."""
        cfg = self.cfg
        # The learning rate is a pure function of the step: resume needs nothing else.
        lr = lr_at(step, cfg)
        graphs_step_begins(cfg)  # train.cuda_graphs: the previous step's graph outputs are dead
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g["lr_ratio"]  # each group's own lr on the same schedule (the optimizer declares it)
        # Forwards and backwards of this rank's microbatches; the gradient sync starts in the final backward.
        with self.meters.activations(metered):
            stats = forward_backward(self.shard, xs, ys, schedule=cfg.parallel.schedule, aux_weight=self.aux_weight,
                                     device=self.device, dtype=cfg.train.dtype, docs=ds,
                                     masked=cfg.data.format == "sft")  # SFT: normalised over the response tokens
        # Averaged gradients in .grad, clipped with the norm of the whole model (each element counted once).
        finish_grads(self.shard)
        grad_norm = clip_grads(self.shard, cfg.train.grad_clip)
        # Every rank agrees whether the step is finite (and whether to stop) before anyone updates.
        nonfinite, stop = agree_on_step(self.shard, grad_norm, self.stop_requested, self.device,
                                        signals=cfg.train.ckpt_on_signal)
        # The update (none for a non-finite step), then gradients zeroed (kept bound to the Reducer's buckets).
        if not nonfinite:
            self.optimizer.step()
        after_update(self.shard)
        return StepResult(stats, grad_norm, lr, nonfinite, stop)

    def train(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        logger = report.StepLogger(self.writer, self.shard, self.device, cfg, self.peak_flops, self.meters)
        guard = NonFiniteGuard(t.on_nonfinite, t.max_skips)
        if cfg.parallel.check_replicas and self.world > 1:  # debug: every rank raises if any replica differs
            self.shard.check_replicas()
            self.log("check_replicas: all replicas identical")
        console = TrainConsole(t.steps, self.start_step, self.is_main, cfg.run.progress)  # bar, or a line a record
        step = self.start_step
        for step in range(self.start_step, t.steps):
            self.profiler.step_begin(step + 1)
            t0 = time.perf_counter()
            result = self.train_step(step)
            logger.count(result, time.perf_counter() - t0)
            self.profiler.step_end(step + 1)
            failure = guard.check(step + 1, result.nonfinite, self.log)  # skip (no rank updated) or stop, after logging

            # --- eval on fixed val batches; the record of a step whose losses were reduced (`logs`) ----------
            val = self.evaluate() if eval_due(step, cfg) else None
            record = logger.log(step + 1, result, val, guard.skipped) if result.losses is not None else None
            console.update(step + 1, record)
            if failure is not None:
                console.close()
                self.writer.close()
                raise TrainingError(guard.failure_line(failure, record))

            # --- checkpoint / stop ---------------------------------------------------------------------------
            if t.ckpt_every and (step + 1) % t.ckpt_every == 0 or (result.stop and t.ckpt_on_signal):
                self.save(step + 1)
            if result.stop:  # agreed by every rank: its cause is known where it was asked (a peer's SIGTERM elsewhere)
                self.request_stop("by another rank")
                self.log(f"stop requested ({self.stop_cause}) at step {step + 1}")
                break
        console.close()
        final_step = step + 1 if t.steps > self.start_step else self.start_step
        if final_step == self.start_step:  # resumed at (or past) train.steps: the checkpoint is already the end
            self.log(f"nothing to train: resumed at step {final_step}, train.steps={t.steps} (raise --train.steps)")
        elif t.ckpt_at_end and not (t.ckpt_every and final_step % t.ckpt_every == 0) and not self.stop_requested:
            self.save(final_step)
        summary = report.run_summary(logger, self.profiler, self.writer, self.meters, self.model, self.optimizer,
                                     self.run_dir)
        return {"history": logger.history, "summary": summary}

    def evaluate(self) -> float:
        t = self.cfg.train
        return evaluate(self.shard, self.data.val_batches(t.eval_batches), t.micro_batch, self.device, t.dtype)

    def close(self, failed: bool = False):
        """Tear down. After a failure no collective runs: a peer may be dead or stopped, and a barrier would
        cost another parallel.timeout_s before this rank can exit and the launcher can name the cause."""
        self.shard.close()
        if dist.is_initialized():
            if not failed:
                dist.barrier()
            dist.destroy_process_group()


def run(cfg: Config, trainer: Trainer | None = None) -> dict:
    """Train (`trainer`, default a Trainer of `cfg`); the result says whether a signal or a planned membership
    change stopped it early ("stopped", after its checkpoint). Every failure tears the rank down without a
    collective. With train.export_hf, rank 0 then exports the final checkpoint (its global keys: any layout) alone,
    once every rank has left the process group."""
    trainer = trainer or Trainer(cfg)
    try:
        out = trainer.train()
    except BaseException:
        trainer.close(failed=True)
        raise
    trainer.close()
    if trainer.cfg.train.export_hf and trainer.is_main and not trainer.stop_requested:
        t0 = time.perf_counter()
        path = export_checkpoint(trainer.run_dir, trainer.cfg.train.export_hf)  # the newest: the final one
        trainer.log(f"exported the final checkpoint to {path} in {time.perf_counter() - t0:.1f}s (transformers)")
    return {**out, "stopped": trainer.stop_requested}
