"""The global keys of a checkpoint: this rank's pieces of every tensor, under names that do not depend on the
(dp, pp, ep) layout or the zero level (checkpoint.py lists them). Save, load and the snapshot packing all read
the live state through `keyed_state`."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..parallel.dp.sync import Pieces, replicated_pieces
from ..parallel.shard import grad_layout
from ..parallel.where import placed


class Chunks:
    """This rank's boxes of one global tensor, in the form DCP writes and reads (its `_Checkpointable` hooks, as
    a DTensor has): each box is one chunk of the key's metadata, at its offsets. Saving writes the boxes (views
    of live storage, copied one at a time as they are written); loading reads into them whatever chunks any
    layout wrote that overlap them (an old checkpoint's whole tensor included), one stored chunk at a time."""

    def __init__(self, size: torch.Size, boxes: list[tuple[tuple[int, ...], torch.Tensor]]):
        self.shape, self.boxes = torch.Size(size), {torch.Size(o): t for o, t in boxes if t.numel() or not t.dim()}

    def size(self) -> torch.Size:
        return self.shape

    def box(self, offsets) -> torch.Tensor:
        return self.boxes[torch.Size(offsets)]

    def __create_write_items__(self, fqn: str, _obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=o, sizes=t.shape),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.shape))
                for o, t in self.boxes.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=t.shape) for o, t in self.boxes.items()]



def keyed_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, shard) -> dict[str, Chunks]:
    """{global key: this rank's Chunks of it}: `GradSync.sharded_state` (the live tensors' pieces, whatever
    the zero level) placed in the global tensors by parallel/where.py (TP slices at their offsets, an expert
    tensor [E_local, ...] split per global expert id). The keys and each tensor's whole shape do not depend on the
    zero level or the layout, so any layout reads any other's checkpoint (and those written whole, before the
    pieces)."""
    if optimizer is not None:
        optimizer.ensure_state()  # an optimizer that has not stepped is saved and loaded as one that has
    model_state, optim_state = shard.sync.sharded_state(optimizer) if shard is not None else \
        replicated_pieces(model, optimizer)
    # sharded_state holds the parameters; persistent buffers (router_bias) are never sharded: the live ones
    tensors = {**dict(model.state_dict(keep_vars=True)), **dict(model.named_parameters())}
    for name, t in tensors.items():
        model_state.setdefault(name, Pieces.whole(t))
    out: dict[str, Chunks] = {}
    for name, pieces in model_state.items():
        for suffix, p in placed(model, name, grad_layout(tensors[name]), pieces).items():
            out[f"model.{name}{suffix}"] = Chunks(p.size, p.boxes)
    for name, st in optim_state.items():
        for k, pieces in st.items():
            for suffix, p in placed(model, name, grad_layout(tensors[name]), pieces).items():
                out[f"optim.{name}{suffix}.{k}"] = Chunks(p.size, p.boxes)
    return out


def keyed_grads(model: torch.nn.Module, shard) -> dict[str, Chunks]:
    """{"grad.<param name>[.<expert id>]": this rank's Chunks of its averaged gradient}, placed as `keyed_state`
    places the parameter (TP slices at their offsets, experts per global id, ZeRO/FSDP pieces where they lie): after
    the gradient sync, before the optimizer step (`nanotitan verify` compares every layout's with one process's)."""
    params = dict(model.named_parameters())
    out: dict[str, Chunks] = {}
    for name, pieces in shard.sync.grad_pieces(set(params)).items():
        for suffix, p in placed(model, name, grad_layout(params[name]), pieces).items():
            out[f"grad.{name}{suffix}"] = Chunks(p.size, p.boxes)
    return out


def rng_key(rank: int) -> str:
    return f"rng.cpu.{rank}"

