"""The snapshot format (elastic/snapshot.py writes it): this rank's pieces packed into one host buffer, written as
one raw file.

A snapshot is a checkpoint whose shards are raw bytes instead of DCP's torch.save records: rank r's pieces, copied
at the step boundary into one flat buffer, are written as `__r_0.raw` in a single write, and the buffer's xxh3 is
the shard's checksum. `.metadata` is DCP's own Metadata (each piece's key, offsets and sizes, and where its bytes
are), built once per generation, so load_checkpoint reshards a snapshot onto any layout through DCP's planner
exactly as it does a checkpoint; only the reading of a chunk's bytes differs (CheckpointReader).
Why not DCP's writer: it pushes each of a rank's ~280 pieces through torch.save in Python, holding the GIL that
the rank's training needs: 83 ms of the thread's CPU per snapshot of the default model in one process, against
13 ms for all of this thread's work (docs/elastic.md, "What a snapshot costs").
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.futures import Future

from ..parallel.comm import collectives as comm
from .keys import keyed_state, rng_key
from .manifest import read_plain
from .metadata import DTYPES, SafeReader

RAW_SHARD = "__{rank}_0.raw"
_ALIGN = 64  # each piece's byte offset in a .raw shard: a multiple of every dtype's size


class CheckpointReader(SafeReader):
    """The reader of every load (checkpoint.load_checkpoint): DCP's FileSystemReader with `.metadata` through the
    allow-list (metadata.SafeReader), that also reads `.raw` shards: each chunk's bytes as they were in memory
    (C order, the dtype of its key's metadata) at the offset its storage entry names."""

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.tensors = metadata.state_dict_metadata

    def read_data(self, plan: LoadPlan, planner):
        raw: dict[str, list] = {}
        rest = []
        for req in plan.items:
            rel = self.storage_data[req.storage_index].relative_path
            (raw.setdefault(rel, []) if rel.endswith(".raw") else rest).append(req)
        if rest:
            super().read_data(LoadPlan(rest), planner)
        for rel, reqs in raw.items():
            data = torch.frombuffer(bytearray(read_plain(Path(self.path, rel))), dtype=torch.uint8)
            for req in reqs:
                info, md = self.storage_data[req.storage_index], self.tensors[req.storage_index.fqn]
                sizes = next(c.sizes for c in md.chunks if c.offsets == req.storage_index.offset)
                chunk = data[info.offset:info.offset + info.length].view(md.properties.dtype).view(sizes)
                for dim, (start, n) in enumerate(zip(req.storage_offsets, req.lengths)):  # the part this box needs
                    chunk = chunk.narrow(dim, start, n)
                target = planner.resolve_tensor(req).detach()
                target.copy_(chunk)
                planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut


class SnapshotPacking:
    """Which pieces this rank writes into a snapshot, where each sits in its flat buffer, and the snapshot's DCP
    metadata: fixed for a generation (its layout and state do not change), so built once, by one gather (JSON).
    A piece that several ranks hold (a replicated parameter at zero 0, say) is written by one of them: the holder
    with the fewest bytes so far, as DCP's dedup does, so the dp replicas split the work."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, shard=None, group=None):
        """Collective on `group` (every rank, the same step)."""
        rank = comm.world_rank()
        mine = [(k, tuple(o), tuple(t.shape), tuple(c.shape), t.dtype)
                for k, c in keyed_state(model, optimizer, shard).items() for o, t in c.boxes.items()]
        rng = torch.get_rng_state()
        mine.append((rng_key(rank), (0,), tuple(rng.shape), tuple(rng.shape), rng.dtype))
        sent = [(k, o, s, whole, str(dtype).removeprefix("torch.")) for k, o, s, whole, dtype in mine]
        lists = gather_json(sent, group) if comm.distributed() else [sent]
        pieces: dict[tuple, tuple] = {}  # (key, offsets) -> (sizes, whole size, dtype, holders)
        for r, lst in enumerate(lists):
            for k, o, s, whole, dtype in lst:  # JSON's lists back to tuples, a dtype's name to it (a fixed table)
                pieces.setdefault((k, tuple(o)), (tuple(s), tuple(whole), DTYPES[dtype], []))[3].append(r)
        assigned = [0] * len(lists)  # bytes per rank so far
        files: list[list] = [[] for _ in lists]  # rank -> [(key, offsets, sizes, dtype)] it writes, in file order
        for (k, o), (s, _whole, dtype, holders) in sorted(pieces.items(), key=lambda p: (str(p[1][2]), p[0])):
            r = min(holders, key=lambda h: (assigned[h], h))
            assigned[r] += _nbytes(s, dtype)
            files[r].append((k, o, s, dtype))
        # the metadata: every key's chunks, and where each chunk's bytes are
        tensors: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, _StorageInfo] = {}
        for r, lst in enumerate(files):
            at = 0
            for k, o, s, dtype in lst:
                whole = pieces[(k, o)][1]
                md = tensors.setdefault(k, TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(whole), []))
                md.chunks.append(ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)))
                storage[MetadataIndex(k, o)] = _StorageInfo(RAW_SHARD.format(rank=r), at, _nbytes(s, dtype))
                at = _aligned(at + _nbytes(s, dtype))
        self.metadata = pickle.dumps(Metadata(state_dict_metadata=tensors, storage_data=storage))
        self.file = RAW_SHARD.format(rank=rank)
        # this rank's buffer, and a view of it per piece it writes
        self.keys = [(k, o) for k, o, _s, _d in files[rank]]
        self.buffer = torch.zeros(sum(_aligned(_nbytes(s, d)) for _k, _o, s, d in files[rank]), dtype=torch.uint8)
        self.views = [self._view(storage[MetadataIndex(k, o)], s, d) for k, o, s, d in files[rank]]
        self.length = max((storage[MetadataIndex(k, o)].offset + storage[MetadataIndex(k, o)].length
                           for k, o in self.keys), default=0)
        spans: dict[torch.dtype, tuple[int, int]] = {}  # the pieces of one dtype are contiguous (sorted so above)
        for k, o, s, d in files[rank]:
            if d.is_floating_point:
                info = storage[MetadataIndex(k, o)]
                spans[d] = (spans.get(d, (info.offset,))[0], info.offset + info.length)
        self.regions = {d: self.buffer[lo:hi].view(d) for d, (lo, hi) in spans.items()}  # for nonfinite

    def _view(self, info, sizes, dtype) -> torch.Tensor:
        return self.buffer[info.offset:info.offset + info.length].view(dtype).view(sizes)

    def stage(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, shard=None) -> None:
        """Copy this rank's pieces of the live state (and its RNG state) into the buffer, which the next optimizer
        step cannot change. The step boundary's only cost."""
        live = keyed_state(model, optimizer, shard)
        rng = rng_key(comm.world_rank())
        srcs = [torch.get_rng_state() if k == rng else live[k].box(o) for k, o in self.keys]
        with torch.no_grad():
            torch._foreach_copy_(self.views, srcs)

    def nonfinite(self) -> str:
        """'' when every floating piece in the buffer is finite, else the first key holding NaN/inf. One 2-norm per
        dtype span (its gaps between pieces are zeros; the 2-norm also overflows for |x| > 1e19, so a hit is
        confirmed piece by piece)."""
        for d, span in self.regions.items():
            if not bool(torch.linalg.vector_norm(span).isfinite()):
                for (k, _o), v in zip(self.keys, self.views):
                    if v.dtype == d and not bool(v.isfinite().all()):
                        return k
        return ""

    def write(self, dir: Path) -> dict[str, dict]:
        """Write the buffer as this rank's shard in `dir`; {file: its bytes and xxh3-64}, hashed from the buffer
        (the bytes just written: a copy that differs is caught where every copy is checked, at push and at
        assembly). One write (which releases the GIL) and one hash (~1 ms for 14 MiB)."""
        return {self.file: write_raw(dir / self.file, memoryview(self.buffer.numpy())[:self.length])}

    def digest(self) -> dict[str, dict]:
        """{file: bytes and xxh3-64} of this rank's shard as `write` would write it, without writing it (a full
        disk: another rank writes it, checked against this)."""
        data = memoryview(self.buffer.numpy())[:self.length]
        return {self.file: {"bytes": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)}}


def write_raw(path: Path, data: memoryview) -> dict:
    """`data` written as the file `path` in one write; its bytes and xxh3-64 (of the buffer written from)."""
    with open(path, "wb") as f:
        f.write(data)
    return {"bytes": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)}


def gather_json(obj, group=None) -> list:
    """Collective on `group` (CPU tensors: a gloo group): every rank's `obj`, sent as JSON bytes in two all_gathers
    of uint8 tensors. Not torch's all_gather_object, which unpickles what each peer sends: whoever joins the
    rendezvous could run code in every rank; JSON is only ever data."""
    dist = torch.distributed
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=group)
    top = max(int(n) for n in sizes)
    out = [torch.empty(top, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, torch.cat([data, torch.zeros(top - data.numel(), dtype=torch.uint8)]), group=group)
    return [json.loads(bytes(o[:int(n)].numpy())) for o, n in zip(out, sizes)]


def _nbytes(sizes: tuple, dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for s in sizes:
        n *= s
    return n


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN
