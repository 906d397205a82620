"""PackedTokenDataset: a seeded, rank-split HF stream of local files, packed into S+1-token windows across documents."""

from __future__ import annotations

import json

import numpy as np
import torch

from nanotitan.config.config import Config, DataConfig
from nanotitan.data.prepare import load_meta, load_tokenizer, prepare_data
from nanotitan.data.streaming import PackedTokenDataset, make_streaming_loader
from nanotitan.data.tokenizer import train_bpe
from tests.helpers.data import make_docs, write_txt

S = 32


def _first(ds, n):
    it = iter(ds)
    return [next(it) for _ in range(n)]


def test_unshuffled_stream_is_the_documents_joined_by_eot(tmp_path):
    docs = make_docs(6)
    write_txt(tmp_path, docs)
    tok = train_bpe(docs, 300)
    ds = PackedTokenDataset(DataConfig(source=str(tmp_path)), tok, S, seed=0, rank=0, world_size=1,
                            shuffle=False, epochs=1)
    windows = list(ds)
    eot = tok.token_to_id("<|endoftext|>")
    expected = np.concatenate([tok.encode(d).ids + [eot] for d in docs])
    assert len(windows) == len(expected) // (S + 1)
    got = torch.cat([torch.cat([x[:1], y]) for x, y in windows]).numpy()  # each window = x[0] + y
    assert np.array_equal(got, expected[:len(got)])
    assert all(torch.equal(x[1:], y[:-1]) and x.dtype == torch.long for x, y in windows)


def test_cp_ranks_read_their_chunks_of_each_window(tmp_path):
    """Context parallel: with `runs` each window yields only those positions of its inputs and targets (CP rank i's
    chunks i and 2cp-1-i), the same stream as without them."""
    docs = make_docs(6)
    write_txt(tmp_path, docs)
    tok = train_bpe(docs, 300)
    whole = _first(PackedTokenDataset(DataConfig(source=str(tmp_path)), tok, S, seed=0, rank=0, world_size=1), 5)
    runs = [(8, 8), (16, 8)]  # cp 2, rank 1: chunks 1 and 2 of 4
    part = _first(PackedTokenDataset(DataConfig(source=str(tmp_path)), tok, S, seed=0, rank=0, world_size=1,
                                     runs=runs), 5)
    for (x, y), (xi, yi) in zip(whole, part):
        assert torch.equal(xi, x[8:24]) and torch.equal(yi, y[8:24])


def test_same_seed_same_stream_and_new_seed_new_order(tmp_path):
    docs = make_docs(16)
    write_txt(tmp_path, docs)
    tok = train_bpe(docs, 300)
    cfg = DataConfig(source=str(tmp_path), shuffle_buffer=8)
    a = _first(PackedTokenDataset(cfg, tok, S, seed=1, rank=0, world_size=1), 20)
    b = _first(PackedTokenDataset(cfg, tok, S, seed=1, rank=0, world_size=1), 20)
    c = _first(PackedTokenDataset(cfg, tok, S, seed=2, rank=0, world_size=1), 20)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(a, c))


def test_data_ranks_read_disjoint_documents_covering_the_corpus(tmp_path):
    tok = train_bpe(make_docs(4), 300)
    for n_files, world in ((8, 2), (7, 3)):  # shards split evenly, and split by example
        docs = make_docs(n_files, words=20, seed=n_files)
        src = write_txt(tmp_path / f"c{n_files}", docs)
        per_rank = [list(PackedTokenDataset(DataConfig(source=str(src)), tok, S, seed=5, rank=r,
                                            world_size=world, epochs=1).documents()) for r in range(world)]
        seen = [d for rank_docs in per_rank for d in rank_docs]
        assert sorted(seen) == sorted(docs), (n_files, world)  # each document on exactly one rank
        assert all(per_rank)


def test_loader_batches_jsonl_and_skips_prepared_val_documents(tmp_path):
    docs = make_docs(20, words=60)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = Config(data=DataConfig(source=str(tmp_path / "corpus"), vocab_size=300, cache_dir=str(tmp_path / "cache")))
    cfg.train.seq_len = S
    prepared = prepare_data(cfg.data, log=lambda s: None)
    tok = load_tokenizer(prepared)
    loader = make_streaming_loader(cfg, tok, data_rank=0, data_world=1, batch_size=3, prepared=prepared)
    x, y = next(iter(loader))
    assert x.shape == y.shape == (3, S) and torch.equal(x[:, 1:], y[:, :-1])
    meta = load_meta(prepared)
    assert loader.dataset.exclude_sha1 == frozenset(meta["val_sha1"]) and meta["val_docs"] >= 1
    kept = list(PackedTokenDataset(cfg.data, tok, S, seed=0, rank=0, world_size=1, epochs=1,
                                   exclude_sha1=loader.dataset.exclude_sha1).documents())
    assert len(kept) == meta["train_docs"] == len(docs) - meta["val_docs"]
