"""One rank's process before its first step: who it is, its threads and device, the emulated network, its data and
its process groups, in the order that makes bad input fail before any process group exists (docs/design.md §5); then,
once
the shard is built, the checkpoint it resumes from. The Trainer's setup; every value it reads is concrete
(resolve.py), so nothing here chooses or measures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from .allocator import keep_freed_memory
from .resume import resume_changes
from ..config.config import Config, ConfigError, validate
from ..data.indexed import IndexedBatches
from ..data.mix import MixedBatches, open_split
from ..data.prepare import fingerprints, load_meta, load_tokenizer, mix_dirs, prepare_data
from ..data.streaming import make_streaming_loader
from ..model.docs import doc_starts
from ..parallel.comm import emulate
from ..parallel.dims import ParallelDims, init_distributed
from ..parallel.comm.emulate import LinkModel
from ..parallel.cp import doc_columns, seq_runs_of
from ..parallel.parallelize import ModelShard, pick_device
from ..parallel.step import split_microbatches
from ..state import checkpoint as ckpt
from ..state import manifest


@dataclass
class RankData:
    """This data rank's share of every global batch of B sequences: b = M*m of them (docs/design.md §4)."""
    train: IndexedBatches | MixedBatches
    val: IndexedBatches | MixedBatches
    stream: Iterator | None  # data.loader=streaming's batches of this data rank (None: the indexed files)
    dims: ParallelDims
    runs: list[tuple[int, int]]  # the positions of each sequence this rank reads (context parallel: its chunks)
    B: int  # sequences per step, dp*ep*M*m
    m: int  # sequences per microbatch
    device: torch.device
    fingerprints: dict[str, str]  # the data's and tokenizer's (data/prepare.py), recorded by every checkpoint
    eot: int | None = None  # model.attn_mask=doc: the separator its documents end at (None: causal windows)
    cp_split: str = "zigzag"  # parallel.cp_split: how CP cuts a window of documents (parallel/cp_split.py)

    @property
    def b(self) -> int:
        return self.B // self.dims.data_world

    def batch(self, step: int):
        """This data rank's M microbatches of global step `step`: rows [r*b, (r+1)*b) of the global batch,
        a pure function of (seed, step) (or the next ones of the streaming loader): (xs, ys, ds), ds each
        microbatch's document starts (model.attn_mask=doc), else None each."""
        if self.eot is None:
            x, y = next(self.stream) if self.stream is not None else \
                self.train.rank_batch(step, self.B, self.dims.data_rank, self.b, self.runs)
            return split_microbatches(x, y, self.m, self.device)
        # documents: the whole windows are read (the streaming loader yields them whole too), their starts found,
        # and then only this rank's positions kept
        x, y = next(self.stream) if self.stream is not None else \
            self.train.rank_batch(step, self.B, self.dims.data_rank, self.b)
        x, y, starts = self._positions(x, y)
        return split_microbatches(x, y, self.m, self.device, starts)

    def val_batches(self, n: int):
        """This data rank's rows of `n` fixed global batches of the val split (the same at every eval), with their
        document starts under model.attn_mask=doc."""
        if self.eot is None:
            return self.val.eval_batches(n, self.B, self.dims.data_rank, self.b, self.runs)
        return [self._positions(x, y) for x, y in self.val.eval_batches(n, self.B, self.dims.data_rank, self.b)]

    def _positions(self, x_BS, y_BS):
        """Whole windows -> (x, y) at this rank's positions, and the windows' document starts (B, S)."""
        starts_BS = doc_starts(x_BS, self.eot)
        if self.runs == [(0, x_BS.shape[1])]:
            return x_BS, y_BS, starts_BS
        cols_BS = doc_columns(self.dims, self.cp_split, starts_BS, self.m)  # each microbatch's own layout
        return x_BS.gather(1, cols_BS), y_BS.gather(1, cols_BS), starts_BS


@dataclass
class RankSetup:
    rank: int  # global rank (torchrun's RANK; a bare `python` run is a world of one)
    world: int
    device: torch.device
    links: LinkModel | None  # parallel.emulate's network, installed for every later collective (None: off)
    dims: ParallelDims  # with its groups built when world > 1
    data: RankData


def setup_rank(cfg: Config) -> RankSetup:
    """identity -> validate against the world -> threads, device, emulated links -> data -> process groups."""
    t, p = cfg.train, cfg.parallel
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    validate(cfg, world_size=world)  # a bad layout fails here, before any process group exists
    torch.set_num_threads(t.threads)
    keep_freed_memory()  # each step reuses the last one's host memory instead of faulting it in anew
    device = pick_device(t.device, int(os.environ.get("LOCAL_RANK", 0)))
    # parallel.emulate: from here on every collective and P2P is held to a modelled cluster's links
    # (parallel/comm/emulate.py); None when off.
    links = emulate.install(emulate.link_model(cfg, rank))
    dims = ParallelDims(p.dp, p.pp, p.ep, rank=rank, tp=p.tp, cp=p.cp)
    log = (lambda line: print(line, flush=True)) if rank == 0 else (lambda line: None)
    train, val, stream, prints, eot = open_data(cfg, dims, p.microbatches * t.micro_batch, log)
    if world > 1:  # every group built once, in the same order on every rank
        if not dist.is_initialized():
            init_distributed("nccl" if device.type == "cuda" else "gloo", rank, world, timedelta(seconds=p.timeout_s),
                             device)
        dims.build_groups(timeout_s=p.timeout_s)
    return RankSetup(rank, world, device, links, dims, RankData(train, val, stream, dims, seq_runs_of(dims, t.seq_len),
                                                                 cfg.layout_batch, t.micro_batch, device, prints, eot,
                                                                 p.cp_split))


def open_data(cfg: Config, dims: ParallelDims, b: int, log):
    """(train, val, stream, fingerprints, eot): the prepared token files read by global index (docs/design.md §4; with
    data.mix, its sources' blended, data/mix.py), the seed's streaming loader when data.loader=streaming (HF
    streaming, split by data rank; else None), the data's and tokenizer's fingerprints (what a checkpoint records),
    and under model.attn_mask=doc the EOT its documents end at (else None). Prepared once: a file lock makes the
    other ranks wait (a mix's sources are prepared ahead)."""
    t = cfg.train
    dirs = mix_dirs(cfg.data) if cfg.data.mix else [prepare_data(cfg.data, log=log)]  # a mix: its sources, prepared
    data_dir = dirs[0]  # the tokenizer's
    meta = load_meta(data_dir)
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(f"tokenizer has {meta['vocab_size']} tokens > model.vocab_size={cfg.model.vocab_size} "
                          f"(--model.vocab_size {meta['vocab_size']})")
    train = open_split(cfg.data, dirs, "train", t.seq_len, t.seed)
    val = open_split(cfg.data, dirs, "val", t.seq_len, t.seed + 1)
    stream, doc = None, cfg.model.attn_mask == "doc"
    if cfg.data.loader == "streaming":  # documents: whole windows, whose starts RankData finds
        stream = iter(make_streaming_loader(cfg, load_tokenizer(data_dir), dims.data_rank, dims.data_world, b,
                                            prepared=data_dir, runs=None if doc else seq_runs_of(dims, t.seq_len)))
    return train, val, stream, fingerprints(dirs, cfg.data.mix), meta["eot_id"] if doc else None


def resume_step(where: str, cfg: Config, shard: ModelShard, optimizer, data: RankData, lr_at, log) -> int:
    """train.resume: load "auto" (the newest checkpoint that verifies; skipped newer ones are named), a step dir or a
    run dir into the shard and its optimizer; the step to go on from (0 when "auto" finds none yet). First, what the
    resume changes is said (run/resume.py: config keys, data, the learning rate), and another tokenizer refused."""
    path = manifest.resolve_resume(where, cfg.run.dir, verify=cfg.train.verify_ckpt, log=log)
    if path is None:
        log("train.resume=auto: no complete checkpoint yet, starting from step 0")
        return 0
    lines, refusal = resume_changes(path, cfg, data.fingerprints, lr_at)
    for line in lines:
        log(line)
    if refusal:  # after the lines: what else changed is said too
        raise ConfigError(refusal)
    extra = ckpt.load_checkpoint(path, shard.model, optimizer, shard.dims, cfg.train.verify_ckpt, shard=shard)
    step = int(extra["step"])
    log(f"resumed from {path} at step {step}")
    shard.resumed(extra, optimizer)  # what the shard keeps beside its tensors (the placement's window), re-laid out
    return step
