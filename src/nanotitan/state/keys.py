"""The global keys of a checkpoint: this rank's pieces of every tensor, under names that do not depend on the
(dp, pp, ep) layout or the zero level (checkpoint.py lists them). Save, load and the snapshot packing all read
the live state through `keyed_state`."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..model.transformer import is_expert_param
from ..parallel.dp.sync import Pieces, ensure_adam_state, replicated_pieces
from ..parallel.shard import grad_layout


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
    the zero level), keyed by global name, an expert tensor [E_local, ...] split per global expert id. The
    keys and each tensor's whole shape do not depend on the zero level or the layout, so any layout reads any
    other's checkpoint (and those written whole, before the pieces)."""
    if optimizer is not None:
        ensure_adam_state(optimizer)
    sync = shard.sync if shard is not None else None
    model_state, optim_state = sync.sharded_state(optimizer) if sync else replicated_pieces(model, optimizer)
    # sharded_state holds the parameters; persistent buffers (router_bias) are never sharded: the live ones
    for name, t in model.state_dict(keep_vars=True).items():
        if name not in model_state:
            model_state[name] = Pieces.whole(t)
    return global_keys(model, {"model": model_state}, {"optim": optim_state})


def keyed_grads(model: torch.nn.Module, shard) -> dict[str, Chunks]:
    """{"grad.<param name>[.<expert id>]": this rank's Chunks of its averaged gradient}, by the keys' rules (TP slices
    at their offsets, experts split per global id, ZeRO/FSDP pieces where they lie): after the gradient sync, before
    the optimizer step (`nanotitan verify` compares every layout's against one process's)."""
    names = {n for n, _ in model.named_parameters()}
    return global_keys(model, {"grad": shard.sync.grad_pieces(names)}, {})


def global_keys(model: torch.nn.Module, tensors: dict[str, dict[str, Pieces]],
                states: dict[str, dict[str, dict[str, Pieces]]]) -> dict[str, Chunks]:
    """{prefix.name[.expert][.state]: Chunks}: `tensors` ({prefix: {param name: Pieces}}) and `states` ({prefix:
    {param name: {state key: Pieces}}}), each piece in the parameter's own coordinates (its TP slice, its local
    experts), keyed globally: a TP slice moved to its rank's offset, an expert tensor split per global expert id."""
    expert_start = model.spec.expert_start
    # a placement's slots (parallel/rebalance.py): slot l holds global expert slot_experts[l] (-1: empty, no key;
    # the copies of a replicated expert write identical boxes, kept once)
    slot_experts = {f"{n}.{t}": m.slot_experts for n, m in model.named_modules()
                    if getattr(m, "slot_experts", None) is not None for t in ("W_gate", "W_val", "W_out")}
    out: dict[str, Chunks] = {}

    def put(prefix: str, name: str, pieces: Pieces, suffix: str = "") -> None:
        if not (is_expert_param(name) and len(pieces.size) > 0):
            out[f"{prefix}.{name}{suffix}"] = Chunks(pieces.size, pieces.boxes)
            return
        per_expert: dict[int, list] = {}
        for off, t in pieces.boxes:  # a box over experts [e0, e0 + n) is n boxes, one per expert's key
            for l in range(t.shape[0]):
                per_expert.setdefault(off[0] + l, []).append((off[1:], t[l]))
        ids = slot_experts.get(name) or range(expert_start, expert_start + pieces.size[0])
        for l, e in enumerate(ids):
            if e >= 0:
                out[f"{prefix}.{name}.{e}{suffix}"] = Chunks(pieces.size[1:], per_expert.get(l, []))

    for name, q in model.named_parameters():  # TP slices sit at their rank's offset in the whole tensor
        if (part := grad_layout(q).part) is None:
            continue
        for by_name in tensors.values():
            if name in by_name:
                by_name[name] = tp_pieces(by_name[name], *part)
        for by_name in states.values():
            for k, pieces in by_name.get(name, {}).items():
                if len(pieces.size):
                    by_name[name][k] = tp_pieces(pieces, *part)
    for prefix, by_name in tensors.items():
        for name, pieces in by_name.items():
            put(prefix, name, pieces)
    for prefix, by_name in states.items():
        for name, st in by_name.items():
            for k, pieces in st.items():
                put(prefix, name, pieces, f".{k}")
    return out


def tp_pieces(pieces: Pieces, dim: int, rank: int, n: int) -> Pieces:
    """Pieces of a TP slice (rank's 1/n along dim) as pieces of the whole tensor."""
    size = list(pieces.size)
    shift = rank * size[dim]
    size[dim] *= n
    return Pieces(torch.Size(size), [(tuple(o + shift * (i == dim) for i, o in enumerate(off)), t)
                                     for off, t in pieces.boxes])


def rng_key(rank: int) -> str:
    return f"rng.cpu.{rank}"

