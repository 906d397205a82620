"""Typed configuration: TOML file + dotted CLI overrides, validated before anything runs.

Every user-facing error is a `ConfigError` whose message is one line naming the field and the fix,
e.g. "model.top_k=5 must be <= model.num_experts=4 (--model.top_k)".
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal


class ConfigError(ValueError):
    """Bad user input: one line naming the field and the fix."""


@dataclass(kw_only=True)
class ModelConfig:
    vocab_size: int = 0  # 0 = take it from data.vocab_size (the tokenizer's size)
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_dim: int = 256  # hidden size of each SwiGLU expert (and of the dense FFN)
    num_experts: int = 4
    top_k: int = 2
    moe_every: int = 1  # MoE FFN in every k-th layer (layer i is MoE if i % moe_every == 0), dense SwiGLU otherwise
    norm_topk: bool = True  # renormalise the top-k router weights to sum to 1 (Mixtral does)
    aux_coef: float = 0.01  # Switch/GShard load-balancing loss coefficient
    pos_emb: Literal["rope", "learned"] = "rope"
    rope_theta: float = 10000.0
    max_seq_len: int = 1024  # size of the learned position table
    norm_eps: float = 1e-5
    init_std: float = 0.02


@dataclass(kw_only=True)
class DataConfig:
    source: str = "shakespeare"  # "shakespeare", an HF hub dataset name, or a local file/dir/glob (.txt/.jsonl/.parquet)
    vocab_size: int = 2048  # BPE vocabulary trained on the corpus
    tokenizer: str = ""  # path to an existing tokenizer.json (empty = train a byte-level BPE)
    text_field: str = "text"  # column of jsonl/parquet/HF records that holds the text
    loader: Literal["indexed", "streaming"] = "indexed"
    val_fraction: float = 0.05
    max_docs: int = 0  # cap on documents read from a streaming/hub source when preparing (0 = all)
    cache_dir: str = ""  # where prepared corpora live (default: ~/.cache/nanotitan)
    shuffle_buffer: int = 10_000  # streaming loader's shuffle buffer


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 300
    seed: int = 1337
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    micro_batch: int = 4  # m: sequences per microbatch
    global_batch: int = 0  # B sequences per step; 0 = dp*ep*microbatches*micro_batch (kept fixed by --parallel.auto)
    seq_len: int = 128  # S
    eval_every: int = 100  # 0 disables periodic eval
    eval_batches: int = 4
    activation_checkpointing: bool = False
    ckpt_every: int = 0  # 0 = only at the end (when ckpt_at_end)
    ckpt_at_end: bool = True  # the sample at the end and `nanotitan generate` load it
    keep_last: int = 2
    resume: str = ""  # "", "auto" or a checkpoint path
    ckpt_on_signal: bool = False
    max_restarts: int = 0
    threads: int = 0  # torch threads per rank (0 = cores / local ranks)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["fp32", "bf16"] = "fp32"  # bf16 = autocast on CUDA
    peak_flops: float = 0.0  # FLOP/s per rank for MFU (0 = measured GEMM on CPU, datasheet on GPU)
    sample_tokens: int = 100  # tokens generated at the end (0 disables)


@dataclass(kw_only=True)
class ParallelConfig:
    dp: int = 1
    pp: int = 1
    ep: int = 1
    microbatches: int = 1  # M per data rank per step
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    pp_layers: list[int] = field(default_factory=list)  # explicit layers per stage (empty = as even as possible)
    bucket_mb: float = 25.0
    dp_impl: Literal["nanotitan", "torch_ddp"] = "nanotitan"
    timeout_s: float = 300.0  # process-group timeout
    check_replicas: bool = False  # debug: checksum all-reduce proving replicas are identical
    auto: bool = False  # choose dp/pp/ep/schedule/M/m with the planner (nanotitan plan) for the world size
    world: int = 0  # ranks for parallel.auto: 0 = WORLD_SIZE under torchrun, else dp*pp*ep


@dataclass(kw_only=True)
class RunConfig:
    dir: str = "runs/default"
    log_every: int = 10
    tensorboard: bool = True
    progress: bool = True  # rich progress bar on rank 0


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def data_world(self) -> int:
        return self.parallel.dp * self.parallel.ep

    @property
    def global_batch(self) -> int:
        """B = DP * EP * M * m sequences per step."""
        return self.data_world * self.parallel.microbatches * self.train.micro_batch

    @property
    def world_size(self) -> int:
        return self.parallel.dp * self.parallel.pp * self.parallel.ep


SECTIONS = {f.name: f.type for f in fields(Config)}


def _section_types(section_cls) -> dict[str, object]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in fields(section_cls)}


def _coerce(value, typ, name: str):
    """Coerce a TOML value or CLI string to the field's declared type, or raise ConfigError."""
    origin = typing.get_origin(typ)
    if origin is Literal:
        choices = typing.get_args(typ)
        if value not in choices:
            raise ConfigError(f"{name}={value!r} is not one of {list(choices)} (--{name})")
        return value
    if origin is list:
        (inner,) = typing.get_args(typ)
        if isinstance(value, str):
            value = [v for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{name} must be a list, got {value!r} (--{name} 1,2,3)")
        return [_coerce(v.strip() if isinstance(v, str) else v, inner, name) for v in value]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{name} must be true or false, got {value!r} (--{name} true)")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name} must be an integer, got {value!r} (--{name} N)")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{name} must be an integer, got {value!r} (--{name} N)")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{name} must be a number, got {value!r} (--{name} X)")
    if typ is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name} must be a string, got {value!r}")
    raise AssertionError(f"unsupported config type {typ} for {name}")


def _apply(cfg: Config, section: str, key: str, value) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section [{section}] (valid: {', '.join(SECTIONS)})")
    sec = getattr(cfg, section)
    types = _section_types(type(sec))
    if key not in types:
        raise ConfigError(
            f"unknown config key {section}.{key} (valid keys in [{section}]: {', '.join(types)})"
        )
    setattr(sec, key, _coerce(value, types[key], f"{section}.{key}"))


def parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """['--model.n_layers', '4', '--train.lr=1e-3'] -> [('model', 'n_layers', '4'), ('train', 'lr', '1e-3')]."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or "." not in a.split("=")[0]:
            raise ConfigError(f"unexpected argument {a!r}: overrides look like --section.key VALUE")
        if "=" in a:
            k, v = a[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"{a} needs a value ({a} VALUE)")
            k, v = a[2:], args[i + 1]
            i += 2
        section, key = k.split(".", 1)
        out.append((section, key, v))
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- TOML file <- CLI overrides, then validate()."""
    cfg = Config()
    if path:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist (--config PATH)")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        for section, body in data.items():
            if not isinstance(body, dict):
                raise ConfigError(f"top-level key {section!r} in {p} must be a [section] table")
            for key, value in body.items():
                _apply(cfg, section, key, value)
    for section, key, value in parse_overrides(overrides or []):
        _apply(cfg, section, key, value)
    validate(cfg)
    return cfg


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Every impossible value fails here, with one line naming the field and the fix."""
    m, t, p, d = cfg.model, cfg.train, cfg.parallel, cfg.data
    if m.vocab_size == 0:
        m.vocab_size = d.vocab_size
    for name, v in [("model.d_model", m.d_model), ("model.n_layers", m.n_layers), ("model.n_heads", m.n_heads),
                    ("model.ffn_dim", m.ffn_dim), ("model.num_experts", m.num_experts), ("model.top_k", m.top_k),
                    ("model.moe_every", m.moe_every), ("model.vocab_size", m.vocab_size),
                    ("train.micro_batch", t.micro_batch), ("train.seq_len", t.seq_len),
                    ("parallel.dp", p.dp), ("parallel.pp", p.pp), ("parallel.ep", p.ep),
                    ("parallel.microbatches", p.microbatches), ("run.log_every", cfg.run.log_every)]:
        _check(v >= 1, f"{name}={v} must be >= 1 (--{name})")
    _check(t.steps >= 0, f"train.steps={t.steps} must be >= 0 (--train.steps)")
    _check(m.d_model % m.n_heads == 0,
           f"model.n_heads={m.n_heads} must divide model.d_model={m.d_model} (--model.n_heads)")
    _check(m.pos_emb != "rope" or (m.d_model // m.n_heads) % 2 == 0,
           f"rope needs an even head dim, got d_model/n_heads={m.d_model // m.n_heads} (--model.pos_emb learned)")
    _check(m.top_k <= m.num_experts,
           f"model.top_k={m.top_k} must be <= model.num_experts={m.num_experts} (--model.top_k)")
    _check(m.aux_coef >= 0, f"model.aux_coef={m.aux_coef} must be >= 0 (--model.aux_coef)")
    _check(m.pos_emb != "learned" or t.seq_len <= m.max_seq_len,
           f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len} (--model.max_seq_len)")
    _check(d.vocab_size >= 260, f"data.vocab_size={d.vocab_size} must be >= 260 for byte-level BPE (--data.vocab_size)")
    _check(d.vocab_size <= 2**32 - 1, f"data.vocab_size={d.vocab_size} too large (--data.vocab_size)")
    _check(0.0 < d.val_fraction < 0.5, f"data.val_fraction={d.val_fraction} must be in (0, 0.5) (--data.val_fraction)")
    _check(t.lr > 0, f"train.lr={t.lr} must be > 0 (--train.lr)")
    _check(t.warmup_steps >= 0, f"train.warmup_steps={t.warmup_steps} must be >= 0 (--train.warmup_steps)")
    _check(0.0 <= t.min_lr_ratio <= 1.0, f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    _check(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip} must be >= 0 (0 disables; --train.grad_clip)")
    _check(t.resume in ("", "auto") or Path(t.resume).exists(),
           f"train.resume={t.resume!r}: no such checkpoint (use 'auto' or an existing path; --train.resume)")
    _check(p.bucket_mb > 0, f"parallel.bucket_mb={p.bucket_mb} must be > 0 (--parallel.bucket_mb)")
    _check(p.timeout_s > 0, f"parallel.timeout_s={p.timeout_s} must be > 0 (--parallel.timeout_s)")
    _check(m.num_experts % p.ep == 0,
           f"parallel.ep={p.ep} must divide model.num_experts={m.num_experts} (--parallel.ep)")
    _check(p.pp <= m.n_layers,
           f"parallel.pp={p.pp} stages need at least as many layers, model.n_layers={m.n_layers} (--parallel.pp)")
    if p.pp_layers:
        _check(len(p.pp_layers) == p.pp and all(n >= 1 for n in p.pp_layers) and sum(p.pp_layers) == m.n_layers,
               f"parallel.pp_layers={p.pp_layers} must list {p.pp} positive counts summing to "
               f"model.n_layers={m.n_layers} (--parallel.pp_layers 2,2)")
    _check(p.dp_impl == "nanotitan" or (p.pp == 1 and p.ep == 1),
           "parallel.dp_impl=torch_ddp supports pure DP only (pp=1, ep=1); use --parallel.dp_impl nanotitan")
    _check(d.loader == "indexed" or t.resume == "",
           "data.loader=streaming cannot resume by step; use --data.loader indexed to resume")
    _check(t.global_batch >= 0, f"train.global_batch={t.global_batch} must be >= 0 (--train.global_batch)")
    _check(not t.global_batch or p.auto or t.global_batch == cfg.global_batch,
           f"train.global_batch={t.global_batch} != dp*ep*microbatches*micro_batch = {cfg.global_batch} "
           "(fix the layout, set --train.global_batch 0, or let --parallel.auto true choose M and m)")
    _check(p.world >= 0, f"parallel.world={p.world} must be >= 0 (--parallel.world)")
    if world_size is not None:
        _check(world_size == cfg.world_size,
               f"world size {world_size} != parallel.dp*pp*ep = {p.dp}*{p.pp}*{p.ep} = {cfg.world_size} "
               f"(set --parallel.dp/--parallel.pp/--parallel.ep so their product is {world_size})")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (written to RUN_DIR/config.toml)."""
    lines = []
    for section, body in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for k, v in body.items():
            if isinstance(v, bool):
                s = "true" if v else "false"
            elif isinstance(v, str):
                s = '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
            elif isinstance(v, list):
                s = "[" + ", ".join(str(x) for x in v) + "]"
            else:
                s = repr(v)
            lines.append(f"{k} = {s}")
        lines.append("")
    return "\n".join(lines)


def from_dict(d: dict) -> Config:
    cfg = Config()
    for section, body in d.items():
        for k, v in body.items():
            _apply(cfg, section, k, v)
    return cfg
