"""The tests' tiny model, built from configs/debug.toml: each test module names only how its model differs."""

import tomllib
from pathlib import Path

from nanotitan.config.config import ModelConfig

DEBUG = tomllib.loads((Path(__file__).resolve().parents[2] / "configs" / "debug.toml").read_text())


def tiny_args(*train: str, data_vocab_size: int | None = None, **model) -> list[str]:
    """configs/debug.toml's [model] and data.vocab_size as `--section.key value` overrides, with `model`'s fields
    changed or added, and debug.toml's train.NAME for each NAME in `train` (seq_len, micro_batch)."""
    args = [a for k, v in {**DEBUG["model"], **model}.items() for a in (f"--model.{k}", str(v))]
    args += ["--data.vocab_size", str(data_vocab_size or DEBUG["data"]["vocab_size"])]
    return args + [a for t in train for a in (f"--train.{t}", str(DEBUG["train"][t]))]


def tiny_model(**fields) -> ModelConfig:
    """debug.toml's [model] as a ModelConfig, with `fields` changed or added."""
    return ModelConfig(**{**DEBUG["model"], **fields})


TINY = tiny_args("seq_len", "micro_batch", n_layers=2) + ["--run.progress", "false", "--run.tensorboard", "false",
                                                          "--train.sample_tokens", "0"]
