"""Sample text from a trained run: the newest checkpoint loaded into the full model on one process.

Checkpoints are keyed by layout-independent names, so a model trained on any DP x PP x EP layout
loads here as one `Transformer`. Generation is KV-cached (model/kv_cache.py: each new token runs through the model
once); the next token is the argmax (greedy) or drawn after temperature, top-k and top-p, in transformers' order.
Sampling is our dozen lines rather than transformers' logits warpers (a test extra here, not a dependency): the
tests hold them to those warpers (docs/generate.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from .state import checkpoint as ckpt

from .state import manifest
from .config.config import Config, ConfigError, load_config
from .data import chat
from .data.prepare import prepare_data
from .data.tokenizer import eot_id, load_tokenizer_file
from .interop.hf import run_tokenizer
from .model.transformer import Transformer
from .parallel.dims import ParallelDims


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen from the last position's logits (`nanotitan generate`'s flags)."""
    temperature: float = 0.8  # logits / temperature before the filters and the draw
    top_k: int = 50  # keep the k likeliest tokens (0 = all)
    top_p: float = 1.0  # keep the likeliest tokens whose probabilities reach top_p (1 = all)
    greedy: bool = False  # the argmax, no draw (the filters and temperature do not change it)
    seed: int | None = None  # seeds the draws: the same seed, prompt and model give the same text (None: the run's)

    def seeded(self, seed: int) -> Sampling:
        """These settings with `seed` where none was given (a run's train.seed)."""
        return self if self.seed is not None else dataclasses.replace(self, seed=seed)

    def check(self) -> None:
        """Bad values in one line naming the flag and the fix."""
        if not self.greedy and not self.temperature > 0:
            raise ConfigError(f"--temperature {self.temperature} must be > 0 (or --greedy for the likeliest token)")
        if self.top_k < 0:
            raise ConfigError(f"--top-k {self.top_k} must be >= 0 (0 keeps every token)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p {self.top_p} must be in (0, 1] (1 keeps every token)")


def filter_logits(logits_BV: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits / temperature with the tokens top-k and top-p leave out at -inf; transformers' Temperature, TopK and
    TopP logits warpers, in that order and with their tie rules (top-p keeps at least one token)."""
    logits_BV = logits_BV / s.temperature
    if s.top_k:
        kth_B1 = logits_BV.topk(min(s.top_k, logits_BV.shape[-1]))[0][..., -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, -float("inf"))
    if s.top_p < 1:
        sorted_BV, order_BV = logits_BV.sort(dim=-1)  # ascending: the tail whose mass stays <= 1 - top_p goes
        drop_sorted_BV = sorted_BV.softmax(-1).cumsum(-1) <= 1 - s.top_p
        drop_sorted_BV[..., -1:] = False
        logits_BV = logits_BV.masked_fill(drop_sorted_BV.scatter(1, order_BV, drop_sorted_BV), -float("inf"))
    return logits_BV


def picker(s: Sampling):
    """pick(logits (B, V)) -> next tokens (B, 1), for Transformer.generate: the argmax, or a draw from the filtered
    distribution with a generator seeded once by s.seed."""
    s.check()
    if s.greedy:
        return lambda logits_BV: logits_BV.argmax(-1, keepdim=True)
    g = torch.Generator().manual_seed(s.seed or 0)
    return lambda logits_BV: torch.multinomial(filter_logits(logits_BV, s).softmax(-1), 1, generator=g)


def load_full_model(run_dir: str | Path, overrides: list[str] | None = None) -> tuple[Config, Transformer]:
    """The run's newest checkpoint that verifies, as one full model, with the config it was saved with (its own
    config.toml, resolved when it was written, as `export` reads it; `overrides` on top)."""
    path = manifest.resolve_resume("auto", run_dir, verify=True)
    if path is None:
        raise ConfigError(f"no complete checkpoint under {run_dir} (train with --train.ckpt_at_end true)")
    cfg = load_config(path / "config.toml", overrides)
    model = Transformer(cfg.model, seed=cfg.train.seed)
    ckpt.load_checkpoint(path, model, None, ParallelDims(1, 1, 1))
    return cfg, model.eval()


def sample(model: Transformer, tokenizer, prompt: str, max_new_tokens: int, sampling: Sampling = Sampling(),
           fmt: str = "text", template=None) -> str:
    """The prompt and its continuation (fmt "text"); fmt "sft": the answer alone, as SFT trained it (data/sft.py:
    the prompt's tokens open a document, the response follows them and ends at EOT, where the answer stops). With the
    data's chat template (data/chat.py), the prompt is a user turn followed by the template's generation prompt."""
    if fmt == "sft" and template is not None:
        text = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False).ids
    else:
        ids = tokenizer.encode(prompt).ids or [0]
    out = model.generate(torch.tensor([ids]), max_new_tokens, picker(sampling))[0].tolist()
    if fmt == "text":
        return tokenizer.decode(out)
    answer = out[len(ids):]
    eot = eot_id(tokenizer)
    return tokenizer.decode(answer[:answer.index(eot)] if eot in answer else answer)


def generate_from_run(run_dir: str, prompt: str, max_new_tokens: int, overrides: list[str] | None = None,
                      sampling: Sampling | None = None, fmt: str = "text") -> str:
    """`nanotitan generate --run.dir`: the run's newest checkpoint continues `prompt`, drawn as `sampling` says
    (default: Sampling's defaults); without a seed, with the run's train.seed."""
    (sampling or Sampling()).check()  # before the checkpoint is read
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg, model = load_full_model(run_dir, overrides)
    path = run_tokenizer(cfg)  # the prepared data's or data.tokenizer: nothing to encode
    path = path or str(prepare_data(cfg.data) / "tokenizer.json")
    return sample(model, load_tokenizer_file(path), prompt, max_new_tokens,
                  (sampling or Sampling()).seeded(cfg.train.seed), fmt, chat.load(str(path)))
