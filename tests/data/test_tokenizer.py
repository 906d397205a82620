"""Tokenizer: the trained byte-level BPE has the asked size, an EOT token, and round-trips any string exactly."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from nanotitan.config.config import ConfigError
from nanotitan.data.tokenizer import EOT, eot_id, load_tokenizer_file, train_bpe
from tests.helpers.data import make_docs


def test_bpe_round_trips_unseen_text_and_has_eot():
    tok = train_bpe(make_docs(20), vocab_size=300)
    assert tok.get_vocab_size() == 300
    assert eot_id(tok) == tok.token_to_id(EOT)
    text = "the king's crown — naïve café, 日本語 🎭\n\ttabs  and   spaces\r\n"  # bytes never seen in training
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges were learned, not just bytes
    assert tok.encode(f"a{EOT}b").ids.count(eot_id(tok)) == 1  # EOT is one special token


def test_saved_tokenizer_loads_back_identically(tmp_path):
    tok = train_bpe(make_docs(10), vocab_size=280)
    tok.save(str(tmp_path / "tokenizer.json"))
    again = load_tokenizer_file(tmp_path / "tokenizer.json")
    text = make_docs(1, seed=5)[0]
    assert again.encode(text).ids == tok.encode(text).ids


def test_bad_tokenizer_files_fail_naming_data_tokenizer(tmp_path):
    with pytest.raises(ConfigError, match="data.tokenizer=.*no such file"):
        load_tokenizer_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a valid tokenizer.json"):
        load_tokenizer_file(tmp_path / "bad.json")
    no_eot = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    no_eot.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(ConfigError, match="end-of-text"):
        eot_id(no_eot)
