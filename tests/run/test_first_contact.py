"""First contact (issue 27, item 5): `make train` installs only what the main job imports (the test extras come
with `make test`), and the Python API loads a transformers model dir without a tokenizer, as transformers'
from_pretrained does, while training from it (`--init.from_hf`) still needs one, from DIR or --data.tokenizer."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from nanotitan import cli
from nanotitan.interop import hf
from nanotitan.config.config import ConfigError, load_config
from nanotitan.model.transformer import Transformer
from nanotitan.resolve import resolve

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_train_installs_runtime_deps_only_and_make_test_adds_the_extras():
    def recipe(target):  # what make would run from scratch (-B), without running it (-n)
        return subprocess.run(["make", "-n", "-B", target], cwd=REPO, capture_output=True, text=True,
                              check=True, timeout=60).stdout

    train, test = recipe("train"), recipe("test")
    assert "pip install -q -e .\n" in train and "[test]" not in train, train
    assert 'pip install -q -e ".[test]"' in test and "pytest" in test, test


@pytest.fixture
def weights_only(tmp_path, corpus_dir):
    """A transformers-layout dir (config.json + safetensors) with no tokenizer.json, and a tokenizer file."""
    from nanotitan.config.config import DataConfig
    from nanotitan.data.sources import iter_documents
    from nanotitan.data.tokenizer import train_bpe

    cfg = load_config(None, ["--model.d_model", "32", "--model.n_heads", "4", "--model.ffn_dim", "24",
                             "--model.n_layers", "2", "--model.num_experts", "4", "--model.vocab_size", "320",
                             "--model.max_seq_len", "64", "--model.n_kv_heads", "2", "--data.vocab_size", "300",
                             "--train.seq_len", "16"])
    model = Transformer(cfg.model, seed=3)
    out = hf.save_pretrained(model, cfg, tmp_path / "hf")
    assert not (out / "tokenizer.json").exists()
    tok = tmp_path / "tokenizer.json"
    train_bpe(iter_documents(DataConfig(source=str(corpus_dir))), 300).save(str(tok))
    return out, tok, model


def test_load_pretrained_needs_no_tokenizer(weights_only):
    d, _, model = weights_only
    cfg, loaded = hf.load_pretrained(d)
    assert cfg.data.tokenizer == ""
    want = model.state_dict()
    assert all(torch.equal(t, want[k]) for k, t in loaded.state_dict().items())


def test_training_from_hf_still_needs_a_tokenizer(weights_only, capsys):
    """--init.from_hf without tokenizer.json: one line asking for one, unless --data.tokenizer gives it; generate
    (which must encode a prompt) says so too."""
    d, tok, _ = weights_only
    with pytest.raises(ConfigError, match=rf"^init\.from_hf='{d}' has no tokenizer\.json \(save the model's fast "
                                          r"tokenizer there: tokenizer\.save_pretrained\(DIR\), or give one with "
                                          r"--data\.tokenizer FILE\)$"):
        resolve(load_config(None, ["--init.from_hf", str(d), "--train.seq_len", "16"]))
    cfg = resolve(load_config(None, ["--init.from_hf", str(d), "--train.seq_len", "16", "--data.tokenizer", str(tok)]))
    assert cfg.data.tokenizer == str(tok) and cfg.model.vocab_size == 320
    assert cli.main(["generate", "--init.from_hf", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nanotitan: config error: init.from_hf='{d}' has no tokenizer.json to encode the prompt") \
        and err.count("\n") == 1, err
