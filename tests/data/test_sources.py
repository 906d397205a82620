"""Sources: local .txt/.jsonl/.parquet files yield their documents in a fixed order; bad input fails in one line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanotitan.config import ConfigError, DataConfig
from nanotitan.data.sources import iter_documents, source_fingerprint, source_kind, stream_dataset

WORDS = ("the king queen sword crown night day love death honour blood gentle lord lady heaven "
         "fortune grief mercy tongue heart eye hand soul father mother brother sister thee thou").split()


def make_docs(n_docs: int = 12, words: int = 150, seed: int = 0) -> list[str]:
    """Distinct pseudo-text documents (each opens with its own number)."""
    rng = random.Random(seed)
    return [f"Document {i}.\n" + " ".join(rng.choice(WORDS) for _ in range(words)) + ",\nand so to bed.\n"
            for i in range(n_docs)]


def write_txt(d: Path, docs: list[str]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(docs):
        (d / f"doc_{i:03d}.txt").write_text(text)
    return d


def test_txt_directory_and_glob_give_one_document_per_file_in_name_order(tmp_path):
    docs = make_docs()
    write_txt(tmp_path / "corpus", docs)
    (tmp_path / "corpus" / "notes.md").write_text("not a corpus file")
    assert list(iter_documents(DataConfig(source=str(tmp_path / "corpus")))) == docs
    assert list(iter_documents(DataConfig(source=str(tmp_path / "corpus" / "doc_00[0-4].txt")))) == docs[:5]
    assert list(iter_documents(DataConfig(source=str(tmp_path / "corpus"), max_docs=3))) == docs[:3]


def test_jsonl_reads_text_field_and_names_a_missing_field(tmp_path):
    docs = make_docs(5)
    f = tmp_path / "c.jsonl"
    f.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(docs)) + "\n")
    assert list(iter_documents(DataConfig(source=str(f), text_field="body"))) == docs
    with pytest.raises(ConfigError, match=r"no field 'text'.*--data.text_field"):
        list(iter_documents(DataConfig(source=str(f))))


def test_parquet_reads_text_column_and_skips_empty_documents(tmp_path):
    docs = make_docs(7)
    pq.write_table(pa.table({"content": docs[:3] + ["", "  \n"] + docs[3:]}), tmp_path / "c.parquet", row_group_size=2)
    assert list(iter_documents(DataConfig(source=str(tmp_path / "c.parquet"), text_field="content"))) == docs
    with pytest.raises(ConfigError, match="no column 'text'"):
        list(iter_documents(DataConfig(source=str(tmp_path / "c.parquet"))))


def test_bad_local_sources_fail_with_one_line_naming_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"matches no .*--data.source"):
        list(iter_documents(DataConfig(source=str(tmp_path / "*.txt"))))
    write_txt(tmp_path, make_docs(2))
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(ConfigError, match="mixes"):
        list(iter_documents(DataConfig(source=str(tmp_path))))


def test_source_kind_and_fingerprint_follow_the_files(tmp_path):
    assert source_kind("shakespeare") == "shakespeare"
    assert source_kind("roneneldan/TinyStories") == "hub"
    assert source_kind("data/*.txt") == "local" and source_kind("corpus.jsonl") == "local"
    write_txt(tmp_path, make_docs(3))
    cfg = DataConfig(source=str(tmp_path))
    before = source_fingerprint(cfg)
    assert source_fingerprint(cfg) == before
    (tmp_path / "doc_001.txt").write_text("changed, and longer than before")
    assert source_fingerprint(cfg) != before


def test_stream_dataset_sees_the_same_documents_as_iter_documents(tmp_path):
    docs = make_docs(6)
    write_txt(tmp_path, docs)
    ds, field = stream_dataset(DataConfig(source=str(tmp_path)))
    assert [r[field] for r in ds] == docs  # one record per file, line breaks kept
    f = tmp_path / "c.jsonl"
    f.write_text("".join(json.dumps({"body": t}) + "\n" for t in docs))
    ds, field = stream_dataset(DataConfig(source=str(f), text_field="body"))
    assert [r[field] for r in ds] == docs
