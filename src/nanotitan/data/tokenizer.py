"""Byte-level BPE tokenizer: train one on the corpus with HF `tokenizers`, or load a `tokenizer.json`.

Byte-level means every string round-trips exactly (no unknown tokens): the base alphabet is the
256 bytes, merges are learned on top, and `<|endoftext|>` separates documents (GPT-2 convention).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nanotitan.config.config import ConfigError
from nanotitan.config.errors import first_line

EOT = "<|endoftext|>"
# Document separators of common pretrained tokenizers, tried in order when loading a foreign tokenizer.json.
EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of exactly `vocab_size` entries (incl. EOT) on `texts`, in seconds for a few MB."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes even if unseen
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer_file(path: str | Path) -> Tokenizer:
    """Load a `tokenizer.json` (ours or any HF one); fails with one line naming data.tokenizer."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"data.tokenizer={str(path)!r}: no such file (give a tokenizer.json, or '' to train one)")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on malformed JSON (a truncated file)
        raise ConfigError(f"data.tokenizer={str(path)!r} is not a valid tokenizer.json ({first_line(e)}; truncated? "
                          "save it again, or give --data.tokenizer '' to train one)") from None


def eot_id(tok: Tokenizer) -> int:
    """Id of the document separator; a loaded tokenizer without one cannot pack documents."""
    for name in EOT_CANDIDATES:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise ConfigError(
        f"tokenizer has none of the end-of-text tokens {list(EOT_CANDIDATES)}; "
        f"add {EOT!r} as a special token or use --data.tokenizer '' to train one"
    )
