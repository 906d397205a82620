"""prepare_data: tokenizes a source once into train.bin/val.bin + meta.json + tokenizer.json, cached and race-safe."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers

from nanotitan.config.config import DataConfig
from nanotitan.data import prepare as prepare_mod
from nanotitan.data.prepare import (load_meta, load_tokenizer, prepare_data, prepared_dir, split_by_document,
                                     token_dtype)
from nanotitan.data.tokenizer import EOT
from tests.helpers.data import make_docs, write_txt


def _cfg(tmp_path, **kw) -> DataConfig:
    return DataConfig(source=str(tmp_path / "corpus"), vocab_size=300, cache_dir=str(tmp_path / "cache"), **kw)


def test_prepare_writes_tokens_meta_and_tokenizer(tmp_path):
    docs = make_docs(30)
    write_txt(tmp_path / "corpus", docs)
    out = prepare_data(_cfg(tmp_path, val_fraction=0.1), log=lambda s: None)
    meta, tok = load_meta(out), load_tokenizer(out)
    assert out.parent == tmp_path / "cache" / "prepared"
    assert meta["vocab_size"] == tok.get_vocab_size() == 300 and meta["dtype"] == "uint16"
    assert meta["eot_id"] == tok.token_to_id(EOT) and meta["split_by"] == "documents"
    assert meta["train_docs"] + meta["val_docs"] == 30 and meta["val_docs"] >= 1
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert (train.size, val.size) == (meta["train_tokens"], meta["val_tokens"])
    assert 0.05 < val.size / (train.size + val.size) < 0.25  # val_fraction of the tokens, by whole documents
    # every document once, encoded, followed by EOT; decoding the two files gives back the corpus
    both = np.concatenate([train, val])
    assert (both == meta["eot_id"]).sum() == 30
    texts = [tok.decode(part.tolist()) for part in np.split(both, np.flatnonzero(both == meta["eot_id"]) + 1)[:-1]]
    assert sorted(texts) == sorted(docs)
    assert len(meta["val_sha1"]) == meta["val_docs"]


def test_second_call_is_cached_and_keys_change_with_inputs(tmp_path, monkeypatch):
    write_txt(tmp_path / "corpus", make_docs(8))
    out = prepare_data(_cfg(tmp_path), log=lambda s: None)
    stamp = (out / "train.bin").stat().st_mtime_ns

    def boom(cfg):
        raise AssertionError("a cached prepare must not read the source")

    monkeypatch.setattr(prepare_mod, "iter_documents", boom)
    t0 = time.perf_counter()
    assert prepare_data(_cfg(tmp_path), log=lambda s: None) == out
    assert time.perf_counter() - t0 < 0.5 and (out / "train.bin").stat().st_mtime_ns == stamp
    assert prepared_dir(_cfg(tmp_path, val_fraction=0.2)) != out
    assert prepared_dir(DataConfig(source=str(tmp_path / "corpus"), vocab_size=512,
                                   cache_dir=str(tmp_path / "cache"))) != out


def test_cache_root_defaults_to_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOTITAN_CACHE", str(tmp_path / "envcache"))
    assert prepared_dir(DataConfig(source="shakespeare")).parent == tmp_path / "envcache" / "prepared"


def test_loaded_tokenizer_with_big_vocab_gives_uint32_tokens(tmp_path):
    docs = make_docs(6)
    write_txt(tmp_path / "corpus", docs)
    words = sorted({w for d in docs for w in d.split()})
    vocab = {w: i for i, w in enumerate(words)} | {EOT: 69_998, "[UNK]": 69_999}
    for i in range(len(words), 69_998):
        vocab[f"filler{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    out = prepare_data(_cfg(tmp_path, tokenizer=str(tmp_path / "tokenizer.json")), log=lambda s: None)
    meta = load_meta(out)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_000 and meta["eot_id"] == 69_998
    tokens = np.concatenate([np.fromfile(out / f"{s}.bin", dtype=np.uint32) for s in ("train", "val")])
    assert tokens.max() == 69_998 and tokens.size == sum(len(d.split()) + 1 for d in docs)
    assert token_dtype(65_535) == np.uint16 and token_dtype(65_536) == np.uint32


def test_a_single_document_is_split_by_tokens(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "input.txt").write_text("".join(make_docs(10)))
    meta = load_meta(prepare_data(_cfg(tmp_path), log=lambda s: None))
    assert meta["split_by"] == "tokens" and meta["val_tokens"] > 0
    assert abs(meta["val_tokens"] / (meta["train_tokens"] + meta["val_tokens"]) - 0.05) < 0.01


RACE = """
import sys, time
from pathlib import Path
import nanotitan.data.prepare as P

read_source = P.iter_documents
def slow_source(cfg):  # hold the lock long enough that the others must wait for it
    time.sleep(0.5)
    yield from read_source(cfg)
P.iter_documents = slow_source

corpus, cache, me = sys.argv[1:]
Path(cache, f"ready{me}").parent.mkdir(parents=True, exist_ok=True)
Path(cache, f"ready{me}").touch()
while len(list(Path(cache).glob("ready*"))) < 3:  # start together
    time.sleep(0.01)
cfg = P.DataConfig(source=corpus, vocab_size=300, cache_dir=cache)
print(P.prepare_data(cfg, log=lambda s: print("LOG", s, flush=True)))
"""


def test_concurrent_prepares_build_once_and_agree(tmp_path):
    """Three processes racing: one prepares, two wait on the lock, all return the same complete directory."""
    write_txt(tmp_path / "corpus", make_docs(40, words=400))
    procs = [subprocess.Popen([sys.executable, "-c", RACE, str(tmp_path / "corpus"), str(tmp_path / "cache"), str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        outs.append(stdout)
    dirs = {o.strip().splitlines()[-1] for o in outs}
    assert len(dirs) == 1
    assert sum(o.count("trained a") for o in outs) == 1  # exactly one process did the work
    assert sum(o.count("waiting for another process") for o in outs) == 2
    entries = sorted(p.name for p in (tmp_path / "cache" / "prepared").iterdir())
    assert len(entries) == 2 and entries[1] == entries[0] + ".lock"  # no temp dirs left behind
    meta = json.loads((tmp_path / "cache" / "prepared" / entries[0] / "meta.json").read_text())
    assert meta["train_docs"] + meta["val_docs"] == 40


def test_val_split_depends_on_content_not_order():
    shas = [f"{i:02x}" * 20 for i in range(0, 200, 10)]  # 20 documents, sorted hashes
    lengths = list(range(100, 120))
    val = split_by_document(shas, lengths, 0.1)
    assert val == split_by_document(shas[::-1], lengths[::-1], 0.1)
    val_tokens = sum(n for h, n in zip(shas, lengths) if h in val)
    assert val == set(shas[:len(val)]) and 0.1 * sum(lengths) <= val_tokens < 0.1 * sum(lengths) + 120
    assert split_by_document(shas[:2], [10, 10_000], 0.01) == {shas[0]}  # always one doc each side
    assert split_by_document([shas[0], shas[0], shas[1]], [5, 5, 100], 0.01) == {shas[0]}  # copies stay together


def test_a_bpe_short_of_its_vocab_says_so_and_the_summary_reads(tmp_path):
    """A tiny corpus runs out of merges before data.vocab_size: one line says how far it got; `data prepare`'s report
    names the source, the counts and the tokenizer, not a dict of checksums."""
    write_txt(tmp_path / "corpus", ["ab ab ab", "ba ba"])
    lines = []
    out = prepare_data(DataConfig(source=str(tmp_path / "corpus"), vocab_size=4000, val_fraction=0.4,
                                  cache_dir=str(tmp_path / "cache")), log=lines.append)
    reached = load_meta(out)["vocab_size"]
    assert reached < 4000
    assert lines.count(prepare_mod.bpe_shortfall(reached, 4000)) == 1
    assert prepare_mod.bpe_shortfall(reached, 4000) == (
        f"data: warning: the BPE reached {reached} tokens, short of data.vocab_size=4000: the corpus has no more pairs "
        f"to merge (--data.vocab_size {reached} sizes the model to it, or give a larger corpus)")
    assert prepare_mod.bpe_shortfall(300, 300) == ""
    summary = prepare_mod.prepared_summary(out).splitlines()
    assert summary[0] == f"prepared {tmp_path / 'corpus'} -> {out}"
    assert summary[2] == (f"  tokenizer: byte-level BPE trained on the source (data.vocab_size 4000); {reached} tokens, "
                          f"end-of-text id {load_meta(out)['eot_id']}")
    assert "documents" in summary[1] and "sha1" not in "".join(summary)
