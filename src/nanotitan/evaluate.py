"""`nanotitan eval`: the loss and perplexity of a run's checkpoint on a held-out set, on any layout.

    nanotitan eval --run.dir R [--step N] [--data.source S | --data.mix M] [--train.eval_batches N] [--parallel.* N]

The config is the checkpoint's own (its config.toml, resolved when it was saved) with the layout reset to one process,
then the flags applied: --parallel.dp/pp/ep/tp/cp name the layout the checkpoint is resharded onto (local ranks, or
torchrun's), as a resume reshards. The held-out set is the val split of the run's data, or of --data.source /
--data.mix encoded with the run's tokenizer (a source is prepared on first use, as `train` prepares; a mix's sources
must be prepared already). It is read as training's eval
reads it: train.eval_batches global batches of the run's size B (train.global_batch overrides it), the same n*B
sequences spread over the val file for every layout, each data rank taking its rows in microbatches of at most
train.micro_batch; the loss is training's eval (parallel/step.py `evaluate`: the mean cross-entropy of their
tokens, no balance loss), and so equals the val_loss a run logs at the same step.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch.distributed as dist

from .config.config import Config, ConfigError, ParallelConfig, load_config
from .config.parse import parse_mix, parse_overrides, set_value
from .data.prepare import prepared_dir
from .parallel.parallelize import parallelize
from .parallel.step import evaluate
from .resolve import resolve
from .run.setup import setup_rank
from .state import checkpoint as ckpt
from .state import manifest


def eval_config(run_dir: str | Path, step: int | None, overrides: list[str]) -> tuple[Config, Path]:
    """(the config an eval runs, resolved; the checkpoint it reads): module docstring."""
    path = manifest.saved_checkpoint(run_dir, step)
    run_cfg = load_config(path / "config.toml")
    cfg = load_config(path / "config.toml")
    given = {f"{s}.{k}" for s, k, _ in parse_overrides(overrides)}
    cfg.parallel = ParallelConfig()  # one process, unless the flags name a layout
    cfg.init.from_hf, cfg.train.resume, cfg.train.export_hf = "", "", ""  # the model keys are concrete; nothing trains
    cfg.train.compile = cfg.train.cuda_graphs = False  # a forward or two: compiling costs more than it saves
    for section, key, value in parse_overrides(overrides):
        set_value(cfg, section, key, value)
    if given & {"data.source", "data.mix"}:
        if "data.mix" not in given:
            cfg.data.mix = ""  # another source instead of the run's mix
        if "data.tokenizer" not in given and not run_cfg.data.tokenizer and first_source(cfg) != first_source(run_cfg):
            tokenizer = prepared_dir(run_cfg.data) / "tokenizer.json"  # the BPE the run trained: encode with it
            if not tokenizer.is_file():
                raise ConfigError(f"the run's tokenizer {tokenizer} is not in the data cache: prepare the run's data "
                                  f"again (nanotitan data prepare --config {path / 'config.toml'}), or give "
                                  "--data.tokenizer")
            cfg.data.tokenizer = str(tokenizer)
    B = cfg.train.global_batch if "train.global_batch" in given else run_cfg.layout_batch
    data_world = cfg.parallel.dp * cfg.parallel.ep
    if B < 1 or B % data_world:
        raise ConfigError(f"eval splits the global batch of B={B} sequences over parallel.dp*ep = {data_world} data "
                          f"ranks: choose a layout whose dp*ep divides {B} (or --train.global_batch)")
    b = B // data_world
    m = math.gcd(b, cfg.train.micro_batch)  # the run's micro_batch, or the largest divisor of b below it
    cfg.parallel.microbatches, cfg.train.micro_batch, cfg.train.global_batch = b // m, m, B
    return resolve(cfg), path  # validated there


def first_source(cfg: Config) -> str:
    """The source a config's own BPE is trained on: data.source, or data.mix's first."""
    return parse_mix(cfg.data.mix)[0][0] if cfg.data.mix else cfg.data.source


def evaluate_checkpoint(cfg: Config, path: Path) -> dict:
    """This rank's part of the eval (collective over the layout's ranks; a world of one on its own): the shard built,
    the checkpoint resharded into it, training's eval run. The same result on every rank."""
    rs = setup_rank(cfg)  # validates the layout against the world, opens the data, builds the groups
    shard = parallelize(cfg, rs.dims, rs.device)
    t = cfg.train
    try:
        extra = ckpt.load_checkpoint(path, shard.model, None, shard.dims, t.verify_ckpt, shard=shard)
        loss = evaluate(shard, rs.data.val_batches(t.eval_batches), t.micro_batch, rs.device, t.dtype)
    finally:
        shard.close()
    sequences = t.eval_batches * cfg.layout_batch
    return {"step": int(extra["step"]), "val_loss": loss, "perplexity": math.exp(min(loss, 700.0)),
            "sequences": sequences, "tokens": sequences * t.seq_len}


def eval_line(result: dict, cfg: Config, path: Path) -> str:
    """What `nanotitan eval` prints: one line."""
    p, d = cfg.parallel, cfg.data
    data = f"mix {d.mix!r}" if d.mix else repr(d.source)
    return (f"eval {path} (step {result['step']}) on the val split of {data}: val loss {result['val_loss']:.4f}, "
            f"perplexity {result['perplexity']:.2f} ({result['sequences']} sequences, {result['tokens']:,} tokens; "
            f"dp={p.dp} pp={p.pp} ep={p.ep} tp={p.tp} cp={p.cp})")


def eval_rank(cfg: Config, path: Path) -> None:
    """One rank of a multi-rank eval (torchrun's, or `nanotitan eval`'s own local ranks): rank 0 prints the line."""
    result = evaluate_checkpoint(cfg, path)
    if dist.is_initialized():
        if dist.get_rank() == 0:
            print(eval_line(result, cfg, path), flush=True)
        dist.barrier()
        dist.destroy_process_group()
