"""Deferred weight gradients: the input gradient now, the weight-gradient GEMMs later (zero-bubble pipelines'
B / W split, Qi et al. 2023; Megatron-LM's `WeightGradStore`).

A layer that can defer computes its own backward (`_Linear`, `_Experts` below): the input gradient always at
once, and the weight gradient either at once or, while its `WeightGradStore` is `deferring`, as a closure put in
the store, holding the tensors the GEMM reads (layer input, output gradient). Parameters that are not GEMM
weights (norm weights, embedding tables) pass through `_Tap`, which takes the gradient autograd computed and
lands it the same way. Parameters enter these ops detached: autograd never runs their AccumulateGrad (torch
2.13 fires a parameter's hooks there even when no gradient arrives), so after a deferred backward no .grad has
changed and no gradient sync has been told anything: every term lands when the store's closures run
(the pipeline schedule's W, parallel/pp/schedules.py).

Landing a term: `accumulate(p, g)` does what autograd's AccumulateGrad does (`p.grad = g` when None, else an
in-place add), or, when a gradient sync registered a sink for p (`set_grad_sink`: the DP Reducer, ZeRO-1/2's
ShardedReducer), calls the sink, which adds the term into its bucket and counts p ready -- the hook autograd's
post-accumulate-grad would have fired. model/ never imports parallel/ (docs/design.md §2): the sync hands the sink in.

Exactness: the backward functions are the ones autograd's nodes run for F.linear / mm / silu / mul / unbind
(`mm_mat1_backward`, `mm_mat2_backward`, `silu_backward`, `stack`), on the same saved tensors, so input and
weight gradients are bitwise those of plain autograd (tests/model/test_wgrad.py). Deferral changes when a
weight-gradient GEMM runs, never what it computes. A store made with fuse=True (zb1's split stages) adds each
GEMM term into .grad inside the GEMM (`GemmTerm`, addmm_): that one step is equal up to float reassociation.

Activation checkpointing: everything a backward needs is saved with `save_for_backward`, so a checkpointed
block recomputes it as usual in B; the closures keep what B unpacked, so W never recomputes a block (nor
runs its EP all-to-alls).

Grouped experts (model.experts_impl grouped): the same split with one torch._grouped_mm per projection, its
offsets on the device (`experts_forward` / `experts_input_grad` take them in place of the host counts); the
weight half is a `GroupedTerm` (the 2D x 2D grouped GEMM x^T @ dy), equal to the loop's terms to float
reassociation (tests/model/test_grouped.py).

The path is on only where a store is attached (`attach`): a module without one runs plain F.linear etc.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import fp8 as float8
from .grouped_mm import grouped_mm

_SINK = "_nanotitan_grad_sink"  # attribute on the param: its gradient sync's sink


def set_grad_sink(p: torch.Tensor, sink: Callable[[torch.Tensor, torch.Tensor], None] | None) -> None:
    """sink(p, g) lands each deferred gradient term g of p (None: plain accumulation into p.grad). Kept on the
    param itself: a module-level table keyed by params would keep every param alive through its sink's sync."""
    if sink is None:
        if hasattr(p, _SINK):
            delattr(p, _SINK)
    else:
        setattr(p, _SINK, sink)


class GemmTerm:
    """A weight-gradient term not yet computed: a^T-style GEMM a @ b, or (stacked) one GEMM per leading slice of
    the parameter (the experts' [L, ...] weights, unbind's backward). `accumulate_into` runs it straight into an
    existing .grad of its dtype (addmm_: Megatron's gradient-accumulation fusion), which saves the temporary
    and the second pass over the gradient that adding a computed term takes; else it computes the term.
    A BLAS GEMM with beta = 1 may add into C inside its kernel (per K-block, or as the first addend of its FMAs),
    so the result is mm-then-add_'s up to float reassociation, not always bit for bit: only a store made with
    fuse=True (zb1's split stages) lands GemmTerms; every other path computes the term first."""

    __slots__ = ("pairs", "stacked")

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stacked: bool = False):
        self.pairs, self.stacked = pairs, stacked

    @property
    def dtype(self) -> torch.dtype:
        return self.pairs[0][0].dtype

    def tensor(self) -> torch.Tensor:
        if self.stacked:
            return torch.stack([a.mm(b) for a, b in self.pairs])
        return self.pairs[0][0].mm(self.pairs[0][1])

    def add_to(self, grad: torch.Tensor) -> None:
        if self.stacked:
            for l, (a, b) in enumerate(self.pairs):
                grad[l].addmm_(a, b)
        else:
            grad.addmm_(*self.pairs[0])


@torch.no_grad()
def accumulate_into(p: torch.Tensor, g: "torch.Tensor | GemmTerm") -> None:
    """AccumulateGrad's step: the first term becomes .grad, later ones are added in place (a GemmTerm: computed
    into .grad by its GEMMs)."""
    if isinstance(g, GemmTerm):
        if type(p.grad) is torch.Tensor and p.grad.dtype == g.dtype:
            g.add_to(p.grad)
            return
        g = g.tensor()
    g = g.to(p.dtype)
    if p.grad is None:
        p.grad = g if g.is_contiguous() else g.contiguous()
    else:
        p.grad.add_(g)


def accumulate(p: torch.Tensor, g: "torch.Tensor | GemmTerm") -> None:
    sink = getattr(p, _SINK, None)
    if sink is None:
        accumulate_into(p, g)
    else:
        sink(p, g)


class WeightGradStore:
    """The weight-gradient work a deferred backward left behind, in the order it produced it.

        with store.deferring():   backward (B): input gradients only; closures queue up
        work = store.take()       this microbatch's W, to run whenever the schedule likes
        WeightGradStore.run(work) W: the GEMMs, every term accumulated (sinks: the gradient syncs count it ready)

    Outside `deferring()` an attached layer lands its weight gradient at once, through the same `accumulate`.
    """

    def __init__(self, fuse: bool = False):
        self.active = False
        # fuse: GEMM terms land as GemmTerms, computed straight into an existing .grad (addmm_): faster, equal to
        # the plain backward's up to float reassociation. zb1's split stages use it (parallel/pp/schedules.py); the EP
        # lanes' fill, and whatever must stay bitwise plain autograd's, do not.
        self.fuse = fuse
        self._queue: list[Callable[[], None]] = []
        # Parameters enter the deferrable ops detached, so autograd never reaches their AccumulateGrad (which
        # would fire the syncs' hooks even with no gradient); this leaf makes the ops' outputs require grad.
        self.anchor = torch.zeros((), requires_grad=True)

    @contextlib.contextmanager
    def deferring(self):
        assert not self.active, "nested deferring()"
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def land(self, fn: Callable[..., None], *tensors: torch.Tensor) -> None:
        """fn(*tensors) accumulates some weight gradients: run now, or queued for W while deferring. A queued fn's
        tensors are held through the saved-tensor hooks in force (as autograd holds what it saves), so a memory
        meter (memory.SavedActivations, the dry run's) counts what a pending W keeps as the activations it is."""
        if not self.active:
            with torch.no_grad():
                fn(*tensors)
            return
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if hooks is None:
            self._queue.append(lambda: fn(*tensors))
            return
        pack, unpack = hooks
        packed = [pack(t) for t in tensors]
        self._queue.append(lambda: fn(*[unpack(h) for h in packed]))

    def take(self) -> list[Callable[[], None]]:
        work, self._queue = self._queue, []
        return work

    @staticmethod
    def run(work: list[Callable[[], None]]) -> None:
        with torch.no_grad():
            for fn in work:
                fn()
        work.clear()  # frees what the closures held (activations, output gradients)


def attach(model: nn.Module, store: WeightGradStore | None) -> None:
    """Route every deferrable layer of `model` through `store` (None: back to plain autograd)."""
    for m in model.modules():
        if hasattr(m, "wgrad_store"):
            m.wgrad_store = store


def _autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    # Autocast casts floating inputs of a GEMM to its dtype; the cast's backward widens the gradient back.
    return t if t is None or dtype is None or not t.is_floating_point() else t.to(dtype)


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


class _Linear(torch.autograd.Function):
    """F.linear(x, W, b) with the weight (and bias) gradient landed through the store. Autograd runs F.linear on
    a (.., Din) input as one mm on its (-1, Din) view with W.t(), column-major: grad x = g @ W, grad W = g^T @ x
    (the column-major branch of mm_mat2_backward), grad b = g summed over rows. `params` = (W, b), the
    parameters themselves; w and b are their detached values (see WeightGradStore.anchor)."""

    @staticmethod
    def forward(ctx, x, w, b, anchor, params, store):
        dt = _autocast_dtype(x)
        xc, wc, bc = _cast(x, dt), _cast(w, dt), _cast(b, dt)
        ctx.save_for_backward(xc, wc)
        ctx.params, ctx.store, ctx.x_dtype = params, store, x.dtype
        return F.linear(xc, wc, bc)

    @staticmethod
    def backward(ctx, grad_out):
        xc, wc = ctx.saved_tensors
        weight, bias = ctx.params
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = g2.mm(wc).view(xc.shape).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None

        fuse = ctx.store.fuse

        def weight_grads(g2, xc):
            if weight.requires_grad:
                term = GemmTerm([(g2.t(), xc.reshape(-1, xc.shape[-1]))])
                accumulate(weight, term if fuse else term.tensor())
            if bias is not None and bias.requires_grad:
                accumulate(bias, g2.sum(0))

        ctx.store.land(weight_grads, g2, xc)
        return grad_x, None, None, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           store: WeightGradStore | None) -> torch.Tensor:
    """F.linear, through the store when one is attached (and a backward may follow)."""
    if store is None or not torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    return _Linear.apply(x, weight.detach(), _detached(bias), store.anchor, (weight, bias), store)


class _Tap(torch.autograd.Function):
    """Identity on a parameter's value whose gradient autograd computes as usual (a norm weight, an embedding
    table): the gradient lands through the store (now, or in W while deferring) instead of AccumulateGrad."""

    @staticmethod
    def forward(ctx, value, anchor, params, store):
        ctx.p, ctx.store = params[0], store
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        p = ctx.p
        ctx.store.land(lambda g: accumulate(p, g), grad)
        return None, None, None, None


def tap(p: torch.Tensor, store: WeightGradStore | None) -> torch.Tensor:
    if store is None or not torch.is_grad_enabled() or not p.requires_grad:
        return p
    return _Tap.apply(p.detach(), store.anchor, (p,), store)  # in a tuple: not an input autograd tracks


def group_offsets(counts_L: torch.Tensor) -> torch.Tensor:
    """The grouped GEMMs' `offs`: cumulative row counts per expert, int32, on the counts' device (no host read)."""
    return counts_L.cumsum(0, dtype=torch.int32)


def grouped_swiglu(x_ND, W_gate, W_val, W_out, offs):
    """ExpertFFN's grouped path under plain autograd: one torch._grouped_mm per projection over all experts.
    _grouped_mm has no autocast rule: cast to the autocast dtype here, as the loop's matmuls are cast. Traceable
    by a compiled block in any dtype (model/grouped_mm.py)."""
    dt = _autocast_dtype(x_ND)
    x, wg, wv, wo = (_cast(t, dt) for t in (x_ND, W_gate, W_val, W_out))
    h = F.silu(grouped_mm(x, wg, offs)) * grouped_mm(x, wv, offs)
    return grouped_mm(h, wo, offs)


def experts_forward(x, wg, wv, wo, counts_L: "list[int] | torch.Tensor"):
    """y of L SwiGLU experts on contiguous row groups (x and weights already in the compute dtype), and per expert
    what autograd's nodes would save: hg (silu), hv and a (mul), h (mm). counts_L a tensor: the grouped path's
    int32 offsets (`group_offsets`), one GEMM per projection, saved once for all experts."""
    if isinstance(counts_L, torch.Tensor):
        hg, hv = torch._grouped_mm(x, wg, offs=counts_L), torch._grouped_mm(x, wv, offs=counts_L)
        a = F.silu(hg)
        h = a * hv
        return torch._grouped_mm(h, wo, offs=counts_L), [hg, hv, a, h]
    saved, ys = [], []
    for x_l, wg_l, wv_l, wo_l in zip(x.split(counts_L), wg.unbind(0), wv.unbind(0), wo.unbind(0)):
        hg, hv = x_l @ wg_l, x_l @ wv_l
        a = F.silu(hg)
        h = a * hv
        saved += [hg, hv, a, h]
        ys.append(h @ wo_l)
    return (torch.cat(ys) if ys else x.new_zeros(0, x.shape[1])), saved


def experts_input_grad(dy, x, wg, wv, wo, saved, counts_L: "list[int] | torch.Tensor", x_dtype: torch.dtype):
    """Per expert, the backward of (silu(x @ wg) * (x @ wv)) @ wo as autograd runs it, input half:
    dh = dy @ wo^T, da = dh * hv, dhv = dh * a, dhg = silu_backward(da, hg), dx = dhg @ wg^T + dhv @ wv^T.
    Returns dx and, per expert, what its weight GEMMs read (x_l, h_l, dy_l, dhg, dhv); grouped (counts_L the
    offsets): the same once for all experts, led by the offsets (offs, x, h, dy, dhg, dhv)."""
    if isinstance(counts_L, torch.Tensor):
        hg, hv, a, h = saved
        dh = torch._grouped_mm(dy, wo.transpose(1, 2), offs=counts_L)
        da, dhv = dh * hv, dh * a
        dhg = torch.ops.aten.silu_backward(da, hg)
        dx = (torch._grouped_mm(dhg, wg.transpose(1, 2), offs=counts_L).to(x_dtype)
              + torch._grouped_mm(dhv, wv.transpose(1, 2), offs=counts_L).to(x_dtype))
        return dx, [counts_L, x, h, dy, dhg, dhv]
    dxs, terms = [], []
    for l, (x_l, dy_l) in enumerate(zip(x.split(counts_L), dy.split(counts_L))):
        hg, hv, a, h_l = saved[4 * l:4 * l + 4]
        dh = dy_l.mm(wo[l].t())
        da, dhv = dh * hv, dh * a
        dhg = torch.ops.aten.silu_backward(da, hg)
        # Each GEMM's cast widens its own term (autocast casts x once per GEMM): add them in x's dtype.
        dxs.append(dhg.mm(wg[l].t()).to(x_dtype) + dhv.mm(wv[l].t()).to(x_dtype))
        terms += [x_l, h_l, dy_l, dhg, dhv]
    dx = torch.cat(dxs) if dxs else dy.new_zeros(0, x.shape[1], dtype=x_dtype)
    return dx, terms


class GroupedTerm(GemmTerm):
    """A stacked weight-gradient term as grouped GEMMs: per (a, b, offs) the [L_c, ., .] slices a_g @ b_g over
    each group's rows (a^T-style 2D x 2D with offsets), the chunks' slices concatenated (consecutive experts)."""

    def tensor(self) -> torch.Tensor:
        gs = [torch._grouped_mm(a, b, offs=offs) for a, b, offs in self.pairs]
        return gs[0] if len(gs) == 1 else torch.cat(gs)

    def add_to(self, grad: torch.Tensor) -> None:
        grad.add_(self.tensor())


def experts_weight_terms(terms) -> tuple[GemmTerm, GemmTerm, GemmTerm]:
    """The weight half, stacked over the experts of `terms` (unbind's backward): wg: x^T dhg, wv: x^T dhv,
    wo: h^T dy. Grouped terms (each chunk led by its int32 offsets): one grouped GEMM per projection and chunk."""
    if terms and terms[0].dtype == torch.int32:
        chunks = [terms[i:i + 6] for i in range(0, len(terms), 6)]
        return (GroupedTerm([(x.t(), dhg, o) for o, x, _, _, dhg, _ in chunks]),
                GroupedTerm([(x.t(), dhv, o) for o, x, _, _, _, dhv in chunks]),
                GroupedTerm([(h.t(), dy, o) for o, _, h, dy, _, _ in chunks]))
    per_expert = [terms[i:i + 5] for i in range(0, len(terms), 5)]
    return (GemmTerm([(x_l.t(), dhg) for x_l, _, _, dhg, _ in per_expert], stacked=True),
            GemmTerm([(x_l.t(), dhv) for x_l, _, _, _, dhv in per_expert], stacked=True),
            GemmTerm([(h_l.t(), dy_l) for _, h_l, dy_l, _, _ in per_expert], stacked=True))


def experts_weight_grads(terms) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`experts_weight_terms` computed: the three stacked gradients."""
    return tuple(t.tensor() for t in experts_weight_terms(terms))


class _Experts(torch.autograd.Function):
    """model.moe.ExpertFFN's forward (L SwiGLU experts on contiguous row groups) with its weight gradients landed
    through the store (`experts_forward`, `experts_input_grad`, `experts_weight_grads`)."""

    @staticmethod
    def forward(ctx, x_ND, W_gate, W_val, W_out, anchor, counts_L, params, store):
        dt = _autocast_dtype(x_ND)
        x, wg, wv, wo = (_cast(t, dt) for t in (x_ND, W_gate, W_val, W_out))
        y, saved = experts_forward(x, wg, wv, wo, counts_L)
        ctx.save_for_backward(x, wg, wv, wo, *saved)
        ctx.counts, ctx.params, ctx.store, ctx.x_dtype = counts_L, params, store, x_ND.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, wg, wv, wo, *saved = ctx.saved_tensors
        dx, terms = experts_input_grad(dy, x, wg, wv, wo, saved, ctx.counts, ctx.x_dtype)
        ctx.store.land(land_expert_grads(ctx.params, ctx.store.fuse), *terms)
        return dx, None, None, None, None, None, None, None


def land_expert_grads(params, fuse: bool = False):
    """fn(*terms) computing the experts' weight gradients from `terms` and accumulating them into `params`
    (fuse: each expert's GEMM straight into its slice of an existing .grad)."""
    W_gate, W_val, W_out = params

    def weight_grads(*terms):
        for p, g in zip((W_gate, W_val, W_out), experts_weight_terms(terms)):
            accumulate(p, g if fuse else g.tensor())
    return weight_grads


def experts(x_ND: torch.Tensor, W_gate: torch.Tensor, W_val: torch.Tensor, W_out: torch.Tensor,
            counts_L: "list[int] | torch.Tensor", store: WeightGradStore) -> torch.Tensor:
    params = (W_gate, W_val, W_out)
    return _Experts.apply(x_ND, *(p.detach() for p in params), store.anchor, counts_L, params, store)


class Linear(nn.Linear):
    """nn.Linear whose weight gradient a `WeightGradStore` can defer (`attach`); plain nn.Linear without one.
    With `.fp8` set (model/fp8.py `convert`), torchao's float8 linear under plain autograd: no deferral; its scales'
    amax reduced over `fp8_split` (where the layout cut its dims: parallel/tp.py, parallel/cp.py)."""
    wgrad_store: WeightGradStore | None = None
    fp8: "float8.Fp8 | None" = None
    fp8_split: "float8.Split" = float8.WHOLE

    def forward(self, x):
        if self.fp8 is not None:
            return float8.linear(x, self.weight, self.bias, self.fp8, self.fp8_split)
        if self.wgrad_store is None:  # nn.Linear's own path, with no extra Python call (every step makes dozens)
            return F.linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias, self.wgrad_store)
