"""Tokenize data.source once into a cached directory of flat token files (nanoGPT's train.bin/val.bin).

    CACHE/prepared/<name>-<key>/
        train.bin  val.bin   token ids, np.uint16 (vocab <= 65535) or np.uint32; every document followed by EOT
        tokenizer.json       the BPE trained on the corpus (or a copy of data.tokenizer)
        meta.json            source, tokenizer, vocab_size, dtype, token/document counts, eot_id, val_sha1

The key hashes everything that changes the bytes (source identity, tokenizer, vocab_size, text_field,
max_docs, val_fraction). Several ranks may call `prepare_data` at once, before any process group
exists: an fcntl lock lets one prepare while the others wait, and the result appears atomically
(temp dir + rename), so a reader never sees half a directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import islice
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from nanotitan.config import DataConfig
from nanotitan.data.sources import DataError, cache_root, iter_documents, source_fingerprint
from nanotitan.data.tokenizer import eot_id, load_tokenizer_file, train_bpe

FORMAT_VERSION = 1
ENCODE_BATCH = 256  # documents per encode_batch call (the Rust side parallelises within a batch)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def doc_sha1(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8", errors="replace")).hexdigest()


def split_by_document(shas: list[str], lengths: list[int], val_fraction: float) -> set[str]:
    """The val documents' hashes: smallest hashes first until val holds val_fraction of the tokens.

    Content (not position) decides, so the split does not depend on file order, the streaming loader can
    drop the same documents from any shuffled stream, and copies of a val document all go to val.
    At least one document goes to each side.
    """
    tokens_by_sha: dict[str, int] = {}
    for sha, n in zip(shas, lengths):
        tokens_by_sha[sha] = tokens_by_sha.get(sha, 0) + n
    target, val, val_tokens = val_fraction * sum(lengths), set(), 0
    for sha in sorted(tokens_by_sha)[:-1]:
        if val and val_tokens >= target:
            break
        val.add(sha)
        val_tokens += tokens_by_sha[sha]
    return val


def prepared_dir(cfg: DataConfig) -> Path:
    """Where `prepare_data(cfg)` puts (or has put) its output; computing it reads no documents."""
    key = {"format": FORMAT_VERSION, "source": source_fingerprint(cfg), "val_fraction": cfg.val_fraction}
    if cfg.tokenizer:
        tok_path = Path(cfg.tokenizer).expanduser().resolve()
        if not tok_path.is_file():
            raise DataError(f"data.tokenizer={cfg.tokenizer!r}: no such file "
                            f"(give a tokenizer.json, or '' to train one)")
        key["tokenizer"] = hashlib.sha1(tok_path.read_bytes()).hexdigest()
    else:
        key["tokenizer"] = {"bpe": cfg.vocab_size}
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(cfg.source.rstrip("/*")).name or "source")[:40]
    vocab = "tok" if cfg.tokenizer else f"v{cfg.vocab_size}"
    return cache_root(cfg) / "prepared" / f"{name}-{vocab}-{digest}"


def load_meta(prepared: str | Path) -> dict:
    return json.loads((Path(prepared) / "meta.json").read_text())


def load_tokenizer(prepared: str | Path) -> Tokenizer:
    return Tokenizer.from_file(str(Path(prepared) / "tokenizer.json"))


@contextmanager
def _file_lock(path: Path, log: Callable[[str], None]):
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"data: waiting for another process preparing {path.with_suffix('').name}")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def prepare_data(cfg: DataConfig, log: Callable[[str], None] = print) -> Path:
    """Tokenized train/val token files for data.source, built once and cached; returns their directory."""
    out = prepared_dir(cfg)
    if (out / "meta.json").exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, no permission
        raise DataError(f"cannot create the data cache {out.parent} ({e.strerror}); "
                        f"point --data.cache_dir (or $NANOTITAN_CACHE) at a writable directory") from None
    with _file_lock(out.with_name(out.name + ".lock"), log):
        if (out / "meta.json").exists():  # another process finished while we waited
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            _prepare_into(cfg, tmp, log)
            tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def _batches(docs: Iterator[str], n: int) -> Iterator[list[str]]:
    while batch := list(islice(docs, n)):
        yield batch


def _prepare_into(cfg: DataConfig, tmp: Path, log: Callable[[str], None]) -> None:
    t0 = time.perf_counter()
    if cfg.tokenizer:
        tok = load_tokenizer_file(cfg.tokenizer)
        tok_desc = str(Path(cfg.tokenizer).expanduser().resolve())
    else:
        tok = train_bpe(iter_documents(cfg), cfg.vocab_size)
        tok_desc = f"byte-level BPE trained on the source, vocab {cfg.vocab_size}"
        log(f"data: trained a {tok.get_vocab_size()}-token byte-level BPE on {cfg.source} "
            f"in {time.perf_counter() - t0:.1f}s")
    tok.save(str(tmp / "tokenizer.json"))
    eot, vocab = eot_id(tok), tok.get_vocab_size()
    dtype = token_dtype(vocab)

    # Encode every document once, batched; each document is followed by EOT.
    t1 = time.perf_counter()
    docs: list[np.ndarray] = []
    shas: list[str] = []
    for batch in _batches(iter_documents(cfg), ENCODE_BATCH):
        for text, enc in zip(batch, tok.encode_batch(batch)):
            docs.append(np.append(np.array(enc.ids, dtype=np.int64), eot).astype(dtype))
            shas.append(doc_sha1(text))
    if not docs:
        raise DataError(f"data.source={cfg.source!r} holds no non-empty documents (--data.source)")

    if len(set(shas)) == 1:
        # One distinct document (e.g. a single input.txt): split its tokens, the last val_fraction to val.
        cut = int(len(docs[0]) * (1 - cfg.val_fraction))
        chunks, split_by, val_sha1 = {"train": [docs[0][:cut]], "val": [docs[0][cut:]]}, "tokens", set()
    else:
        val_sha1 = split_by_document(shas, [len(d) for d in docs], cfg.val_fraction)
        chunks = {"train": [d for d, h in zip(docs, shas) if h not in val_sha1],
                  "val": [d for d, h in zip(docs, shas) if h in val_sha1]}
        split_by = "documents"

    counts = {}
    for split in ("train", "val"):
        tokens = np.concatenate(chunks[split])
        tokens.tofile(tmp / f"{split}.bin")
        counts[split] = int(tokens.size)
    meta = {
        "format": FORMAT_VERSION,
        "source": cfg.source,
        "source_fingerprint": source_fingerprint(cfg),
        "tokenizer": tok_desc,
        "tokenizer_path": "tokenizer.json",
        "vocab_size": vocab,
        "dtype": dtype.name,
        "eot_id": eot,
        "train_tokens": counts["train"],
        "val_tokens": counts["val"],
        "train_docs": len(chunks["train"]),
        "val_docs": len(chunks["val"]) if split_by == "documents" else 0,
        "split_by": split_by,
        "val_fraction": cfg.val_fraction,
        "val_sha1": sorted(val_sha1),  # the streaming loader skips these documents
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    log(f"data: {len(docs)} documents -> {counts['train']:,} train + {counts['val']:,} val tokens ({dtype.name}) "
        f"in {time.perf_counter() - t1:.1f}s")
