"""Reading a checkpoint's `.metadata` without running its bytes (issue 39): DCP writes it with pickle and its
FileSystemReader reads it back with `pickle.load`, which calls whatever the file names. A checkpoint copied from
elsewhere, or a snapshot unit a peer pushed, is then code. Here the same bytes are unpickled through an
allow-list: DCP's metadata dataclasses, torch.Size, torch dtypes and layouts, a path, and the containers pickle
builds without naming a class. Anything else stops the load before it is called, in one line naming it.

What a real `.metadata` names (torch 2.13, `pickletools.dis` of one DCP wrote): metadata.{Metadata,
TensorStorageMetadata, TensorProperties, ChunkStorageMetadata, MetadataIndex, StorageMeta, _MEM_FORMAT_ENCODING},
filesystem._StorageInfo, torch.Size, torch.<dtype>, torch.serialization._get_layout, pathlib.PosixPath.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..config.errors import CheckpointError

# module -> names it may give; each is a class whose construction only stores its arguments, or a lookup
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
                                              "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a name -> torch.layout lookup in a table
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id: the dir it was saved to
}


class UnsafeMetadataError(CheckpointError):
    """A `.metadata` names something that is not checkpoint metadata: nothing was called, nothing deleted."""


class _Refused(pickle.UnpicklingError):
    """What the allow-list refused (a truncated pickle raises UnpicklingError too)."""


class _AllowList(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # torch.float32 & co. pickle as a global: a value, not a callable
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid):
        raise _Refused(f"a persistent id {str(pid)[:40]!r}")


def safe_load_metadata(data: bytes, where: str) -> Metadata:
    """DCP's Metadata from `.metadata` bytes, unpickled through the allow-list. Raises UnsafeMetadataError
    naming `where` and the first thing the file holds that is not checkpoint metadata (nothing of it runs)."""
    try:
        md = _AllowList(io.BytesIO(data)).load()
    except _Refused as e:
        raise UnsafeMetadataError(f"{where} holds {e}, which is not checkpoint metadata") from None
    except Exception as e:  # noqa: BLE001 - a truncated or garbled pickle raises anything; only allowed code ran
        raise CheckpointError(f"{where} is unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(md, Metadata):
        raise UnsafeMetadataError(f"{where} holds a {type(md).__name__}, which is not checkpoint metadata")
    return md


def metadata_name(path: Path) -> str:
    """How a line names checkpoint dir `path`'s .metadata."""
    return str(Path(path) / ".metadata")


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader whose `.metadata` goes through the allow-list (dcp.load calls this on every rank)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            md = safe_load_metadata(f.read(), metadata_name(Path(self.path)))
        if getattr(md, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
