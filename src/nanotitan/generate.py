"""Sample text from a trained run: the newest checkpoint loaded into the full model on one process.

Checkpoints are keyed by layout-independent names, so a model trained on any DP x PP x EP layout
loads here as one `Transformer`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .state import checkpoint as ckpt

from .state import manifest
from .config.config import Config, ConfigError, load_config
from .data.prepare import load_tokenizer, prepare_data
from .model.transformer import Transformer
from .parallel.dims import ParallelDims
from .config.hf_config import resolve_model


def load_full_model(cfg: Config, run_dir: Path) -> Transformer:
    path = manifest.resolve_resume("auto", run_dir, verify=cfg.train.verify_ckpt)  # newest that verifies
    if path is None:
        raise ConfigError(f"no complete checkpoint under {run_dir} (train with --train.ckpt_at_end true)")
    model = Transformer(cfg.model, seed=cfg.train.seed)
    ckpt.load_checkpoint(path, model, None, ParallelDims(1, 1, 1))
    return model.eval()


def sample(model: Transformer, tokenizer, prompt: str, max_new_tokens: int, seed: int = 0) -> str:
    ids = tokenizer.encode(prompt).ids or [0]
    g = torch.Generator().manual_seed(seed)
    out = model.generate(torch.tensor([ids]), max_new_tokens, generator=g)
    return tokenizer.decode(out[0].tolist())


def generate_from_run(run_dir: str, prompt: str, max_new_tokens: int, overrides: list[str] | None = None) -> str:
    cfg_path = Path(run_dir) / "config.toml"
    # The run's config.toml is the resolved config it trained with; without one, the defaults, resolved here.
    cfg = load_config(cfg_path, overrides) if cfg_path.exists() else resolve_model(load_config(None, overrides))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = load_full_model(cfg, Path(run_dir))
    tokenizer = load_tokenizer(prepare_data(cfg.data))
    return sample(model, tokenizer, prompt, max_new_tokens, seed=cfg.train.seed)
