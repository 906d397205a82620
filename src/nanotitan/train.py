"""The training loop, readable top to bottom: one rank of a DP x PP x EP job (or a single process).

    setup: process groups -> stage/expert shard of the model -> broadcasts -> reducers -> optimizer -> resume
    loop:  LR -> this data rank's microbatches -> forward_backward (the only PP branch) -> finish reducers
           -> clip over the whole model -> step -> log / eval / checkpoint

Equivalence (DESIGN §4): every rank backwards loss_mb / M; the reducers scale every gradient by
1 / (DP*EP) and sum it over the parameter's group: replicated parameters over the non-expert-DP group
(an average), expert shards over the expert-DP group (an average over DP and the seed's division by EP).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from . import checkpoint as ckpt
from .config import Config, ConfigError, to_toml, validate
from .data.indexed import IndexedBatches
from .data.prepare import load_meta, load_tokenizer, prepare_data
from .data.streaming import make_streaming_loader
from .metrics import MetricsWriter, device_peak_flops, fmt_bytes, peak_mem_bytes
from .model.spec import build_shard_spec
from .model.transformer import Transformer, flops_per_token, is_expert_param, num_moe_layers
from .parallel import comm
from .parallel.clip import clip_grad_norm_
from .parallel.dims import ParallelDims
from .parallel.dp import Reducer, wrap_ddp
from .parallel.ep import apply_ep
from .parallel.init import broadcast_params, check_replicas
from .parallel.pp import pipeline_forward, pipeline_forward_backward


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup, then cosine decay to lr * min_lr_ratio at the last step."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def pick_device(cfg: Config, local_rank: int) -> torch.device:
    want = cfg.train.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible (--train.device cpu)")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def build_optimizer(model: torch.nn.Module, cfg: Config, device: torch.device) -> torch.optim.AdamW:
    """AdamW; decay on matrices only. Fused: ~3x faster than the default on CPU (BASELINES)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2), fused=True)


def init_distributed(backend: str, rank: int, world: int, timeout: timedelta, device: torch.device) -> None:
    """init_process_group on torchrun's store, with every key namespaced by the restart attempt.

    After a rank dies and torchrun restarts the group, the new ranks would otherwise find the addresses
    their dead predecessors published and gloo would try to connect to closed ports (seen here: "Connection
    refused" two seconds into the restart, or a hang in new_group).
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the agent hosts the store
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_store, timeout=timeout, wait_for_workers=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"nanotitan/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        t, p = cfg.train, cfg.parallel
        # --- rank identity: torchrun sets these; a bare `python` run is a world of one ------------
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        validate(cfg, world_size=self.world)  # bad layout fails here, before any process group exists
        self.is_main = self.rank == 0
        threads = t.threads or max(1, (os.cpu_count() or 1) // local_world)
        torch.set_num_threads(threads)
        self.device = pick_device(cfg, self.local_rank)

        # --- data: prepared once (a file lock makes the other ranks wait), read by global index ----
        self.data_dir = prepare_data(cfg.data, log=self.log)
        meta = load_meta(self.data_dir)
        if meta["vocab_size"] > cfg.model.vocab_size:
            raise ConfigError(f"tokenizer has {meta['vocab_size']} tokens > model.vocab_size={cfg.model.vocab_size} "
                              f"(--model.vocab_size {meta['vocab_size']})")
        self.dims = ParallelDims(p.dp, p.pp, p.ep, rank=self.rank)  # coordinates only; groups below
        self.train_data = IndexedBatches(self.data_dir / "train.bin", meta["dtype"], t.seq_len, t.seed)
        self.val_data = IndexedBatches(self.data_dir / "val.bin", meta["dtype"], t.seq_len, t.seed + 1)
        self.stream = None
        if cfg.data.loader == "streaming":  # the seed's PackedTokenDataset: HF streaming, split by data rank
            self.stream = iter(make_streaming_loader(cfg, load_tokenizer(self.data_dir), self.dims.data_rank,
                                                     self.dims.data_world, p.microbatches * t.micro_batch,
                                                     prepared=self.data_dir))

        # --- process groups (every group built once, same order on every rank) --------------------
        if self.world > 1 and not dist.is_initialized():
            init_distributed("nccl" if self.device.type == "cuda" else "gloo", self.rank, self.world,
                             timedelta(seconds=p.timeout_s), self.device)
        if self.world > 1:
            self.dims.build_groups(timeout_s=p.timeout_s)
        dims = self.dims

        # --- this rank's shard of the model ----------------------------------------------------------
        self.spec = build_shard_spec(cfg, dims.pp_rank, dims.ep_rank)
        self.model = Transformer(cfg.model, self.spec, seed=t.seed).to(self.device)
        self.model.activation_checkpointing = t.activation_checkpointing
        apply_ep(self.model, dims)
        named = list(self.model.named_parameters())
        self.expert_params = [(n, q) for n, q in named if is_expert_param(n)]
        self.replicated_params = [(n, q) for n, q in named if not is_expert_param(n)]

        # --- identical replicas: init by global identity, then broadcast from each group's first rank -
        if self.world > 1:
            broadcast_params(self.replicated_params, dims.group_ranks("non_expert_dp")[0],
                             dims.group("non_expert_dp"))
            broadcast_params(self.expert_params, dims.group_ranks("expert_dp")[0], dims.group("expert_dp"))

        # --- gradient reducers: both scale by 1/(DP*EP) and sum over their group -----------------------
        scale = 1.0 / dims.data_world
        self.ddp = None
        if p.dp_impl == "torch_ddp" and self.world > 1:
            self.ddp = wrap_ddp(self.model, dims.group("non_expert_dp"), p.bucket_mb)
            self.reducers = []
        else:
            self.reducers = [Reducer(params, dims.group(kind), p.bucket_mb, scale)
                             for params, kind in ((self.replicated_params, "non_expert_dp"),
                                                  (self.expert_params, "expert_dp")) if params]
        self.optimizer = build_optimizer(self.model, cfg, self.device)

        # --- bookkeeping ----------------------------------------------------------------------------
        self.M, self.m, self.S = p.microbatches, t.micro_batch, t.seq_len
        self.b = self.M * self.m  # sequences per data rank per step
        self.B = cfg.global_batch
        self.tokens_per_step = self.B * self.S
        self.n_moe = num_moe_layers(cfg.model)
        self.aux_weight = cfg.model.aux_coef / max(1, self.n_moe)
        peak_rank = t.peak_flops or device_peak_flops(self.device, t.dtype, threads)
        # On CPU, ranks beyond the cores share them: the machine's peak, not world x a rank's, bounds MFU.
        ranks_at_peak = (self.world if self.device.type == "cuda"
                         else max(1, min(self.world, (os.cpu_count() or 1) // threads)))
        self.peak_flops_total = peak_rank * ranks_at_peak
        self.flops_per_token = flops_per_token(cfg.model, self.S)
        self.run_dir = Path(cfg.run.dir)
        self.writer = MetricsWriter(str(self.run_dir), self.is_main, cfg.run.tensorboard, append=bool(t.resume))
        self.start_step = 0
        self.stop_requested = False
        if t.ckpt_on_signal:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(to_toml(cfg))
        if t.resume:
            self.resume(t.resume)
        self.log(f"layout dp={p.dp} pp={p.pp} ep={p.ep} | B={self.B} seqs = dp*ep*M*m = "
                 f"{dims.data_world}*{self.M}*{self.m} | {self.tokens_per_step} tokens/step | "
                 f"params on rank 0: {sum(q.numel() for _, q in named) / 1e6:.2f}M | "
                 f"peak {self.peak_flops_total / 1e9:.0f} GFLOP/s | threads/rank {threads}")

    # ------------------------------------------------------------------------------------------------
    def log(self, msg: str):
        if self.is_main:
            print(msg, flush=True)

    def _on_sigterm(self, signum, frame):
        self.stop_requested = True

    def resume(self, where: str):
        path = ckpt.resolve_resume(where, self.run_dir)  # "auto", a step dir or a run dir (its newest)
        if path is None:
            self.log("train.resume=auto: no complete checkpoint yet, starting from step 0")
            return
        extra = ckpt.load_checkpoint(path, self.model, self.optimizer, self.dims)
        self.start_step = int(extra["step"])
        self.log(f"resumed from {path} at step {self.start_step}")

    def save(self, step: int):
        t0 = time.perf_counter()
        path = ckpt.save_checkpoint(self.run_dir, step, self.model, self.optimizer, self.dims, self.cfg,
                                    {"step": step, "samples": step * self.B}, self.cfg.train.keep_last)
        self.log(f"saved {path} in {time.perf_counter() - t0:.2f}s")

    def microbatches(self, x: torch.Tensor, y: torch.Tensor):
        """This data rank's b rows -> M microbatches of m sequences."""
        x, y = x.to(self.device), y.to(self.device)
        return list(x.split(self.m)), list(y.split(self.m))

    # ------------------------------------------------------------------------------------------------
    def forward_backward(self, step: int):
        """Forward and backward of this rank's M microbatches; the only place that knows about PP."""
        if self.stream is not None:
            xs, ys = self.microbatches(*next(self.stream))
        else:  # rows [r*b, (r+1)*b) of global step `step`'s batch, a pure function of (seed, step)
            xs, ys = self.microbatches(*self.train_data.rank_batch(step, self.B, self.dims.data_rank, self.b))
        cfg = self.cfg
        amp = (torch.autocast("cuda", dtype=torch.bfloat16) if cfg.train.dtype == "bf16" and self.device.type == "cuda"
               else contextlib.nullcontext())
        if self.ddp is not None:  # torch DDP baseline: pure DP, no_sync on all but the last microbatch
            ce_sum = torch.zeros((), device=self.device)
            aux_sum = torch.zeros((), device=self.device)
            for i, (x, y) in enumerate(zip(xs, ys)):
                sync = contextlib.nullcontext() if i == self.M - 1 else self.ddp.no_sync()
                with sync, amp:
                    ce, aux = self.ddp(x, y)
                    ((ce + self.aux_weight * aux) / self.M).backward()
                ce_sum += ce.detach()
                aux_sum += aux.detach()
            return ce_sum, aux_sum, None

        def before_backward(is_last: bool):
            for r in self.reducers:
                r.prepare(sync=is_last)

        with amp:
            stats = pipeline_forward_backward(
                self.model, self.dims, xs, ys, schedule=cfg.parallel.schedule, aux_weight=self.aux_weight,
                loss_scale=1.0 / self.M, before_backward=before_backward,
                act_shape=(self.m, self.S, cfg.model.d_model), dtype=torch.float32, device=self.device)
        return stats.ce_sum, stats.aux_sum, stats

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean val CE over fixed batches, forward only through the pipeline (no aux term)."""
        self.model.eval()
        t, dims = self.cfg.train, self.dims
        total = torch.zeros((), device=self.device)
        for xb, yb in self.val_data.eval_batches(t.eval_batches, self.B, dims.data_rank, self.b):
            xs, ys = self.microbatches(xb, yb)
            ce_sum, _ = pipeline_forward(self.model, dims, xs, ys, act_shape=(self.m, self.S, self.cfg.model.d_model),
                                         dtype=torch.float32, device=self.device)
            if ce_sum is not None:  # last stage
                total += ce_sum
        self.model.train()
        self.model.expert_load.clear()
        if self.world > 1:
            comm.all_reduce(total, axis="other")  # only last-stage ranks contribute
        return total.item() / (t.eval_batches * self.M * dims.data_world)

    def expert_load_stats(self) -> dict:
        """Tokens per expert per MoE layer over the logged steps, summed over every data rank."""
        cfg = self.cfg.model
        load = torch.zeros(cfg.n_layers, cfg.num_experts, device=self.device)
        for key, counts in self.model.expert_load.items():
            load[int(key)] = counts.float()
        self.model.expert_load.clear()
        if self.world > 1:
            comm.all_reduce(load, axis="other")
        moe_rows = load[[i for i in range(cfg.n_layers) if i % cfg.moe_every == 0]]
        mean = moe_rows.mean(dim=1).clamp_min(1e-9)
        imbalance = (moe_rows.max(dim=1).values / mean)
        return {"expert_load": moe_rows.long().tolist(),
                "expert_load_min": int(moe_rows.min().item()),
                "expert_load_max": int(moe_rows.max().item()),
                "expert_imbalance": round(float(imbalance.max().item()), 4)}

    # ------------------------------------------------------------------------------------------------
    def train(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        dims = self.dims
        history = []
        last_record = {}
        comm.COMM.reset()
        wait_totals = {a: 0.0 for a in comm.AXES}
        if cfg.parallel.check_replicas and self.world > 1:
            ok = check_replicas(self.replicated_params, dims.group("non_expert_dp")) and \
                check_replicas(self.expert_params, dims.group("expert_dp"))
            assert ok, "replicas differ after the initial broadcast"
            self.log("check_replicas: all replicas identical")
        progress = _Progress(t.steps - self.start_step, enabled=self.is_main and cfg.run.progress)
        step = self.start_step
        for step in range(self.start_step, t.steps):
            t0 = time.perf_counter()
            # --- learning rate: a pure function of the step (resume needs nothing else) ---------------
            lr = lr_at(step, cfg)
            for g in self.optimizer.param_groups:
                g["lr"] = lr

            # --- forward + backward over M microbatches, gradient sync launched on the last one -------
            ce_sum, aux_sum, stats = self.forward_backward(step)
            for r in self.reducers:
                r.finish()  # averaged gradients are in .grad

            # --- clip with the norm of the whole model (PP and EP shards counted once) ----------------
            grad_norm = clip_grad_norm_([q for _, q in self.expert_params], [q for _, q in self.replicated_params],
                                        t.grad_clip, dims.group("pp"), dims.group("ep"))

            # --- optimizer step ---------------------------------------------------------------------
            self.optimizer.step()
            if self.reducers:
                for r in self.reducers:
                    r.zero_grad()
            else:
                self.optimizer.zero_grad(set_to_none=False)
            step_time = time.perf_counter() - t0

            # --- log: loss is the mean over all DP*EP*M microbatches (CE from the last stage) ---------
            # --- periodic eval on the val split (its loss goes into this step's record) ----------------
            is_eval = t.eval_every and (step + 1) % t.eval_every == 0
            val = self.evaluate() if is_eval else None
            is_log = (step + 1) % cfg.run.log_every == 0 or step == t.steps - 1 or step == self.start_step or is_eval
            if is_log:
                vals = torch.stack([ce_sum if ce_sum is not None else torch.zeros_like(aux_sum), aux_sum])
                if self.world > 1:
                    comm.all_reduce(vals, axis="other")
                n_mb = self.M * dims.data_world
                ce_loss = vals[0].item() / n_mb
                aux_loss = self.aux_weight * vals[1].item() / n_mb
                cstats = comm.COMM.snapshot_and_reset()
                for a in comm.AXES:
                    wait_totals[a] += cstats[f"comm_{a}_wait_s"]
                tok_s = self.tokens_per_step / step_time
                record = {
                    "step": step + 1, "loss": ce_loss + aux_loss, "ce_loss": ce_loss, "aux_loss": aux_loss,
                    "grad_norm": float(grad_norm), "lr": lr, "tokens_per_sec": tok_s, "step_time_s": step_time,
                    "mfu": self.flops_per_token * tok_s / self.peak_flops_total,
                    "peak_mem_bytes": peak_mem_bytes(self.device),
                    "dp": dims.dp, "pp": dims.pp, "ep": dims.ep, "microbatches": self.M,
                    "schedule": cfg.parallel.schedule if dims.pp > 1 else "none",
                    "tokens": (step + 1) * self.tokens_per_step, **cstats,
                }
                if stats is not None and dims.pp > 1:
                    busy = stats.compute_s + stats.p2p_wait_s
                    record["bubble_measured"] = stats.p2p_wait_s / busy if busy > 0 else 0.0
                    record["bubble_theory"] = (dims.pp - 1) / (self.M + dims.pp - 1)
                record.update(self.expert_load_stats())
                if val is not None:
                    record["val_loss"] = val
                self.writer.write(record)
                history.append(record)
                last_record = record
                progress.update(step + 1 - self.start_step, record)
            else:
                progress.update(step + 1 - self.start_step, None)

            # --- checkpoint / stop -----------------------------------------------------------------------
            stop = self._should_stop()
            if t.ckpt_every and (step + 1) % t.ckpt_every == 0 or (stop and t.ckpt_on_signal):
                self.save(step + 1)
            if stop:
                self.log(f"stop requested (SIGTERM) at step {step + 1}")
                break
        progress.close()
        final_step = step + 1 if t.steps > self.start_step else self.start_step
        if t.ckpt_at_end and not (t.ckpt_every and final_step % t.ckpt_every == 0) and not self.stop_requested:
            self.save(final_step)
        summary = self.summary(last_record, wait_totals)
        self.writer.close()
        return {"history": history, "summary": summary}

    def _should_stop(self) -> bool:
        if not self.cfg.train.ckpt_on_signal:
            return False
        flag = torch.tensor([1.0 if self.stop_requested else 0.0])
        if self.world > 1:
            comm.all_reduce(flag, op=dist.ReduceOp.MAX, axis="other")
        self.stop_requested = bool(flag.item())
        return self.stop_requested

    def summary(self, last: dict, wait_totals: dict) -> dict:
        """Per-rank peak memory and communication waits, gathered to rank 0 and printed as a table."""
        mine = {"rank": self.rank, "coords": self.dims.coords(), "peak_mem_bytes": peak_mem_bytes(self.device),
                **{f"wait_{a}_s": round(v, 3) for a, v in wait_totals.items()}}
        rows = [mine]
        if self.world > 1:
            rows = [None] * self.world
            dist.all_gather_object(rows, mine)
        summary = {"last": last, "ranks": rows}
        if self.is_main and last:
            _print_summary(last, rows)
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary

    def close(self):
        if self.ddp is not None:
            del self.ddp  # DDP must go before the process group (BASELINES: SIGABRT otherwise)
            self.ddp = None
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _print_summary(last: dict, rows: list[dict]):
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"nanoTitan summary — step {last['step']}, layout dp={last['dp']} pp={last['pp']} ep={last['ep']}")
    for col in ("loss", "val loss", "tokens/s", "MFU", "step time"):
        t.add_column(col)
    t.add_row(f"{last['loss']:.4f}", f"{last.get('val_loss', float('nan')):.4f}", f"{last['tokens_per_sec']:.0f}",
              f"{100 * last['mfu']:.1f}%", f"{last['step_time_s'] * 1000:.0f} ms")
    console.print(t)
    r = Table(title="per rank (wait = time blocked in communication, whole run)")
    for col in ("rank", "(dp, pp, ep)", "peak mem", "DP all-reduce", "EP all-to-all", "PP send/recv", "other"):
        r.add_column(col)
    for row in rows:
        r.add_row(str(row["rank"]), str(tuple(row["coords"])), fmt_bytes(row["peak_mem_bytes"]),
                  f"{row['wait_dp_s']:.2f} s", f"{row['wait_ep_s']:.2f} s", f"{row['wait_pp_s']:.2f} s",
                  f"{row['wait_other_s']:.2f} s")
    console.print(r)


class _Progress:
    """A rich progress bar with loss and tokens/s on rank 0 (plain lines when not a terminal)."""

    def __init__(self, total: int, enabled: bool):
        self.enabled, self.total = enabled, total
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        self.task = self.bar.add_task("train", total=total, info="")
        self.bar.start()

    def update(self, done: int, record: dict | None):
        if not self.enabled:
            return
        if record is not None:
            info = f"loss {record['loss']:.4f} | {record['tokens_per_sec']:.0f} tok/s | mfu {100 * record['mfu']:.1f}%"
            self.bar.update(self.task, completed=done, info=info)
            if not self.bar.console.is_terminal:
                self.bar.console.print(f"step {record['step']:>5} | {info} | lr {record['lr']:.2e}")
        else:
            self.bar.update(self.task, completed=done)

    def close(self):
        if self.enabled:
            self.bar.stop()


def run(cfg: Config) -> dict:
    trainer = Trainer(cfg)
    try:
        return trainer.train()
    finally:
        trainer.close()
