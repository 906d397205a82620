"""The seed's streaming loader: HF `datasets` stream -> shuffle -> split by data rank -> tokenize -> pack.

Each data rank reads its own part of one shuffled stream (same seed on every rank, so the same shard
order, then `split_dataset_by_node`), tokenizes it and packs documents, separated by EOT, into
windows of S+1 tokens. Unlike `indexed.py` the batches depend on the layout (data_world) and cannot
be resumed by step; use it for corpora too big to prepare.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import count, islice
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, IterableDataset

from nanotitan.config.config import Config, DataConfig
from nanotitan.data.indexed import columns
from nanotitan.data.prepare import doc_sha1, load_meta
from nanotitan.data.sources import DataError, stream_dataset
from nanotitan.data.tokenizer import eot_id

ENCODE_BATCH = 64  # documents per encode_batch call


class PackedTokenDataset(IterableDataset):
    """Yields (x, y) LongTensors [S] from this data rank's share of data.source, forever (or `epochs` times)."""

    def __init__(self, data: DataConfig, tokenizer: Tokenizer, seq_len: int, seed: int, rank: int,
                 world_size: int, shuffle: bool = True, exclude_sha1: frozenset[str] = frozenset(),
                 epochs: int | None = None, runs: list[tuple[int, int]] | None = None):
        self.seq_len, self.rank, self.world_size, self.epochs = seq_len, rank, world_size, epochs
        # context parallel: yield only these positions of each window (the whole stream is packed as without CP)
        self.cols = None if runs is None else torch.from_numpy(columns(runs))
        self.tokenizer, self.eot = tokenizer, eot_id(tokenizer)
        self.exclude_sha1 = frozenset(exclude_sha1)  # val documents of the prepared split
        self.source = data.source
        dataset, self.text_field = stream_dataset(data)
        if shuffle:
            # The same seed on every rank: all ranks agree on the shard order before splitting it.
            dataset = dataset.shuffle(seed=seed, buffer_size=data.shuffle_buffer)
        from datasets.distributed import split_dataset_by_node  # HF datasets only for this loader (not the default)

        self.dataset = split_dataset_by_node(dataset, rank=rank, world_size=world_size)

    def documents(self) -> Iterator[str]:
        """This rank's documents, epoch after epoch (each epoch reshuffled with seed + epoch)."""
        for epoch in count() if self.epochs is None else range(self.epochs):
            self.dataset.set_epoch(epoch)
            n_docs = 0
            for record in self.dataset:
                text = record[self.text_field]
                if text is not None and not isinstance(text, str):  # past data.max_docs, prepare never saw it
                    raise DataError(f"data.source={self.source!r}: field {self.text_field!r} holds "
                                    f"{type(text).__name__} {text!r:.40}, not a string; "
                                    f"set --data.text_field to the text field")
                if not text or text.isspace() or (self.exclude_sha1 and doc_sha1(text) in self.exclude_sha1):
                    continue
                n_docs += 1
                yield text
            if n_docs == 0:  # would otherwise spin forever without yielding
                raise DataError(f"data rank {self.rank} of {self.world_size} got no documents from the stream; "
                                f"use fewer data ranks (dp*ep) or a source with more files/records")

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        W = self.seq_len + 1
        carry = np.empty(0, dtype=np.int64)  # tokens left over from the previous documents
        docs = self.documents()
        while batch := list(islice(docs, ENCODE_BATCH)):
            pieces = [np.asarray(enc.ids + [self.eot], dtype=np.int64) for enc in self.tokenizer.encode_batch(batch)]
            tokens = np.concatenate([carry, *pieces])
            n = len(tokens) // W
            carry = tokens[n * W:]
            for window_W in torch.from_numpy(tokens[:n * W].reshape(n, W)):
                if self.cols is None:
                    yield window_W[:-1], window_W[1:]
                else:
                    yield window_W[self.cols], window_W[self.cols + 1]


def make_streaming_loader(cfg: Config, tokenizer: Tokenizer, data_rank: int, data_world: int, batch_size: int,
                          prepared: str | Path | None = None, runs: list[tuple[int, int]] | None = None
                          ) -> DataLoader:
    """DataLoader of (x, y) [batch_size, S] for one data rank; with `prepared`, its val documents are skipped; with
    `runs`, only those positions of each sequence."""
    exclude = frozenset(load_meta(prepared)["val_sha1"]) if prepared else frozenset()
    dataset = PackedTokenDataset(cfg.data, tokenizer, cfg.train.seq_len, cfg.train.seed, data_rank, data_world,
                                 exclude_sha1=exclude, runs=runs)
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=0)
