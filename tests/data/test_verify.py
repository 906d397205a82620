"""Prepared data is verified when it is opened (issue 27, item 2): meta.json records each token file's size, its
largest id and an xxh3-64 per block at prepare time; a damaged or mismatched file is refused in one line naming
the file, the first bad offset and how to re-prepare, never an IndexError per rank later. Directories prepared
before the checksums existed still open, with the id check only."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from nanotitan.config.config import DataConfig
from nanotitan.data import prepare as P
from nanotitan.data.sources import DataError
from tests.conftest import make_corpus

REDO = r"re-prepare it: delete (\S+) and run `nanotitan data prepare` \(or `nanotitan train`\) with the same --data options$"


@pytest.fixture
def prepared(tmp_path, monkeypatch):
    """A freshly prepared dir of a small corpus (its own cache: damaging it must not touch other tests')."""
    monkeypatch.delenv(P.VERIFIED_ENV, raising=False)
    cfg = DataConfig(source=str(make_corpus(tmp_path / "corpus", n_docs=12, words_per_doc=400)), vocab_size=300,
                     cache_dir=str(tmp_path / "cache"))
    out = P.prepare_data(cfg, log=lambda s: None)
    return cfg, out, P.load_meta(out)


def _refused(cfg, pattern: str) -> re.Match:
    with pytest.raises(DataError) as e:
        P.prepare_data(cfg, log=lambda s: None)
    line = str(e.value)
    assert "\n" not in line
    m = re.match(pattern + "; " + REDO, line)
    assert m, line
    return m


def test_meta_records_size_max_id_and_block_checksums(prepared, monkeypatch):
    cfg, out, meta = prepared
    monkeypatch.setattr(P, "BLOCK_BYTES", 4096)  # several blocks on a small file
    for split in P.SPLITS:
        tokens = np.fromfile(out / f"{split}.bin", dtype=meta["dtype"])
        facts = meta["files"][f"{split}.bin"]
        assert facts["bytes"] == tokens.nbytes and facts["max_token_id"] == int(tokens.max()) < meta["vocab_size"]
        assert len(facts["xxh3_64"]) == -(-tokens.nbytes // facts["block_bytes"])
    assert P.prepare_data(cfg, log=lambda s: None) == out  # verifies, and opens


def test_id_past_the_vocabulary_is_named_with_its_offset(prepared):
    """A damaged id (here 65535 at token 1001) is found by the vectorised max before any batch is drawn; deleting
    the directory as the line says and preparing again gives good data back."""
    cfg, out, meta = prepared
    tokens = np.memmap(out / "train.bin", dtype=meta["dtype"], mode="r+")
    tokens[1001] = 65535
    tokens.flush()
    del tokens
    m = _refused(cfg, rf"^prepared data {out}/train\.bin is damaged: token id 65535 at offset 1001 \(tokens\) is >= "
                      r"the tokenizer's vocab_size 300")
    assert m.group(1) == str(out)
    for p in out.iterdir():
        p.unlink()
    out.rmdir()
    assert P.prepare_data(cfg, log=lambda s: None) == out
    assert P.load_meta(out)["files"] == meta["files"]  # the same tokens as before the damage


def test_damage_inside_the_vocabulary_fails_the_checksum(prepared, monkeypatch):
    """Swapping ids for other valid ids trains silently without a checksum; with one it names the block."""
    cfg, out, meta = prepared
    tokens = np.fromfile(out / "val.bin", dtype=meta["dtype"])
    tokens[7] = (tokens[7] + 1) % meta["vocab_size"]
    tokens.tofile(out / "val.bin")
    _refused(cfg, rf"^prepared data {out}/val\.bin is damaged: tokens from offset 0 to {tokens.size} fail their "
                  r"checksum \(xxh3_64 of meta\.json\)")


def test_truncated_file_is_named(prepared):
    cfg, out, meta = prepared
    size = (out / "train.bin").stat().st_size
    os.truncate(out / "train.bin", size - 64)
    _refused(cfg, rf"^prepared data {out}/train\.bin is {size - 64} bytes, meta\.json says {size} \(truncated or "
                  rf"replaced: first bad offset {(size - 64) // 2} tokens\)")


def test_dirs_prepared_before_checksums_still_open_and_are_id_checked(prepared):
    cfg, out, meta = prepared
    old = {k: v for k, v in meta.items() if k != "files"}
    (out / "meta.json").write_text(json.dumps(old))
    assert P.prepare_data(cfg, log=lambda s: None) == out
    tokens = np.fromfile(out / "val.bin", dtype=meta["dtype"])
    tokens[-1] = 300  # the first id past a 300-token vocabulary
    tokens.tofile(out / "val.bin")
    _refused(cfg, rf"^prepared data {out}/val\.bin is damaged: token id 300 at offset {tokens.size - 1} \(tokens\) "
                  r"is >= the tokenizer's vocab_size 300")


def test_a_verified_dir_is_checked_again_once_its_files_change(prepared, monkeypatch):
    """The ranks a launcher starts skip a dir it verified (VERIFIED_ENV); a write since then is not skipped."""
    cfg, out, meta = prepared
    P.verify_prepared(out)
    assert os.environ[P.VERIFIED_ENV].startswith(f"{out}|")
    reads = []
    blocks = P._blocks
    monkeypatch.setattr(P, "_blocks", lambda *a: reads.append(a) or blocks(*a))
    P.verify_prepared(out)
    assert reads == []  # marked: nothing read
    tokens = np.fromfile(out / "train.bin", dtype=meta["dtype"])
    tokens[3] = 299 if tokens[3] != 299 else 298
    tokens.tofile(out / "train.bin")
    with pytest.raises(DataError, match="fail their checksum"):
        P.verify_prepared(out)


def test_garbled_meta_is_one_line(prepared):
    cfg, out, meta = prepared
    (out / "meta.json").write_text('{"dtype": "uint16", "voc')
    with pytest.raises(DataError, match=rf"^prepared data {out}/meta\.json is unreadable \(JSONDecodeError: "):
        P.prepare_data(cfg, log=lambda s: None)
