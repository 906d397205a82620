"""Tensor parallel, with sequence parallel: Megatron's split of a stage's dense part over the TP group.

    attention     q/k/v column-wise by heads (each rank computes its H/N heads), o row-wise; GQA with fewer KV
                  heads than ranks replicates them; MLA splits its up-projections by heads (`_mla`); full
                  q/k norms (OLMoE) all-reduce each token's sum of squares over the heads (model/norm.py's
                  `FullNorm`, built by the model when handed the token shard)
    dense FFNs    gate/up column-wise, down row-wise; the shared experts alike, on the tokens of the TP group
    embedding     vocab-parallel (model/tokens.py): rows [r*V/N, (r+1)*V/N); a token outside them reads zeros,
                  the sum fills it
    head + loss   vocab-parallel: logits stay (.., V/N); the cross-entropy reduces max, target logit and sum
                  of exponentials over the group (`TPShard.cross_entropy`): the logits are never gathered
    experts       folded onto EP (dims.moe_ep = EP*TP shards, parallel/ep.py): each TP rank routes its own
                  tokens, so no token is sent twice and expert bytes per rank fall with TP as with EP; capacity
                  ranks the whole microbatch's assignments (one all-gather of (weight, id) pairs, model/moe.py)
    MTP           its blocks split as any; eh_proj and its norms whole (per token: SP splits their work); every
                  depth runs on all S positions (model/mtp.py), so its sequence shards stay even
    SP (parallel.sp) the residual stream, norms included, lives on sequence shards (B, S/N, D): each TP
                  region all-gathers the sequence on entry and reduce-scatters its partial sums on exit.
                  Without SP the stream is whole on every rank: identity / all-reduce at the regions' edges.

The model reaches the group through one object, `TPShard` (model/tokens.py's `TokenShard`), handed to it when it
is built (`tp_shard`, parallel/build.py); `apply_tp` then slices the parameters and adds the regions' hooks.
Parameters stay plain tensors, each rank's slice of the full one, so every gradient sync (Reducer, ZeRO, FSDP2)
and wgrad's deferred GEMMs work unchanged. Each is tagged with how its gradient lies (parallel/shard.py:
`grad_layout`): SHARDED (this rank's slice: the checkpoint places it by its part, state/keys.py), WHOLE (the same on
every TP rank: clipping counts it once), or PARTIAL: replicated over TP but its TP ranks see different tokens or
heads (norms under SP, q/k head norms, the router, the shared-expert gate), so the gradient sync sums it over the
"stage" group (DP x EP x TP of the stage) instead of non-expert-DP — the TP sum commutes with the DP average, so
it costs no extra collective (parallel/dp/sync.py: gradient_groups).

Why not DTensor parameters (torch.distributed.tensor.parallel's parallelize_module): our Reducer and ZeRO bind
.grad and .data to views of flat buckets, which a DTensor parameter refuses, and `loss_parallel` must wrap the
backward too, which the pipeline schedules run elsewhere. The regions' collectives below are the ones
ColwiseParallel / RowwiseParallel / SequenceParallel insert, written as four autograd functions (docs/tp.md).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from ..model import fp8 as float8
from ..model.norm import FullNorm
from ..model.tokens import IGNORE, LOCAL, LocalTokenShard, VocabParallelEmbedding, WholeSequence, gather_pairs
from ..model.transformer import is_expert_param
from .comm import collectives as comm
from .dims import ParallelDims
from .shard import Grad, GradLayout, grad_layout, set_layout


class TPShard(WholeSequence):
    """The TP group as the model's token shard (model/tokens.py: `TokenShard`): its ranks are both the token ranks
    (each routes its 1/N of every sequence, positions [rank*S, (rank+1)*S)) and the split ranks (heads, vocab
    rows); `sp`: the residual stream between the regions is a sequence shard too. Attention and the loss see the
    whole sequence (`WholeSequence`: the regions gather SP's shards)."""

    def __init__(self, group, rank: int, size: int, sp: bool):
        self.group, self.rank, self.size, self.sp = group, rank, size, sp
        self.split_rank, self.split_size = rank, size
        self.amax_max = max_over(group, "tp")  # an FP8 scale's amax over the group (`cut_fp8`)

    def runs(self, S: int) -> list[tuple[int, int]]:
        return [(self.rank * S, S)]

    def stream_len(self, S: int) -> int:
        return S // self.size if self.sp else S

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return _SumOverTP.apply(t, self)

    def mean(self, t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
        return self.sum(t.sum(dim)) / n

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return _gather(t, self, dim)

    def gather_routing(self, weights_BSK, ids_BSK, length: int, none_id: int):
        return gather_pairs(self, weights_BSK, ids_BSK, length, none_id)

    def splits(self, heads: int) -> bool:
        return heads % self.size == 0

    def split_sum(self, t: torch.Tensor) -> torch.Tensor:
        return _SumEverywhere.apply(t, self)

    def embedding(self, num: int, dim: int) -> VocabParallelEmbedding:
        return VocabParallelEmbedding(num, dim, self)

    def vocab_sum(self, x: torch.Tensor) -> torch.Tensor:
        return _Exit.apply(x, self, 1, self.sp)

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Megatron's vocab-parallel CE (`_VocabCE`): the logits are never gathered."""
        return _VocabCE.apply(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                              self.rank * logits.shape[-1], self)


def tp_shard(dims: ParallelDims, sp: bool) -> TPShard | LocalTokenShard:
    """The token shard a model of this rank is built with (Transformer(..., tokens=)): the local one at tp = 1."""
    return TPShard(dims.group("tp"), dims.tp_rank, dims.tp, sp) if dims.tp > 1 else LOCAL


# --- FP8 scales of split GEMMs (model/fp8.py `Split`, docs/fp8.md "Scales under TP and CP") -------------------

def max_over(group, axis: str) -> float8.Reduce:
    """An FP8 cast's amax -> its MAX over `group`: the amax of the whole tensor whose slices the group holds."""
    def reduce(amax: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(amax, group=group, axis=axis, op=torch.distributed.ReduceOp.MAX)
        return amax
    return reduce


def cut_fp8(linear: nn.Module, dim: str, reduce: float8.Reduce) -> None:
    """Mark a linear's GEMM dim ("tokens", "inner" K, "outer" N) cut over the ranks `reduce` spans: its FP8 casts
    then reduce their amax over them where the scale spans that dim (set whether or not train.fp8 is on)."""
    split = linear.fp8_split
    linear.fp8_split = dataclasses.replace(split, **{dim: (*getattr(split, dim), reduce)})


# --- the regions' collectives (autograd functions) ------------------------------------------------------------

def _gather(x: torch.Tensor, g: TPShard, dim: int) -> torch.Tensor:
    """Every rank's x concatenated along `dim` in rank order."""
    x = x.contiguous()
    out = x.new_empty((g.size, *x.shape))
    comm.all_gather(out.view(-1), x.view(-1), g.group, axis="tp").wait()
    return torch.cat(out.unbind(0), dim=dim)


def _reduce_scatter(x: torch.Tensor, g: TPShard, dim: int) -> torch.Tensor:
    """The sum over ranks of x, this rank's 1/N slice along `dim`."""
    parts = torch.stack(x.chunk(g.size, dim=dim)).contiguous()  # (N, ..): rank r's slice r-th
    out = parts.new_empty(parts.shape[1:])
    comm.reduce_scatter(out.view(-1), parts.view(-1), g.group, axis="tp").wait()
    return out


def _own(x: torch.Tensor, g: TPShard, dim: int) -> torch.Tensor:
    return x.chunk(g.size, dim=dim)[g.rank].contiguous()


def _all_reduce(x: torch.Tensor, g: TPShard) -> torch.Tensor:
    x = x.contiguous().clone()
    comm.all_reduce(x, group=g.group, axis="tp")
    return x


class _Enter(torch.autograd.Function):
    """Into a TP region. sp: all-gather along dim (backward: reduce-scatter); else identity (backward: all-reduce)."""

    @staticmethod
    def forward(ctx, x, g, dim, sp):
        ctx.g, ctx.dim, ctx.sp = g, dim, sp
        return _gather(x, g, dim) if sp else x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return (_reduce_scatter(dy, ctx.g, ctx.dim) if ctx.sp else _all_reduce(dy, ctx.g)), None, None, None


class _Exit(torch.autograd.Function):
    """Out of a TP region, summing its partial results. sp: reduce-scatter along dim (backward: all-gather); else
    all-reduce (backward: identity)."""

    @staticmethod
    def forward(ctx, x, g, dim, sp):
        ctx.g, ctx.dim, ctx.sp = g, dim, sp
        return _reduce_scatter(x, g, dim) if sp else _all_reduce(x, g)

    @staticmethod
    def backward(ctx, dy):
        return (_gather(dy, ctx.g, ctx.dim) if ctx.sp else dy), None, None, None


class _Slice(torch.autograd.Function):
    """No sum: whole -> this rank's slice along dim, no communication (backward: all-gather), or (whole=True)
    slices -> the whole on every rank (backward: this rank's slice of the gradient)."""

    @staticmethod
    def forward(ctx, x, g, dim, whole):
        ctx.g, ctx.dim, ctx.whole = g, dim, whole
        return _gather(x, g, dim) if whole else _own(x, g, dim)

    @staticmethod
    def backward(ctx, dy):
        return (_own(dy, ctx.g, ctx.dim) if ctx.whole else _gather(dy, ctx.g, ctx.dim)), None, None, None


class _SumOverTP(torch.autograd.Function):
    """All-reduce forward, identity backward: a statistic of the whole microbatch from each rank's tokens, whose
    gradient each rank takes for its own tokens (the MoE balance loss: model/moe.py `token_sum`)."""

    @staticmethod
    def forward(ctx, x, g):
        return _all_reduce(x, g)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _SumEverywhere(torch.autograd.Function):
    """All-reduce forward and backward: a sum over the ranks' parts that every rank uses (the whole projection's
    sum of squares of a full q/k norm): each rank's part reaches every rank's output, so its gradient is the sum
    of theirs."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return _all_reduce(x, g)

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(dy, ctx.g), None


# --- vocab-parallel cross-entropy (the embedding is model/tokens.py's VocabParallelEmbedding) ---------------

class _VocabCE(torch.autograd.Function):
    """Mean cross-entropy of (N, V/n) logit shards against (N,) targets (Megatron's vocab-parallel CE); rows whose
    target is IGNORE (model/mtp.py's shifted tail) are left out, as F.cross_entropy's ignore_index does."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, g):
        m = logits.max(dim=-1).values
        comm.all_reduce(m, group=g.group, axis="tp", op=torch.distributed.ReduceOp.MAX)
        z = logits - m.unsqueeze(-1)
        local = targets - vocab_start
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        picked = z.gather(1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        e = z.exp()
        sums = torch.stack([picked, e.sum(dim=-1)])  # one all-reduce for both
        comm.all_reduce(sums, group=g.group, axis="tp")
        kept = (targets != IGNORE).to(logits.dtype)
        rows = kept.sum().clamp_min(1)  # no target (masked prompts): 0, not 0/0
        loss = ((sums[1].log() - sums[0]) * kept).sum() / rows
        ctx.save_for_backward(e.div_(sums[1].unsqueeze(-1)), local, outside, kept / rows)
        return loss

    @staticmethod
    def backward(ctx, dloss):
        probs, local, outside, weight = ctx.saved_tensors
        grad = probs.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= (~outside).to(grad.dtype)
        return grad.mul_(weight.unsqueeze(1) * dloss), None, None, None


# --- the plan -------------------------------------------------------------------------------------------------

@torch.no_grad()
def _shard(p: nn.Parameter, dim: int, tp: TPShard) -> None:
    """Keep this rank's slice of p along dim: on the meta device, its shape (parallel/build.py then fills it);
    else its values (init by global identity built it whole: the slice is exact)."""
    p.data = p.data.chunk(tp.size, dim=dim)[tp.rank].clone()
    set_layout(p, GradLayout(Grad.SHARDED, (dim, tp.rank, tp.size)))


def _partial(*params) -> None:
    for p in params:
        if p is not None:
            set_layout(p, GradLayout(Grad.PARTIAL))


def _columns(tp: TPShard, *linears) -> None:
    """Column-parallel linears: their output features N are the group's slices (FP8: weight and grad output)."""
    for linear in linears:
        cut_fp8(linear, "outer", tp.amax_max)


def _rows(tp: TPShard, *linears) -> None:
    """Row-parallel linears: their input features K are the group's slices (FP8: input and weight)."""
    for linear in linears:
        cut_fp8(linear, "inner", tp.amax_max)


def _region(module: nn.Module, tp: TPShard, dim: int, sp: bool) -> None:
    """Enter the TP region at the module's first input, leave it at its output."""
    module.register_forward_pre_hook(lambda _m, args: (_Enter.apply(args[0], tp, dim, sp), *args[1:]))
    module.register_forward_hook(lambda _m, _args, out: _Exit.apply(out, tp, dim, sp))


def _swiglu(mlp: nn.Module, tp: TPShard, dim: int, sp: bool) -> None:
    _shard(mlp.gate_proj.weight, 0, tp)
    _shard(mlp.up_proj.weight, 0, tp)
    _shard(mlp.down_proj.weight, 1, tp)
    _columns(tp, mlp.gate_proj, mlp.up_proj)
    _rows(tp, mlp.down_proj)
    _region(mlp, tp, dim, sp)


def _attention(attn: nn.Module, tp: TPShard) -> None:
    H, Hkv, Dh = attn.n_heads, attn.n_kv_heads, attn.head_dim
    split_kv = tp.splits(Hkv)
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj) if split_kv else (attn.q_proj,):
        for p in (proj.weight, proj.bias):  # whole heads: head h's rows are [h*Dh, (h+1)*Dh)
            if p is not None:
                _shard(p, 0, tp)
        _columns(tp, proj)
    full = attn.qk_norm == "full"
    for norm in (attn.q_norm, attn.k_norm) if full else ():
        if isinstance(norm, FullNorm):  # over a head-split projection (model/norm.py): sliced by heads as the rows
            _shard(norm.weight, 0, tp)
    if not split_kv:  # GQA with fewer KV heads than ranks: every rank's query heads read one KV head, which it
        kv = tp.rank * (H // tp.size) // (H // Hkv)  # takes from the whole (replicated) projection; its ranks'
        for proj in (attn.k_proj, attn.v_proj):  # gradients are partial sums over TP (zero off its rows)
            _partial(proj.weight, proj.bias)
        if full:  # the k norm spans the whole replicated k (no sum to take): narrow after it, its weight whole
            _partial(attn.k_norm.weight)
        for mod in (attn.k_norm if full else attn.k_proj, attn.v_proj):
            mod.register_forward_hook(lambda _m, _args, out, kv=kv: out.narrow(-1, kv * Dh, Dh))
    _shard(attn.o_proj.weight, 1, tp)
    _rows(tp, attn.o_proj)
    if attn.qk_norm == "head":  # one Dh-wide weight shared by every head: each rank's heads give part of its grad
        _partial(attn.q_norm.weight, attn.k_norm.weight)
    _region(attn, tp, 1, tp.sp)


def _mla(attn: nn.Module, tp: TPShard) -> None:
    """MLA (model/mla.py): the head-split up-projections column-wise (q_b, or q without a q latent; kv_b), o
    row-wise. The down-projections to the latents (and their norms, and the shared rope key) stay whole: each
    rank's heads give part of their gradients."""
    q = attn.q_b_proj if hasattr(attn, "q_a_proj") else attn.q_proj
    _shard(q.weight, 0, tp)
    _shard(attn.kv_b_proj.weight, 0, tp)
    _shard(attn.o_proj.weight, 1, tp)
    _columns(tp, q, attn.kv_b_proj)
    _rows(tp, attn.o_proj)
    for name in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"):
        if hasattr(attn, name):
            _partial(getattr(attn, name).weight, getattr(getattr(attn, name), "bias", None))
    _region(attn, tp, 1, tp.sp)


def _moe(moe: nn.Module, tp: TPShard) -> None:
    """Each rank routes its own tokens (sequence shards, model/moe.py reads them from its token shard; without SP
    the MoE splits the whole sequence and gathers its output); the shared experts are TP-split on the group's
    tokens, gathered along the token dim."""
    if not tp.sp:
        moe.register_forward_pre_hook(lambda _m, args: (_Slice.apply(args[0], tp, 1, False), *args[1:]))
        moe.register_forward_hook(lambda _m, _args, out: (_Slice.apply(out[0], tp, 1, True), out[1]))
    _partial(moe.router.weight)
    cut_fp8(moe.router, "tokens", tp.amax_max)  # each rank scores its own tokens
    if moe.shared_expert is not None:
        _swiglu(moe.shared_expert, tp, 0, True)
    if moe.shared_expert_gate is not None:
        _partial(moe.shared_expert_gate.weight)
        cut_fp8(moe.shared_expert_gate, "tokens", tp.amax_max)


def apply_tp(model: nn.Module, tp: TPShard | LocalTokenShard | None = None) -> None:
    """Split every chunk of this rank's stage over the TP group: `tp`, the TP part of the token shard the chunks were
    built with (parallel/cp.py: `token_shard`), by default that token shard itself (`Transformer(...,
    tokens=tp_shard(dims, sp))`; no-op at tp = 1). Call before the EP dispatcher, the gradient sync and the
    broadcasts; the model must have been built whole on its TP axis (and its experts for dims.moe_ep_rank), on the
    meta device (parallelize: parallel/build.py) or initialised."""
    for chunk in getattr(model, "chunks", [model]):
        shard = tp or chunk.tokens
        if isinstance(shard, TPShard):
            _apply_chunk(chunk, shard)


def _apply_chunk(chunk: nn.Module, tp: TPShard) -> None:
    sp = tp.sp
    if hasattr(chunk, "tok_emb"):  # a VocabParallelEmbedding (model/tokens.py): its rows by rank
        _shard(chunk.tok_emb.weight, 0, tp)
    if hasattr(chunk, "pos_emb") and sp:
        raise ValueError("model.pos_emb=learned with parallel.sp: --model.pos_emb rope, or --parallel.sp false")
    for block in chunk.layers.values():
        if block.has_attn:
            (_mla if hasattr(block.attn, "kv_b_proj") else _attention)(block.attn, tp)
            if sp:
                _partial(block.attn_norm.weight)
        if block.has_ffn and sp:
            _partial(block.ffn_norm.weight)
        if block.is_moe:
            _moe(block.moe, tp)
        elif block.has_ffn:
            _swiglu(block.mlp, tp, 1, sp)
    for mod in getattr(chunk, "mtp", {}).values():  # eh_proj whole: per token, so SP splits their work anyway
        if sp:  # (model/mtp.py: its block is one of chunk.layers, split above; the embedding and head are shared)
            _partial(mod.enorm.weight, mod.hnorm.weight, mod.eh_proj.weight, mod.shared_head.norm.weight)
            cut_fp8(mod.eh_proj, "tokens", tp.amax_max)
    if hasattr(chunk, "head"):  # vocab-parallel: its loss is the token shard's (Transformer.vocab_ce)
        _shard(chunk.head.weight, 0, tp)
        _columns(tp, chunk.head)
        chunk.head.register_forward_pre_hook(lambda _m, args: (_Enter.apply(args[0], tp, 1, sp),))
        if sp:
            _partial(chunk.norm.weight)
    for name, p in chunk.named_parameters():  # the rest is whole on every TP rank; experts are EP's (ALONE)
        if grad_layout(p).kind is Grad.ALONE and not is_expert_param(name):
            set_layout(p, GradLayout(Grad.WHOLE))


def is_tp_partial(p: torch.Tensor) -> bool:
    return grad_layout(p).kind is Grad.PARTIAL


def tp_shard_dim(p: torch.Tensor) -> int | None:
    return grad_layout(p).dim


def tp_part(p: torch.Tensor) -> tuple[int, int, int] | None:
    """(dim, rank, n) of a TP slice: p is rank's 1/n of the whole tensor along dim; None for a whole one."""
    return grad_layout(p).part
