"""The training loop, readable top to bottom: one rank of a DP x PP x EP job (or a single process).

    setup: identity -> validate -> data -> process groups -> parallelize (shard, EP, broadcasts, gradient
           sync) -> optimizer -> resume
    step:  LR -> this data rank's microbatches -> forward_backward -> finish grads -> clip -> optimizer step
    loop:  step -> log / eval -> checkpoint -> stop

How each step works in a given layout lives in parallel/ (parallelize.py builds, step.py runs); what the
user sees (the record, the summary table, the progress bar) in report.py.
"""

from __future__ import annotations

import math
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .state import checkpoint as ckpt
from .state import manifest
from .observe import report
from .run.allocator import keep_freed_memory
from .config.config import Config, ConfigError, to_dict, to_toml, validate
from .data.indexed import IndexedBatches
from .data.prepare import load_meta, load_tokenizer, prepare_data
from .data.streaming import make_streaming_loader
from .config.errors import TrainingError
from .observe.memory import StepMeters, live_tensor_bytes
from .observe.metrics import MetricsWriter, job_peak_flops
from .model.transformer import flops_per_token, num_moe_layers
from .parallel import emulate, stall, step as S
from .parallel.dims import ParallelDims, init_distributed
from .parallel.parallelize import build_optimizer, parallelize, pick_device
from .observe.profiling import StepProfiler
from .config.resolve import resolve


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup, then cosine decay to lr * min_lr_ratio at the last step."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


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
            return f"step {step}: non-finite loss or grad norm ({self.in_a_row} in a row > train.max_skips={self.max_skips})"
        log(f"step {step}: non-finite loss or grad norm, update skipped on every rank")
        return None


def open_data(cfg: Config, dims: ParallelDims, b: int, log):
    """(train, val, stream): the prepared token files read by global index (DESIGN §4), and the seed's streaming
    loader when data.loader=streaming (HF streaming, split by data rank; else None). Prepared once: a file lock
    makes the other ranks wait."""
    t = cfg.train
    data_dir = prepare_data(cfg.data, log=log)
    meta = load_meta(data_dir)
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(f"tokenizer has {meta['vocab_size']} tokens > model.vocab_size={cfg.model.vocab_size} "
                          f"(--model.vocab_size {meta['vocab_size']})")
    train = IndexedBatches(data_dir / "train.bin", meta["dtype"], t.seq_len, t.seed)
    val = IndexedBatches(data_dir / "val.bin", meta["dtype"], t.seq_len, t.seed + 1)
    stream = None
    if cfg.data.loader == "streaming":
        stream = iter(make_streaming_loader(cfg, load_tokenizer(data_dir), dims.data_rank, dims.data_world, b,
                                            prepared=data_dir))
    return train, val, stream


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg = resolve(cfg)  # concrete (resolve.py); the CLI hands over a config it resolved already
        t, p = cfg.train, cfg.parallel
        # --- identity: torchrun sets these; a bare `python` run is a world of one -----------------------
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        validate(cfg, world_size=self.world)  # a bad layout fails here, before any process group exists
        self.is_main = self.rank == 0
        self.threads = t.threads or max(1, (os.cpu_count() or 1) // local_world)
        torch.set_num_threads(self.threads)
        keep_freed_memory()  # each step reuses the last one's host memory instead of faulting it in anew
        self.device = pick_device(cfg, int(os.environ.get("LOCAL_RANK", 0)))
        # parallel.emulate: from here on every collective and P2P is held to a modelled cluster's links
        # (parallel/emulate.py); None when off. Resolved before any process group, so a bad profile fails first.
        self.links = emulate.install(emulate.link_model(cfg, self.rank, self.threads, self.device.type))

        # --- data: this data rank's b = M*m sequences of each global batch of B ------------------------------
        self.dims = dims = ParallelDims(p.dp, p.pp, p.ep, rank=self.rank)
        self.M, self.m = p.microbatches, t.micro_batch
        self.b, self.B = self.M * self.m, cfg.layout_batch  # sequences per data rank / per step
        self.train_data, self.val_data, self.stream = open_data(cfg, dims, self.b, self.log)

        # --- process groups (every group built once, same order on every rank) -------------------------
        if self.world > 1:
            if not dist.is_initialized():
                init_distributed("nccl" if self.device.type == "cuda" else "gloo", self.rank, self.world,
                                 timedelta(seconds=p.timeout_s), self.device)
            dims.build_groups(timeout_s=p.timeout_s)

        # --- this rank's shard, identical replicas, gradient sync; then the optimizer over the shard -----
        self.shard = parallelize(cfg, dims, self.device)
        self.model = self.shard.model
        stall.label_layers(self.model)  # a stalled collective is named with its layer ("layer 2, backward")
        self.optimizer = build_optimizer(self.shard, cfg)

        # --- bookkeeping ---------------------------------------------------------------------------------
        self.tokens_per_step = self.B * t.seq_len
        self.aux_weight = 1.0 / max(1, num_moe_layers(cfg.model))  # layer mean; each MoE layer weights its own terms
        self.peak_flops = job_peak_flops(self.device, t.dtype, self.threads, self.world, t.peak_flops)
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len)
        self.run_dir = Path(cfg.run.dir)
        self.writer = MetricsWriter(str(self.run_dir), self.is_main, cfg.run.tensorboard, append=bool(t.resume),
                                    wandb_project=cfg.run.wandb_project if cfg.run.wandb else "", config=to_dict(cfg))
        self.profiler = StepProfiler(cfg.run.profile_steps, self.rank, self.run_dir, self.device)
        self.meters = StepMeters(self.model, self.device, cfg.run.peak_every)  # memory meters (some logged steps)
        self.start_step, self.stop_requested = 0, False
        if t.ckpt_on_signal:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        if t.resume:
            self.resume(t.resume)
        self.writer.start_run(to_toml(cfg), self.start_step)  # only once a resume has succeeded (rank 0)
        self.log(report.layout_line(cfg, dims.data_world, self.shard.num_params(), self.peak_flops, self.threads))
        if self.links is not None:
            self.log(self.links.describe())

    def log(self, msg: str):
        if self.is_main:
            print(msg, flush=True)

    def _on_sigterm(self, signum, frame):
        self.stop_requested = True

    def resume(self, where: str):
        verify = self.cfg.train.verify_ckpt
        # "auto", a step dir or a run dir: the newest checkpoint that verifies (skipped newer ones are named)
        path = manifest.resolve_resume(where, self.run_dir, verify=verify, log=self.log)
        if path is None:
            self.log("train.resume=auto: no complete checkpoint yet, starting from step 0")
            return
        self.start_step = int(ckpt.load_checkpoint(path, self.model, self.optimizer, self.dims, verify,
                                                  shard=self.shard)["step"])
        self.log(f"resumed from {path} at step {self.start_step}")

    def save(self, step: int):
        t0 = time.perf_counter()
        path = ckpt.save_checkpoint(self.run_dir, step, self.model, self.optimizer, self.dims, self.cfg,
                                    {"step": step, "samples": step * self.B}, self.cfg.train.keep_last,
                                    shard=self.shard)
        self.log(f"saved {path} in {time.perf_counter() - t0:.2f}s")

    def batch(self, step: int):
        """This data rank's M microbatches of global step `step`: rows [r*b, (r+1)*b) of the global batch,
        a pure function of (seed, step) (or the next ones of the streaming loader)."""
        x, y = next(self.stream) if self.stream is not None else \
            self.train_data.rank_batch(step, self.B, self.dims.data_rank, self.b)
        return S.split_microbatches(x, y, self.m, self.device)

    def train_step(self, step: int):
        """One optimizer step; returns (stats, grad norm, lr, non-finite, stop) — the last two agreed by all ranks.
        The first two steps and every run.peak_every-th logged step are metered (memory.StepMeters): the bytes
        autograd saves for backward, and the high-water mark of every live tensor over the whole step; both cost a
        Python call per tensor or op."""
        cfg = self.cfg
        logged = (step + 1) % cfg.run.log_every == 0 or step in (self.start_step, cfg.train.steps - 1)
        with self.meters.step(logged) as metered:
            return self._step(step, metered)

    def _step(self, step: int, metered: bool):
        cfg = self.cfg
        # The learning rate is a pure function of the step: resume needs nothing else.
        lr = lr_at(step, cfg)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        # Forwards and backwards of this rank's microbatches; the gradient sync starts in the final backward.
        xs, ys = self.batch(step)
        with self.meters.activations(metered):
            stats = S.forward_backward(self.shard, xs, ys, schedule=cfg.parallel.schedule,
                                       aux_weight=self.aux_weight, device=self.device, dtype=cfg.train.dtype)
        # Averaged gradients in .grad, clipped with the norm of the whole model (each element counted once).
        S.finish_grads(self.shard)
        grad_norm = S.clip_grads(self.shard, cfg.train.grad_clip)
        # Every rank agrees whether the step is finite (and whether to stop) before anyone updates.
        nonfinite, stop = S.agree_on_step(self.shard, grad_norm, self.stop_requested, self.device,
                                          signals=cfg.train.ckpt_on_signal)
        # The update (none for a non-finite step), then gradients zeroed (kept bound to the Reducer's buckets).
        if not nonfinite:
            self.optimizer.step()
        S.after_update(self.shard)
        S.update_router_bias(self.shard, apply=not nonfinite)  # aux-loss-free balancing: the step's global counts
        return stats, grad_norm, lr, nonfinite, stop

    def train(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        logger = report.StepLogger(self.writer, self.shard, self.device, M=self.M, schedule=cfg.parallel.schedule,
                                   tokens_per_step=self.tokens_per_step, flops_per_token=self.flops_per_token,
                                   peak_flops=self.peak_flops, aux_weight=self.aux_weight,
                                   virtual_stages=cfg.parallel.virtual_stages)
        guard = NonFiniteGuard(t.on_nonfinite, t.max_skips)
        if cfg.parallel.check_replicas and self.world > 1:
            assert self.shard.check_replicas(), "replicas differ after the initial broadcast"
            self.log("check_replicas: all replicas identical")
        progress = report.Progress(t.steps - self.start_step, enabled=self.is_main and cfg.run.progress)
        step = self.start_step
        # A record's step time is the mean over the steps since the previous record, so a metered step (memory
        # meters) and any one-off stall are averaged in, not reported alone.
        interval_s, interval_steps = 0.0, 0
        # Two EP lanes (parallel.ep_overlap_microbatches): the step's exposed EP wait and forward/backward overlap
        # (pp.StepStats), summed over the interval like the step time and logged as means per step.
        lanes = {"ep_exposed_s": 0.0, "lanes_overlap_s": 0.0} if self.shard.ep_lanes else None
        for step in range(self.start_step, t.steps):
            self.profiler.step_begin(step + 1)
            t0 = time.perf_counter()
            stats, grad_norm, lr, nonfinite, stop = self.train_step(step)
            interval_s, interval_steps = interval_s + time.perf_counter() - t0, interval_steps + 1
            if lanes is not None:
                for k in lanes:
                    lanes[k] += getattr(stats, k)
            self.profiler.step_end(step + 1)
            failure = guard.check(step + 1, nonfinite, self.log)  # skip (no rank updated) or stop, after logging

            # --- eval on fixed val batches; log: losses are means over all DP*EP*M microbatches -----------
            val = self.evaluate() if t.eval_every and (step + 1) % t.eval_every == 0 else None
            record = None
            if (step + 1) % cfg.run.log_every == 0 or step in (t.steps - 1, self.start_step) or val is not None \
                    or nonfinite:
                # The meters' figures when a metered step fell in the interval (the same steps on every rank, so
                # the peak's all-reduce is skipped alike), else absent from the record.
                peak = self.meters.take_interval_peak()
                record = logger.log(step + 1, stats, float(grad_norm), lr, interval_s / interval_steps, val_loss=val,
                                    skipped=nonfinite, skipped_steps=guard.skipped,
                                    act_peak_bytes=self.meters.take_interval_acts(),
                                    peak_tensor_bytes=None if peak is None else
                                    report.max_over_ranks(peak, self.dims, self.device),
                                    **({k: v / interval_steps for k, v in lanes.items()} if lanes is not None else {}))
                interval_s, interval_steps = 0.0, 0
                if lanes is not None:
                    lanes = dict.fromkeys(lanes, 0.0)
            progress.update(step + 1 - self.start_step, record)
            if failure is not None:
                progress.close()
                self.writer.close()
                raise TrainingError(f"{failure} (loss {record['loss']:.4g}, grad norm {record['grad_norm']:.4g}); "
                                    "stopped without saving it (lower --train.lr, or --train.on_nonfinite skip)")

            # --- checkpoint / stop ---------------------------------------------------------------------------
            if t.ckpt_every and (step + 1) % t.ckpt_every == 0 or (stop and t.ckpt_on_signal):
                self.save(step + 1)
            if stop:
                self.stop_requested = True
                self.log(f"stop requested (SIGTERM) at step {step + 1}")
                break
        progress.close()
        final_step = step + 1 if t.steps > self.start_step else self.start_step
        if t.ckpt_at_end and not (t.ckpt_every and final_step % t.ckpt_every == 0) and not self.stop_requested:
            self.save(final_step)
        profile = self.profiler.close()
        if profile:
            print(profile, flush=True)  # every rank its own table (torchrun prefixes the lines with [rankN]:)
        mem = {**live_tensor_bytes(self.model, self.optimizer), "act_peak_bytes": self.meters.act_peak_bytes,
               "peak_tensor_bytes": self.meters.peak_tensor_bytes}
        summary = report.gather_summary(logger.last, self.rank, self.dims, self.device, logger.wait_totals,
                                        self.run_dir, mem)
        self.writer.close()
        return {"history": logger.history, "summary": summary}

    def evaluate(self) -> float:
        t = self.cfg.train
        batches = self.val_data.eval_batches(t.eval_batches, self.B, self.dims.data_rank, self.b)
        return S.evaluate(self.shard, batches, self.m, self.device, t.dtype)

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
    collective."""
    trainer = trainer or Trainer(cfg)
    try:
        out = trainer.train()
    except BaseException:
        trainer.close(failed=True)
        raise
    trainer.close()
    return {**out, "stopped": trainer.stop_requested}
