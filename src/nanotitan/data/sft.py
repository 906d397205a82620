"""Supervised fine-tuning data (data.format=sft, docs/packed.md): `.jsonl` records of a prompt and its response, or
of a conversation (`messages`, rendered with the tokenizer's chat template: data/chat.py).

    prepare   each record -> its spans' tokens, then EOT; a loss mask beside the tokens, 1 on the response (the
              assistant turns) and the EOT after it (the tokens the model learns to produce), 0 on the prompt (the
              other turns and the template's markup). `{split}.bin` holds the tokens as
              for text, `{split}.mask` the mask (uint8, one per token), verified on open like the tokens
              (data/prepare.py `verify_prepared`).
    batches   `SFTBatches`: a window of S+1 tokens starts at an example's first token, drawn by (seed, step) as the
              text loader draws offsets, and packs whole examples until the next one does not fit; the rest is EOT
              padding with mask 0. An example longer than the window is cut at its end (counted: `truncated`).
              The targets of masked tokens are their token + MASKED, so the loss reads responses only,
              normalised over the global batch's response tokens (parallel/step.py `target_weights`), and MTP's
              depths still read every next token as their input (model/mtp.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..config.config import DataConfig
from . import chat
from .indexed import IndexedBatches, Runs, columns, step_generator
from .sources import DataError, local_files

FIELDS = ("prompt", "response")
# A masked target is its token + MASKED: no loss reads it, MTP reads its token (model/tokens.py's: data/ reads no
# model/)
MASKED = 1 << 30


def iter_records(cfg: DataConfig) -> Iterator[tuple[str, list[tuple[str, bool]], bool]]:
    """(where, its (text, learned) spans, whether a chat template wrote them) of every record of data.source's
    `.jsonl` files, in order: a prompt and its response, or a conversation's spans (data/chat.py). A record that is
    neither is refused in one line naming its file and line."""
    template = chat.load(cfg.tokenizer)
    files = local_files(cfg.source)
    if not files or any(f.suffix != ".jsonl" for f in files):
        raise DataError(f"data.format=sft reads .jsonl records with {FIELDS[0]!r} and {FIELDS[1]!r}; "
                        f"data.source={cfg.source!r} is not a .jsonl file or a directory of them (--data.source)")
    for f in files:
        with f.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{f}:{n}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: not valid JSON ({e.msg}, column {e.colno}); a .jsonl file holds one "
                                    "JSON object per line") from None
                if isinstance(record, dict) and "messages" in record:
                    yield where, _conversation(record["messages"], template, cfg, where), True
                    continue
                if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in FIELDS):
                    got = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise DataError(f"{where}: an SFT record needs string fields {FIELDS[0]!r} and {FIELDS[1]!r}, "
                                    f"or 'messages' (got {got}); fix the record or use --data.format text")
                yield where, [(record["prompt"], False), (record["response"], True)], False


def _conversation(messages, template, cfg: DataConfig, where: str) -> list[tuple[str, bool]]:
    chat.check_messages(messages, where)
    if template is None:
        raise DataError(f"{where}: a 'messages' record is rendered with the tokenizer's chat template, and "
                        f"{cfg.tokenizer or 'the BPE trained on the source'} has none (tokenizer_config.json's "
                        "chat_template beside data.tokenizer); give --data.tokenizer one that has, or write "
                        "prompt/response records")
    return template.spans(messages, where)


def encode_examples(tok, records, eot: int, dtype) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """(text, tokens, mask) per record: its spans' tokens + EOT, the mask 1 on the learned spans and on the EOT
    when the last span is learned. A learned span empty after tokenization is refused in one line (it would teach
    only to stop), and so is a conversation whose template writes the EOT inside it (it would split the example)."""
    for where, spans, templated in records:
        # a template's text writes its special tokens out: the tokenizer adds none
        ids = [tok.encode(text, add_special_tokens=not templated).ids for text, _ in spans]
        if any(learned and not part for part, (_, learned) in zip(ids, spans)):
            raise DataError(f"{where}: the response is empty after tokenization; give it text or drop the record")
        if any(eot in part for part in ids):
            raise DataError(f"{where}: the record's text holds the end-of-text token {tok.id_to_token(eot)!r}, which "
                            "separates examples; remove it (or use a chat template that does not write it)")
        learned = [np.full(len(part), flag, np.uint8) for part, (_, flag) in zip(ids, spans)]
        mask = np.concatenate([*learned, [spans[-1][1]]]).astype(np.uint8)
        tokens = np.array([t for part in ids for t in part] + [eot], dtype=np.int64).astype(dtype)
        yield "\0".join(text for text, _ in spans), tokens, mask


def example_starts(tokens: np.ndarray, eot: int) -> np.ndarray:
    """The token offset where each example starts (int64): 0 and every position after an EOT but the file's end."""
    ends = np.flatnonzero(tokens == eot) + 1
    return np.concatenate([[0], ends[ends < len(tokens)]]).astype(np.int64)


class SFTBatches(IndexedBatches):
    """IndexedBatches over a prepared SFT split: windows of whole examples from an example's start (module
    docstring); y is token + MASKED where the mask is 0. Its interface is IndexedBatches' (rank_batch, global_batch,
    eval_batches), so every layout reads the same rows."""

    def __init__(self, path: str | Path, dtype, seq_len: int, seed: int, eot: int):
        self.path, self.dtype, self.seq_len, self.seed, self.eot = Path(path), np.dtype(dtype), seq_len, seed, eot
        self.mask_path = self.path.with_suffix(".mask")
        tokens = np.memmap(str(self.path), dtype=self.dtype, mode="r")
        self.n_tokens = len(tokens)
        self.starts = example_starts(tokens, eot)
        lengths = np.diff(np.append(self.starts, self.n_tokens))
        self.truncated = int((lengths > seq_len + 1).sum())  # examples a window cuts at its end
        if self.n_tokens == 0:
            raise DataError(f"{self.path} holds no SFT example; add records to --data.source")

    def offsets(self, step: int, B: int) -> torch.Tensor:
        pick = torch.randint(0, len(self.starts), (B,), generator=step_generator(self.seed, step))
        return torch.from_numpy(self.starts)[pick]

    def eval_offsets(self, n: int, B: int) -> torch.Tensor:
        pick = torch.linspace(0, len(self.starts) - 1, n * B, dtype=torch.float64).round().long()
        return torch.from_numpy(self.starts)[pick].view(n, B)

    def read(self, offsets_B: torch.Tensor, runs: Runs = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows at offsets_B (example starts): whole examples up to S+1 tokens, EOT padding after; y is
        token + MASKED where the mask is 0 (prompts, padding). Of each only the positions `runs`."""
        W = self.seq_len + 1
        off_B = offsets_B.numpy()
        # where each window's whole examples end: the last example start within W tokens (a longer example: cut)
        nxt_B = np.searchsorted(self.starts, off_B + W, side="right") - 1
        end_B = np.where(self.starts[nxt_B] > off_B, self.starts[nxt_B], off_B + W)
        end_B = np.where(off_B + W >= self.n_tokens, np.minimum(off_B + W, self.n_tokens), end_B)
        idx_BW = off_B[:, None] + np.arange(W)
        inside_BW = idx_BW < end_B[:, None]
        idx_BW = np.minimum(idx_BW, self.n_tokens - 1)
        tokens = np.memmap(str(self.path), dtype=self.dtype, mode="r")
        mask = np.memmap(str(self.mask_path), dtype=np.uint8, mode="r")
        window_BW = torch.from_numpy(np.where(inside_BW, tokens[idx_BW].astype(np.int64), self.eot))
        learn_BW = torch.from_numpy(inside_BW & (mask[idx_BW] == 1))
        y = window_BW[:, 1:]
        x, y = window_BW[:, :-1], torch.where(learn_BW[:, 1:], y, y + MASKED)
        if runs is None or runs == [(0, self.seq_len)]:
            return x, y
        cols = torch.from_numpy(columns(runs))
        return x[:, cols], y[:, cols]
