"""Tokenize data.source once into a cached directory of flat token files (nanoGPT's train.bin/val.bin).

    CACHE/prepared/<name>-<key>/
        train.bin  val.bin   token ids, np.uint16 (vocab <= 65535) or np.uint32; every document followed by EOT
        train.mask val.mask  data.format=sft only: the loss mask, one uint8 per token (data/sft.py)
        tokenizer.json       the BPE trained on the corpus (or a copy of data.tokenizer)
        meta.json            source, tokenizer, vocab_size, dtype, token/document counts, eot_id, val_sha1,
                             files: per token file its bytes, max_token_id and an xxh3-64 per 4 MiB block

The key hashes everything that changes the bytes (source identity, tokenizer, vocab_size, text_field,
max_docs, val_fraction). Several ranks may call `prepare_data` at once, before any process group
exists: an fcntl lock lets one prepare while the others wait, and the result appears atomically
(temp dir + rename), so a reader never sees half a directory.

Opening prepared data verifies it (`verify_prepared`): sizes, every id below the vocabulary (a vectorised max per
block) and each block's checksum, so a damaged or mismatched file is refused in one line naming the file, the
first bad offset and how to re-prepare, never an IndexError per rank or a device assert mid-run.
Directories prepared before the checksums were recorded get the id check only.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from fractions import Fraction
from itertools import islice
from pathlib import Path

import numpy as np
import xxhash
from tokenizers import Tokenizer

from nanotitan.config.config import DataConfig
from nanotitan.config.parse import parse_mix
from nanotitan.data import chat
from nanotitan.data.sft import encode_examples, iter_records
from nanotitan.data.sources import DataError, cache_root, iter_documents, source_fingerprint
from nanotitan.data.tokenizer import eot_id, load_tokenizer_file, train_bpe
from nanotitan.config.errors import StorageError, first_line, os_reason

FORMAT_VERSION = 1  # part of the cache key: bumping it re-prepares every corpus (the checksums were added without)
ENCODE_BATCH = 256  # documents per encode_batch call (the Rust side parallelises within a batch)
BLOCK_BYTES = 4 << 20  # checksum granularity: a damaged file is named with its first bad 4 MiB block
VERIFIED_ENV = "NANOTITAN_DATA_VERIFIED"  # the prepared dirs a process verified, one a line: its ranks skip them
SPLITS = ("train", "val")
UNWRITABLE = "point --data.cache_dir (or $NANOTITAN_CACHE) at a writable directory"
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a write that did not fit: a storage fault, not bad input


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
    """Where `prepare_data(cfg)` puts (or has put) its output; computing it reads no documents. With data.mix: the
    first source's, whose tokenizer every source of the mix is encoded with (`mix_sources`)."""
    if cfg.mix:
        cfg = mix_sources(cfg)[0][0]
    key = {"format": FORMAT_VERSION, "source": source_fingerprint(cfg), "val_fraction": cfg.val_fraction}
    if cfg.format != "text":  # a text corpus keeps the key it always had
        key["data_format"] = cfg.format
        if template := chat.load(cfg.tokenizer):  # the `messages` records' rendering
            key["chat_template"] = template.digest
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


def fingerprints(dirs: list[Path], mix: str = "") -> dict[str, str]:
    """What a checkpoint records of the data its run read (12 hex digits each): `data_fingerprint` hashes every
    source's token files (their checksums in meta.json; a directory prepared before those, its cache key) and
    data.mix's weights; `tokenizer_fingerprint` hashes the tokenizer.json the ids were made with."""
    data = hashlib.sha1(mix.encode())
    for d in dirs:
        data.update(json.dumps(load_meta(d).get("files") or Path(d).name, sort_keys=True).encode())
    tokenizer = hashlib.sha1((Path(dirs[0]) / "tokenizer.json").read_bytes())
    return {"data_fingerprint": data.hexdigest()[:12], "tokenizer_fingerprint": tokenizer.hexdigest()[:12]}


def bpe_shortfall(reached: int, asked: int) -> str:
    """'' when the BPE reached data.vocab_size, else the one line that says it did not: a small corpus runs out of
    pairs to merge (the ids above `reached` are never seen; the model's table still has data.vocab_size rows)."""
    if reached >= asked:
        return ""
    return (f"data: warning: the BPE reached {reached} tokens, short of data.vocab_size={asked}: the corpus has no "
            f"more pairs to merge (--data.vocab_size {reached} sizes the model to it, or give a larger corpus)")


def prepared_summary(prepared: str | Path) -> str:
    """`nanotitan data prepare`'s report of one prepared directory, for a person: where, from what, how much."""
    meta = load_meta(prepared)
    docs = (f"{meta['train_docs']:,} train + {meta['val_docs']:,} val documents" if meta.get("split_by") == "documents"
            else f"{meta['train_docs']:,} document, split by tokens")
    return (f"prepared {meta['source']} -> {prepared}\n"
            f"  {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens ({meta['dtype']}), {docs}\n"
            f"  tokenizer: {meta['tokenizer']}; {meta['vocab_size']} tokens, end-of-text id {meta['eot_id']}")


def load_tokenizer(prepared: str | Path) -> Tokenizer:
    return Tokenizer.from_file(str(Path(prepared) / "tokenizer.json"))


@contextmanager
def _file_lock(path: Path, log: Callable[[str], None]):
    try:
        fh = open(path, "a+")  # noqa: SIM115 - closed by the with below
    except OSError as e:  # the cache exists but cannot be written (permission, read-only file system)
        raise DataError(f"cannot write the data cache {path.parent} ({os_reason(e)}); {UNWRITABLE}") from None
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"data: waiting for another process preparing {path.with_suffix('').name}")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def mix_sources(cfg: DataConfig) -> list[tuple[DataConfig, Fraction]]:
    """data.mix's sources, each as the DataConfig it is prepared with, and their weights. One tokenizer for all:
    data.tokenizer, else the BPE trained on the first source (the others are encoded with its tokenizer.json)."""
    entries = parse_mix(cfg.mix)
    first = dataclasses.replace(cfg, source=entries[0][0], mix="")
    tokenizer = cfg.tokenizer or str(prepared_dir(first) / "tokenizer.json")
    return [(first, entries[0][1])] + [(dataclasses.replace(cfg, source=source, mix="", tokenizer=tokenizer), w)
                                       for source, w in entries[1:]]


def prepare_mix(cfg: DataConfig, log: Callable[[str], None] = print) -> list[Path]:
    """`nanotitan data prepare --data.mix`: every source of the mix prepared (the first first: its tokenizer encodes
    the others); their directories, in the mix's order."""
    return [prepare_data(part, log) for part, _ in mix_sources(cfg)]


def mix_dirs(cfg: DataConfig) -> list[Path]:
    """The prepared directories of data.mix's sources, verified, in the mix's order; a source not prepared with the
    mix's tokenizer is refused in one line naming the command that prepares it."""
    dirs = []
    for part, _ in mix_sources(cfg):
        out = prepared_dir(part)  # the first is checked before the others' keys read its tokenizer
        if not (out / "meta.json").exists():
            raise DataError(f"data.mix source {part.source!r} is not prepared with the mix's tokenizer: run "
                            f"`nanotitan data prepare --data.mix '{cfg.mix}'` with the same --data options")
        verify_prepared(out)
        dirs.append(out)
    return dirs


def prepare_data(cfg: DataConfig, log: Callable[[str], None] = print) -> Path:
    """Tokenized train/val token files for data.source, built once and cached; returns their directory, verified
    (`verify_prepared`) when it was prepared earlier. With data.mix, nothing is prepared (`prepare_mix` does): the
    directory of the mix's tokenizer (its first source's), once every source is found prepared (`mix_dirs`)."""
    if cfg.mix:
        return mix_dirs(cfg)[0]
    out = prepared_dir(cfg)
    if (out / "meta.json").exists():
        verify_prepared(out)
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, no permission
        raise DataError(f"cannot create the data cache {out.parent} ({e.strerror}); {UNWRITABLE}") from None
    with _file_lock(out.with_name(out.name + ".lock"), log):
        if (out / "meta.json").exists():  # another process finished while we waited
            verify_prepared(out)
            return out
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        except OSError as e:
            raise DataError(f"cannot write the data cache {out.parent} ({os_reason(e)}); {UNWRITABLE}") from None
        try:
            _prepare_into(cfg, tmp, log)
            tmp.rename(out)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if e.errno not in FULL:
                raise
            free = shutil.disk_usage(out.parent).free / 2**20
            raise StorageError(f"preparing {out} failed writing {e.filename or tmp}: {os_reason(e)}; "
                               f"{free:.1f} MiB free on {out.parent}; removed the partial {tmp.name} (make room, "
                               f"or {UNWRITABLE})") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def _blocks(path: Path, block_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(byte offset, bytes) of each `block_bytes` block of a file, in order."""
    with open(path, "rb") as f:
        offset = 0
        while chunk := f.read(block_bytes):
            yield offset, chunk
            offset += len(chunk)


def token_file_facts(path: Path, dtype: np.dtype) -> dict:
    """What `verify_prepared` checks a token file against: its size, its largest token id and an xxh3-64 per
    BLOCK_BYTES block (xxh3 reads at several GB/s; a max over a block's ids is vectorised)."""
    hashes, top = [], -1
    for _, chunk in _blocks(path, BLOCK_BYTES):
        hashes.append(xxhash.xxh3_64_hexdigest(chunk))
        top = max(top, int(np.frombuffer(chunk, dtype).max()))
    return {"bytes": path.stat().st_size, "max_token_id": top, "block_bytes": BLOCK_BYTES, "xxh3_64": hashes}


def _verified_mark(prepared: Path) -> str:
    """Identifies the token files as they are now: a write since (damage, a re-prepare) changes it."""
    stats = [p.stat() for split in SPLITS for p in (prepared / f"{split}.bin", prepared / f"{split}.mask")
             if p.name == f"{split}.bin" or p.exists()]
    return f"{prepared}|" + "|".join(f"{st.st_size}:{st.st_mtime_ns}" for st in stats)


def verify_prepared(prepared: str | Path) -> None:
    """Refuse damaged or mismatched prepared data with one DataError line naming the file, the first bad offset
    and how to re-prepare. Checks each token file's size against meta.json, every id against the tokenizer's
    vocab_size (which the trainer checks against model.vocab_size), and, when meta.json recorded them, each
    block's xxh3-64. A process that verified a dir marks it in VERIFIED_ENV, so the ranks a launcher starts
    afterwards (same files, unchanged) do not read them again."""
    prepared = Path(prepared)
    redo = (f"re-prepare it: delete {prepared} and run `nanotitan data prepare` (or `nanotitan train`) with the same "
            "--data options")
    try:
        meta = load_meta(prepared)
        np.dtype(meta["dtype"]), int(meta["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"prepared data {prepared / 'meta.json'} is unreadable ({first_line(e)}); {redo}") from None
    try:
        if _verified_mark(prepared) in os.environ.get(VERIFIED_ENV, "").split("\n"):
            return
    except OSError:
        pass  # a file is missing: the checks below name it
    dtype, vocab = np.dtype(meta["dtype"]), int(meta["vocab_size"])
    for split in SPLITS:
        _verify_file(prepared / f"{split}.bin", meta, dtype, vocab, meta.get(f"{split}_tokens", 0), redo)
        if meta.get("data_format") == "sft":  # the loss mask: 0 or 1 per token, as many as the tokens
            _verify_file(prepared / f"{split}.mask", meta, np.dtype(np.uint8), 2, meta[f"{split}_tokens"], redo)
    others = [m for m in os.environ.get(VERIFIED_ENV, "").split("\n") if m and not m.startswith(f"{prepared}|")]
    os.environ[VERIFIED_ENV] = "\n".join([_verified_mark(prepared), *others])  # a mix's sources: one mark each


def _verify_file(path: Path, meta: dict, dtype: np.dtype, vocab: int, n_tokens: int, redo: str) -> None:
    """One prepared file against meta.json: its size, every value below `vocab` (token ids; a mask's 0/1), each
    block's checksum."""
    facts = meta.get("files", {}).get(path.name, {})
    try:
        size = path.stat().st_size
    except OSError as e:
        raise DataError(f"prepared data {path} cannot be read ({os_reason(e)}); {redo}") from None
    want = facts.get("bytes", n_tokens * dtype.itemsize)
    if size != want:
        raise DataError(f"prepared data {path} is {size} bytes, meta.json says {want} (truncated or replaced: "
                        f"first bad offset {min(size, want) // dtype.itemsize} tokens); {redo}")
    if facts.get("max_token_id", -1) >= vocab:
        raise DataError(f"prepared data {path} holds value {facts['max_token_id']} but must stay below {vocab} "
                        f"(meta.json disagrees with itself); {redo}")
    block_bytes = int(facts.get("block_bytes", BLOCK_BYTES))
    hashes = facts.get("xxh3_64", [])
    for i, (offset, chunk) in enumerate(_blocks(path, block_bytes)):
        ids = np.frombuffer(chunk, dtype)
        if ids.size and int(ids.max()) >= vocab:
            j = int(np.argmax(ids >= vocab))
            bad = (f"loss mask value {int(ids[j])} at offset {offset // dtype.itemsize + j} (tokens) is not 0 or 1"
                   if path.suffix == ".mask" else f"token id {int(ids[j])} at offset {offset // dtype.itemsize + j} "
                   f"(tokens) is >= the tokenizer's vocab_size {vocab}")
            raise DataError(f"prepared data {path} is damaged: {bad}; {redo}")
        if i < len(hashes) and xxhash.xxh3_64_hexdigest(chunk) != hashes[i]:
            raise DataError(f"prepared data {path} is damaged: tokens from offset {offset // dtype.itemsize} "
                            f"to {(offset + len(chunk)) // dtype.itemsize} fail their checksum (xxh3_64 of "
                            f"meta.json); {redo}")


def _batches(docs: Iterator[str], n: int) -> Iterator[list[str]]:
    while batch := list(islice(docs, n)):
        yield batch


def _prepare_into(cfg: DataConfig, tmp: Path, log: Callable[[str], None]) -> None:
    t0 = time.perf_counter()
    if cfg.tokenizer:
        tok = load_tokenizer_file(cfg.tokenizer)
        tok_desc = str(Path(cfg.tokenizer).expanduser().resolve())
    else:
        tok = train_bpe(iter_documents(cfg) if cfg.format == "text" else
                        (text for _, spans, _ in iter_records(cfg) for text, _ in spans), cfg.vocab_size)
        tok_desc = f"byte-level BPE trained on the source (data.vocab_size {cfg.vocab_size})"
        log(f"data: trained a {tok.get_vocab_size()}-token byte-level BPE on {cfg.source} "
            f"in {time.perf_counter() - t0:.1f}s")
        if line := bpe_shortfall(tok.get_vocab_size(), cfg.vocab_size):
            log(line)
    tok.save(str(tmp / "tokenizer.json"))
    chat.save_beside(chat.load(cfg.tokenizer) if cfg.format == "sft" else None, tmp / "tokenizer.json")
    eot, vocab = eot_id(tok), tok.get_vocab_size()
    dtype = token_dtype(vocab)

    # Encode every document once, batched; each document is followed by EOT. SFT: each record, with its loss mask.
    t1 = time.perf_counter()
    docs: list[np.ndarray] = []
    shas: list[str] = []
    masks: list[np.ndarray] = []
    if cfg.format == "sft":
        for text, ids, mask in encode_examples(tok, iter_records(cfg), eot, dtype):
            docs.append(ids)
            masks.append(mask)
            shas.append(doc_sha1(text))
    for batch in _batches(iter_documents(cfg), ENCODE_BATCH) if cfg.format == "text" else ():
        for text, enc in zip(batch, tok.encode_batch(batch)):
            docs.append(np.append(np.array(enc.ids, dtype=np.int64), eot).astype(dtype))
            shas.append(doc_sha1(text))
    if not docs:
        raise DataError(f"data.source={cfg.source!r} holds no non-empty documents (--data.source)")
    if masks and len(set(shas)) < 2:
        raise DataError(f"data.source={cfg.source!r} holds {len(set(shas))} distinct SFT record; train and val need "
                        "one each at least (add records)")

    if len(set(shas)) == 1:
        # One distinct document (e.g. a single input.txt): split its tokens, the last val_fraction to val.
        cut = int(len(docs[0]) * (1 - cfg.val_fraction))
        chunks, split_by, val_sha1 = {"train": [docs[0][:cut]], "val": [docs[0][cut:]]}, "tokens", set()
    else:
        val_sha1 = split_by_document(shas, [len(d) for d in docs], cfg.val_fraction)
        chunks = {"train": [d for d, h in zip(docs, shas) if h not in val_sha1],
                  "val": [d for d, h in zip(docs, shas) if h in val_sha1]}
        split_by = "documents"

    counts, files = {}, {}
    for split in SPLITS:
        tokens = np.concatenate(chunks[split])
        tokens.tofile(tmp / f"{split}.bin")
        counts[split] = int(tokens.size)
        files[f"{split}.bin"] = token_file_facts(tmp / f"{split}.bin", dtype)  # read back: what was written
        if masks:  # in the same order as the tokens
            kept = [m for m, h in zip(masks, shas) if (h in val_sha1) == (split == "val")]
            np.concatenate(kept).tofile(tmp / f"{split}.mask")
            files[f"{split}.mask"] = token_file_facts(tmp / f"{split}.mask", np.dtype(np.uint8))
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
        "files": files,  # verify_prepared checks every open against these
        **({"data_format": "sft", "response_tokens": int(sum(m.sum() for m in masks))} if masks else {}),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    log(f"data: {len(docs)} documents -> {counts['train']:,} train + {counts['val']:,} val tokens ({dtype.name}) "
        f"in {time.perf_counter() - t1:.1f}s")
