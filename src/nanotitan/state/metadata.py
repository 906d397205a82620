"""Reading a checkpoint's `.metadata` without running its bytes (issue 39): DCP writes it with pickle and its
FileSystemReader reads it back with `pickle.load`, which calls whatever the file names. A checkpoint copied from
elsewhere, or a snapshot unit a peer pushed, is then code. Here the same bytes are unpickled through an
allow-list: DCP's metadata dataclasses, torch.Size, torch dtypes and layouts, a path, and the containers pickle
builds without naming a class. Anything else stops the load before it is called, in one line naming it.
The unpickler is pickle's own Python one with its mutating opcodes checked (issue 49): BUILD sets attributes, and
on a class (BUILD on `PosixPath` set `PosixPath.is_relative_to` for the rest of the process) it bent the allowed
classes themselves. Here BUILD is refused unless its target is an instance of an allowed dataclass and its state
names only that class's declared fields (or is the tuple of TensorProperties' own __setstate__), and items are
added only to a plain list or dict, all checked before anything is set. dtypes come from a fixed table: never
`getattr(torch, name)`, which imports torch subpackages (`torch._dynamo`) on the way to refusing them.

What a real `.metadata` names (torch 2.13, `pickletools.dis` of one DCP wrote): metadata.{Metadata,
TensorStorageMetadata, TensorProperties, ChunkStorageMetadata, MetadataIndex, StorageMeta, _MEM_FORMAT_ENCODING},
filesystem._StorageInfo, torch.Size, torch.<dtype>, torch.serialization._get_layout, pathlib.PosixPath.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..config.errors import CheckpointError
from .manifest import open_plain

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


# torch.<name> -> dtype: besides Size, the only names of torch's a .metadata may give (a dtype pickles as a global);
# packing's gather names dtypes by these too
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint64, torch.uint32, torch.uint16, torch.uint8, torch.bool)}


def _fields(cls) -> frozenset[str] | None:
    """The declared fields BUILD may set on an instance of allowed class `cls` (None: BUILD is refused on it)."""
    return frozenset(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else None


class _AllowList(pickle._Unpickler):  # the Python unpickler: its opcodes can be checked (the C one's cannot)
    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and name in DTYPES:
            return DTYPES[name]  # torch.float32 & co.: a value from the table, nothing looked up in torch
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid):
        raise _Refused(f"a persistent id {str(pid)[:40]!r}")

    def load_build(self):
        state, inst = self.stack[-1], self.stack[-2]
        cls = type(inst)
        fields = None if isinstance(inst, type) else _FIELDS.get(cls)
        if fields is None:
            what = f"{inst.__module__}.{inst.__qualname__}" if isinstance(inst, type) else f"a {cls.__qualname__}"
            raise _Refused(f"a BUILD on {what} (sets attributes)")
        if "__setstate__" in vars(cls):  # TensorProperties: its own __setstate__ takes a tuple of its fields
            ok = isinstance(state, tuple) and len(state) <= len(fields)
        else:
            ok = isinstance(state, dict) and all(type(k) is str and k in fields for k in state)
        if not ok:
            raise _Refused(f"a BUILD of {cls.__qualname__} with state other than its fields")
        super().load_build()
    dispatch[pickle.BUILD[0]] = load_build


def _into(op: bytes, kind: type, target):
    """Opcode `op`'s loader, refusing unless what it adds items to (`target` of the unpickler) is a plain `kind`:
    APPEND and SETITEM call methods of whatever is below them on the stack."""
    load = pickle._Unpickler.dispatch[op[0]]

    def checked(u: _AllowList):
        if type(t := target(u)) is not kind:
            raise _Refused(f"items added to a {type(t).__qualname__}, not a {kind.__name__}")
        load(u)
    return checked


for _op, _kind, _target in ((pickle.APPEND, list, lambda u: u.stack[-2]),
                            (pickle.SETITEM, dict, lambda u: u.stack[-3]),
                            (pickle.APPENDS, list, lambda u: u.metastack[-1][-1]),  # the one below the mark
                            (pickle.SETITEMS, dict, lambda u: u.metastack[-1][-1])):
    _AllowList.dispatch[_op[0]] = _into(_op, _kind, _target)


_FIELDS = {c: f for c in (getattr(importlib.import_module(m), n) for m, names in _ALLOWED.items() for n in names)
           if (f := _fields(c)) is not None}  # allowed class -> the fields BUILD may set: its dataclasses only


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


class _PlainFiles(FileSystem):
    """DCP's file system, whose reads open only regular files and never through a symlink (manifest.open_plain)."""

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if mode != "rb":
            raise CheckpointError(f"a checkpoint reader opened {path} with mode {mode!r}")
        with open_plain(Path(path), buffering=-1) as f:
            yield f


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader whose `.metadata` goes through the allow-list (dcp.load calls this on every rank) and
    whose files are opened as plain files only (O_NOFOLLOW, regular)."""

    def __init__(self, path, *args, metadata: Metadata | None = None, **kwargs):
        """`metadata`: the `.metadata` its caller already read and checked, handed to DCP as it is: read again, a
        file swapped in between would be what DCP acts on (where each tensor's bytes are)."""
        super().__init__(path, *args, **kwargs)
        self.fs = _PlainFiles()
        self.checked = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self.checked is not None:
            md = self.checked
        else:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                md = safe_load_metadata(f.read(), metadata_name(Path(self.path)))
        if getattr(md, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
