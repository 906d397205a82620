"""train.optimizer=muon: Muon on the hidden matrices, AdamW on the rest, as one torch Optimizer (docs/optim.md).

Per Muon matrix, on whatever part of it this rank holds (the whole, a flat ZeRO shard, an FSDP2 or TP slice):

    buf <- beta buf + (1 - beta) g         the momentum, an EMA (Keller Jordan's reference, torch.optim.Muon)
    u   <- (1 - beta) g + beta buf         Nesterov, written into the gradient's storage (it is zeroed next)
    u   <- NS5(u) * 0.2 sqrt(max(m, n))    on the whole matrix (owners.py): Newton-Schulz, RMS-matched to AdamW
    W   <- W (1 - lr wd) - lr u            decoupled weight decay, as AdamW's

Every step but the orthogonalization is elementwise, so it runs on any slice; the orthogonalization gathers what it
needs (owners.py). The AdamW groups step with torch's fused AdamW, which shares this optimizer's `state`.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..model.families import HIDDEN
from ..state.keys import keyed_state
from .adamw import Declared
from .newton_schulz import NS_DTYPES
from .owners import Orthogonalizer


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's storage), a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


TAKES = (HIDDEN,)  # the family tags (model/families.py) whose groups Muon updates; AdamW takes the others


class Muon(Declared, torch.optim.Optimizer):
    """Muon on the groups of the family tags it TAKES (lr = train.muon_lr), fused AdamW on the others
    (`adamw_lr`: train.muon_adamw_lr; both follow train.lr's schedule through their groups' lr_ratio). Its
    declarations (adamw.py): kind "muon", a Muon param's state is its momentum, a layout change drops the plan.
    `pieces()` answers, once (the first step, when the state exists), {matrix key: (whole shape, [(offsets, view
    of a momentum buffer)])}: this rank's pieces of every Muon matrix (`shard_pieces`, or `whole_pieces`);
    `geometry()` every group rank's (optim/geometry.py: `shard_geometry`, computed, not exchanged; None: the
    Orthogonalizer all-gathers it)."""
    kind = "muon"

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], muon_lr: float,
                 momentum: float = 0.95, ns_steps: int = 5, pieces=None, group=None,
                 ns_dtype: torch.dtype = torch.float32, adamw_lr: float | None = None, geometry=None):
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"Muon ns_dtype={ns_dtype}: use torch.float32 (the default) or torch.bfloat16")
        rest = lr if adamw_lr is None else adamw_lr
        adam = [{**g, "lr": rest, "lr_ratio": rest / lr} for g in groups if g["tag"] not in TAKES]
        self.adamw = torch.optim.AdamW(adam, lr=rest, betas=betas, fused=True)
        muon = [{**g, "lr": muon_lr, "lr_ratio": muon_lr / lr, "momentum": momentum} for g in groups
                if g["tag"] in TAKES]
        super().__init__(self.adamw.param_groups + muon, {"lr": lr})
        self.adamw.state = self.state  # one state: checkpoints and memory meters read `optimizer.state`
        self.ns_steps, self.pieces, self.group, self.ns_dtype = ns_steps, pieces, group, ns_dtype
        self.geometry = geometry
        self.orthogonalizer: Orthogonalizer | None = None

    @property
    def muon_groups(self) -> list[dict]:
        return [g for g in self.param_groups if g["tag"] in TAKES]

    def state_of(self, p: torch.Tensor, group: dict | None = None) -> dict:
        """A Muon param's state is one buffer, its momentum (as torch.optim.Muon's); an AdamW param's, Adam's."""
        group = group or self.group_of(p)
        if group["tag"] not in TAKES:
            return super().state_of(p, group)
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def prepare(self) -> None:
        self.ensure_state()
        self.plan()

    def on_layout_change(self) -> None:
        """The owner plan knows each slot's expert (an empty one none, so no box): the next step plans anew."""
        self.orthogonalizer = None

    def _momenta(self) -> list[torch.Tensor]:
        return [local(self.state_of(p, g)["momentum_buffer"]) for g in self.muon_groups for p in g["params"]]

    def plan(self) -> None:
        """Make the owner plan, once (the geometry is fixed from here on; a placement move drops it): the first
        step does, once the state exists; the dry run before its byte meter, as a real rank's later steps find it
        made (built under the meter on fake tensors it counted bytes no real step allocates)."""
        if self.orthogonalizer is None and any(g["params"] for g in self.muon_groups):
            self.orthogonalizer = Orthogonalizer(self.pieces(self), self._momenta(), self.group, self.ns_steps,
                                                 self.ns_dtype, self.geometry(self) if self.geometry else None)

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "Muon takes no closure"
        self.adamw.step()
        params = [(p, g) for g in self.muon_groups for p in g["params"]]
        if not params:
            return None
        momenta = self._momenta()
        self.plan()
        updates = []
        for (p, g), buf in zip(params, momenta):
            grad = local(p.grad)
            assert grad.shape == buf.shape and grad.is_contiguous() and buf.is_contiguous(), "update laid out as buf"
            buf.lerp_(grad, 1 - g["momentum"])
            updates.append(grad.lerp_(buf, g["momentum"]))
        self.orthogonalizer.run(updates)
        for (p, g), u in zip(params, updates):
            w = local(p.detach())
            w.mul_(1 - g["lr"] * g["weight_decay"])
            w.add_(u, alpha=-g["lr"])
        return None


def whole_pieces(named: list[tuple[str, torch.Tensor]]):
    """`Muon.pieces` for params whole on this rank (one process, tests): each matrix one box, an expert stack
    [E, d, f] E matrices."""
    def pieces(opt: Muon) -> dict:
        state = {id(p): opt.state_of(p, g)["momentum_buffer"] for g in opt.muon_groups for p in g["params"]}
        out = {}
        for name, p in named:
            if id(p) not in state:
                continue
            buf = state[id(p)]
            if buf.dim() == 2:
                out[name] = (tuple(buf.shape), [((0, 0), buf)])
            else:
                out.update({f"{name}.{e}": (tuple(buf.shape[1:]), [((0, 0), buf[e])]) for e in range(buf.shape[0])})
        return out
    return pieces


def shard_pieces(shard):
    """`Muon.pieces` of a ModelShard: the checkpoint's pieces of each momentum (state/keys.py: global offsets, TP
    slices placed, an expert stack one key per global expert), whatever the zero level."""
    def pieces(opt: Muon) -> dict:
        keyed = keyed_state(shard.model, opt, shard)
        head, tail = "optim.", ".momentum_buffer"
        return {k[len(head):-len(tail)]: (tuple(c.shape), [(tuple(o), t) for o, t in c.boxes.items()])
                for k, c in keyed.items() if k.startswith(head) and k.endswith(tail)}
    return pieces
