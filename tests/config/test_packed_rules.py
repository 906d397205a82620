"""Packed documents and SFT data refuse what they do not compose with, in one line naming the field and the fix
(config/packed_rules.py); a document mask needs an EOT to find documents by."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from nanotitan.config.config import ConfigError, load_config, validate


@pytest.mark.parametrize("flags, words", [
    (["--data.loader", "streaming"], "--data.loader indexed"),
    (["--data.mix", "a:0.5,b:0.5"], "no --data.mix"),
])
def test_sft_refusals_name_the_field_and_the_fix(tmp_path, flags, words):
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, ["--run.dir", str(tmp_path), "--data.format", "sft", *flags]))
    line = str(err.value)
    assert words in line and "\n" not in line and "--" in line, line


def test_a_document_mask_without_an_eot_token_is_refused_in_one_line(tmp_path):
    from nanotitan.resolve import resolve
    from nanotitan.run.setup import setup_rank

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("the king the queen\n")
    tok = Tokenizer(models.WordLevel({"the": 0, "king": 1, "queen": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = load_config(None, ["--run.dir", str(tmp_path / "run"), "--data.source", str(tmp_path / "corpus"),
                             "--data.tokenizer", str(tmp_path / "tokenizer.json"), "--data.cache_dir",
                             str(tmp_path / "cache"), "--model.attn_mask", "doc", "--model.vocab_size", "8"])
    with pytest.raises(ConfigError, match="end-of-text") as err:
        setup_rank(resolve(cfg, world=1))
    assert "\n" not in str(err.value)
