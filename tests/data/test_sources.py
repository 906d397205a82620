"""Sources: local .txt/.jsonl/.parquet files yield their documents in a fixed order; bad input fails in one line."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanotitan.config.config import ConfigError, DataConfig
from nanotitan.data.sources import iter_documents, source_fingerprint, source_kind, stream_dataset
from tests.helpers.data import make_docs, write_txt


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


# --- issue 12: every data error is one line naming FILE[:LINE], and the launcher prints just that line ----
def _error(cfg: DataConfig) -> str:
    with pytest.raises(ConfigError) as e:
        list(iter_documents(cfg))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_jsonl_errors_name_file_and_line(tmp_path):
    f = tmp_path / "c.jsonl"
    ok = '{"text": "first document"}\n{"text": null}\n\n'  # a null is an empty document, skipped like ""
    f.write_text(ok + '{"text": "x"\n')
    assert _error(DataConfig(source=str(f))) == (
        f"{f}:4: not valid JSON (Expecting ',' delimiter, column 13); a .jsonl file holds one JSON object per line")
    f.write_text(ok + '["a list"]\n')
    assert _error(DataConfig(source=str(f))) == (
        f"{f}:4: a JSON list where an object belongs; a .jsonl file holds one JSON object per line")
    f.write_text(ok + '{"text": 5}\n')
    assert _error(DataConfig(source=str(f))) == (
        f"{f}:4: field 'text' holds int 5, not a string; set --data.text_field to the text field")
    f.write_bytes(ok.encode() + b'{"text": "caf\xe9"}\n')
    assert _error(DataConfig(source=str(f))) == (
        f"{f}:4: not UTF-8 text (byte 0xe9: invalid continuation byte); convert the file to UTF-8 "
        f"(e.g. iconv -f latin1 -t utf-8) or remove it from --data.source")
    f.write_text(ok)
    assert list(iter_documents(DataConfig(source=str(f)))) == ["first document"]


def test_txt_not_utf8_or_binary_is_refused_naming_the_file(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"line one\nline two\nthe caf\xe9\n")
    assert _error(DataConfig(source=str(f))) == (
        f"{f}:3: not UTF-8 text (byte 0xe9: invalid continuation byte); convert the file to UTF-8 "
        f"(e.g. iconv -f latin1 -t utf-8) or remove it from --data.source")
    f.write_bytes(bytes(range(256)) * 8)  # a binary blob
    assert _error(DataConfig(source=str(f))) == (
        f"{f}: looks binary, not UTF-8 text (NUL bytes in its first 1024 bytes; UTF-16? convert it to UTF-8); "
        f"remove it from --data.source")
    f.write_bytes(bytes(range(14, 27)) * 80)  # no NUL, but nothing but control bytes
    assert _error(DataConfig(source=str(f))).startswith(f"{f}: looks binary, not UTF-8 text (1024 control bytes")
    f.write_text("héllo\n", encoding="utf-16")
    assert "NUL bytes" in _error(DataConfig(source=str(f)))
    text = "ACT I.\fSCENE I.\tA room.\r\n\x1b[1mbold\x1b[0m — ünïcödé\n" * 50  # real text keeps its odd bytes
    f.write_text(text)
    assert list(iter_documents(DataConfig(source=str(f)))) == [text]


def test_parquet_non_string_column_and_unreadable_file_name_the_file(tmp_path):
    f = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), f)
    assert _error(DataConfig(source=str(f))) == (
        f"{f}: column 'text' holds int64, not strings; set --data.text_field to the text column")
    f.write_bytes(b"not parquet at all")
    assert _error(DataConfig(source=str(f))).startswith(f"{f}: not a readable parquet file (")


def test_bare_name_with_the_hub_unreachable_fails_at_once(monkeypatch):
    """Not a local path and no hub: one line within a second, not datasets' ~27 s of retries."""
    import time

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    t0 = time.perf_counter()
    msg = _error(DataConfig(source="foo"))
    assert time.perf_counter() - t0 < 3.5
    assert msg.startswith("data.source='foo' is not a local path and the Hugging Face hub is unreachable "
                          "(http://127.0.0.1:9: ")
    assert msg.endswith("; HF_HUB_OFFLINE=1 reads a cached copy); point at local files instead: "
                        "--data.source 'path/to/*.txt'")


def test_cli_data_errors_are_one_line_before_any_rank_starts(tmp_path):
    """`train` on 2 ranks prepares the data in the launcher: a bad file is its one line, exit 2, no rank
    started; a bare name with HF_HUB_OFFLINE set says so at once; an unusable cache dir is one line."""
    import os
    import subprocess
    import sys
    import time

    bad = tmp_path / "c.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": ["a", "list"]}\n')
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = {**os.environ, "NANOTITAN_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    cases = [
        (["train", "--parallel.dp", "2", "--data.source", str(bad), "--run.dir", str(tmp_path / "run")],
         f"{bad}:2: field 'text' holds list ['a', 'list'], not a string; set --data.text_field to the text field"),
        (["data", "prepare", "--data.source", "foo"],
         "data.source='foo' is not a local path and not in the datasets cache (HF_HUB_OFFLINE is set) ("),
        (["data", "prepare", "--data.source", str(bad), "--data.cache_dir", f"{blocker}/cache"],
         f"cannot create the data cache {blocker}/cache/prepared (Not a directory); point --data.cache_dir "
         f"(or $NANOTITAN_CACHE) at a writable directory"),
    ]
    for args, msg in cases:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "nanotitan.cli", *args], capture_output=True, text=True,
                           timeout=120, env=env)
        assert time.perf_counter() - t0 < 30
        assert (r.returncode, r.stdout, len(r.stderr.splitlines())) == (2, "", 1), r.stderr
        assert r.stderr.startswith(f"nanotitan: config error: {msg}")
    assert not (tmp_path / "run").exists()
