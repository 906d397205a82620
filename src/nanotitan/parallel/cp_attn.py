"""Attention under context parallelism (docs/cp.md): each CP rank holds two chunks of every sequence, i and 2N-1-i
(the causal balance), and its queries must still meet every earlier key.

    ring_attention          K/V pass around the ring (P2P posted before each block's compute, so they overlap);
                            blocks are merged exactly by their log-sum-exp; backward re-runs the ring with dK/dV
                            travelling back to their owner. GQA sends its Hkv heads.
    ring_latent_attention   MLA: the ring carries the compressed latent (c_kv + roped k_rope per token) and each
                            rank up-projects it locally; backward carries the latent's gradient home.
    ulysses_attention       all-to-all: sequence shard -> head shard, whole-sequence causal attention, back.

Local order (cp.md): local positions [0, c) are global chunk r, [c, 2c) global chunk 2N-1-r (c = S_loc / 2), so a
local causal mask is the global one, and against another rank s's chunks (s, 2N-1-s) exactly half the block is seen:
s < r: both query chunks see key chunk s only; s > r: query chunk 2N-1-r sees both key chunks. Every rank does the
same work at every step.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from ..model.tokens import doc_attention
from .comm import collectives as comm
from .cp_split import CPLayout, zigzag

__all__ = ["CPGroup", "CPRing", "cp_ring", "ring_attention", "ring_latent_attention", "ulysses_attention",
           "block_attention", "block_attention_backward", "balanced_order", "local_positions",
           "latent_bytes_per_token", "DocBlocks", "doc_blocks_forward", "doc_blocks_backward"]

AXIS = "cp"  # the axis name CP's P2P and all-to-all are accounted (and emulated) under


class CPGroup(Protocol):
    """What the CP attention needs of its group: the ProcessGroup, this rank's place in it, its ring neighbours
    (global ranks)."""
    group: object
    rank: int
    size: int
    prev: int
    next: int


@dataclass(frozen=True)
class CPRing:
    """A CPGroup as plain values (cp_ring builds one from a ProcessGroup; a size-1 one needs no group)."""
    group: object
    rank: int
    size: int
    prev: int
    next: int


def cp_ring(group) -> CPRing:
    """The CPGroup of `group` (a ProcessGroup over the CP ranks, in cp-rank order) for this process."""
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    n = len(ranks)
    return CPRing(group, me, n, ranks[(me - 1) % n], ranks[(me + 1) % n])


def local_positions(seq_len: int, n: int, rank: int) -> torch.Tensor:
    """The global positions of CP rank `rank`'s local tokens, in local order (RoPE and YaRN use these)."""
    c = seq_len // (2 * n)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * n - 1 - rank) * c, (2 * n - rank) * c)])


def balanced_order(seq_len: int, n: int) -> torch.Tensor:
    """Global positions in CP's layout: rank 0's local tokens, then rank 1's, ... (chunks i and 2N-1-i each)."""
    return torch.cat([local_positions(seq_len, n, r) for r in range(n)])


# --- one block: out and log-sum-exp, and its backward against the merged out/lse ---------------------------------
def block_attention(q, k, v, causal: bool, scale: float, mask=None):
    """(out, lse) of softmax(q k^T * scale) v: out (B, Hq, Sq, Dv), lse (B, Hq, Sq), both at least fp32 (the merge
    runs there). GQA by Hq % Hkv. mask (B, Sq, Sk) bool: the pairs of one document (packed documents); a query that
    sees no key of the block gets out 0, lse -inf (the merge then leaves it as it was).
    On CPU torch's flash kernel (which takes GQA but one head size: a narrower V is zero-padded, exactly)."""
    if mask is not None:
        return _math_forward(q, k, v, causal, scale, mask)
    if q.is_cpu:
        dk, dv = q.shape[-1], v.shape[-1]
        vp = v if dv == dk else torch.nn.functional.pad(v, (0, dk - dv)) if dv < dk else None
        if vp is not None:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, vp, 0.0, causal,
                                                                                  scale=scale)
            return out[..., :dv].to(acc_dtype(q.dtype)), lse.to(acc_dtype(q.dtype))
    return _math_forward(q, k, v, causal, scale)


def block_attention_backward(dout, q, k, v, out, lse, causal: bool, scale: float, mask=None):
    """(dq, dk, dv) of one block, given the MERGED out and lse of its queries (their softmax spans every block):
    p = exp(s - lse), dS = p * (dP - rowsum(dout * out)). mask as `block_attention`."""
    if mask is not None:
        return _math_backward(dout, q, k, v, out, lse, causal, scale, mask)
    if q.is_cpu:
        dk_, dv_ = q.shape[-1], v.shape[-1]
        if dv_ <= dk_:
            pad = (lambda t: t) if dv_ == dk_ else (lambda t: torch.nn.functional.pad(t, (0, dk_ - dv_)))
            dt = q.dtype
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                pad(dout.to(dt)), q, k, pad(v), pad(out.to(dt)), lse.to(acc_dtype(dt)), 0.0, causal, scale=scale)
            return dq, dk, dv[..., :dv_]
    return _math_backward(dout, q, k, v, out, lse, causal, scale)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """What blocks are merged and gradients summed in: fp32 for bf16/fp16 inputs, else their own dtype."""
    return torch.promote_types(dtype, torch.float32)


def _scores(q, k, causal: bool, scale: float, mask=None):
    g, acc = q.shape[1] // k.shape[1], acc_dtype(q.dtype)
    qg = q.to(acc).unflatten(1, (k.shape[1], g))  # (B, Hkv, g, Sq, D): GQA without repeating K
    s = torch.einsum("bhgqd,bhkd->bhgqk", qg, k.to(acc)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(sk - sq + 1), float("-inf"))
    if mask is not None:  # (B, Sq, Sk): other documents' keys are never seen
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    return s


def _math_forward(q, k, v, causal: bool, scale: float, mask=None):
    s, acc = _scores(q, k, causal, scale, mask), acc_dtype(q.dtype)
    lse = s.logsumexp(-1)
    finite = lse.masked_fill(lse.isinf(), 0.0)  # a query that sees no key here: weights exp(-inf) = 0, out 0
    out = torch.einsum("bhgqk,bhkd->bhgqd", (s - finite.unsqueeze(-1)).exp(), v.to(acc))
    return out.flatten(1, 2), lse.flatten(1, 2)


def _math_backward(dout, q, k, v, out, lse, causal: bool, scale: float, mask=None):
    hkv, acc = k.shape[1], acc_dtype(q.dtype)
    s = _scores(q, k, causal, scale, mask)
    p = (s - lse.to(acc).unflatten(1, (hkv, -1)).unsqueeze(-1)).exp()
    do = dout.to(acc).unflatten(1, (hkv, -1))
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, do)
    dp = torch.einsum("bhgqd,bhkd->bhgqk", do, v.to(acc))
    delta = (do * out.to(acc).unflatten(1, (hkv, -1))).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k.to(acc)).flatten(1, 2)
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q.to(acc).unflatten(1, (hkv, -1)))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _merge(out, lse, part_out, part_lse, rows: slice):
    """Fold one block's (out, lse) over query rows `rows` into the running (out, lse), in place."""
    o, l_ = out[:, :, rows], lse[:, :, rows]
    new = torch.logaddexp(l_, part_lse)
    o.mul_((l_ - new).exp().unsqueeze(-1)).add_(part_out * (part_lse - new).exp().unsqueeze(-1))
    l_.copy_(new)


# --- the ring ------------------------------------------------------------------------------------------------
@dataclass
class DocBlocks:
    """Packed documents on the ring: the layout (parallel/cp_split.py: which chunks each rank holds) and, per window,
    its documents, from which each chunk pair's visible rectangles are read (`rects`). Every rectangle is unmasked:
    within a chunk, each document's causal square; between an earlier key chunk and a query chunk, at most one
    rectangle (the query chunk's first document, which alone can reach back, against its keys in the key chunk).
    So the work done is the documents' causal area, not the chunks' area, and a pair no query sees is never
    computed."""
    layout: CPLayout
    first: list[list[int]]  # per window, the document start of each chunk's first position
    opens: list[list[int]]  # per window, the positions where a document starts, ascending

    @staticmethod
    def of(docs: torch.Tensor | None, cp: CPGroup, layout: CPLayout | None = None) -> "DocBlocks | None":
        if docs is None:
            return None
        layout = layout or zigzag(docs.shape[1], cp.size)
        at = torch.arange(docs.shape[1], device=docs.device)
        first = docs[:, ::layout.chunk].tolist()  # the host syncs of a microbatch's blocks: two small lists
        opens = [torch.nonzero(row == at).flatten().tolist() for row in docs]  # a loop over windows
        return DocBlocks(layout, first, opens)

    def rects(self, me: int, src: int) -> list:
        """(window, query rows, key rows, causal) of every rectangle in which this rank's queries see rank src's
        keys (local rows); at src == me the causal squares first: they cover every query once (each sees itself),
        so they start each row's log-sum-exp."""
        c, mine, theirs = self.layout.chunk, self.layout.chunks(me), self.layout.chunks(src)
        squares, others = [], []
        for w, (first, opens) in enumerate(zip(self.first, self.opens)):
            for ia, a in enumerate(mine):
                a0 = a * c
                cuts = [a0, *opens[bisect.bisect_right(opens, a0):bisect.bisect_left(opens, a0 + c)], a0 + c]
                if src == me:  # each document's causal square within the chunk
                    squares += [(w, slice(s - a0 + ia * c, e - a0 + ia * c), slice(s - a0 + ia * c, e - a0 + ia * c),
                                 True) for s, e in zip(cuts, cuts[1:])]
                rows = slice(ia * c, cuts[1] - a0 + ia * c)  # the first document's queries in this chunk
                for ib, b in enumerate(theirs):
                    if b < a and first[a] < (b + 1) * c:  # the first document began before key chunk b ends
                        lo = max(first[a], b * c) - b * c
                        others.append((w, rows, slice(ib * c + lo, (ib + 1) * c), False))
        return squares + others

    def sees(self, me: int, src: int) -> bool:
        return src == me or bool(self.rects(me, src))


def doc_blocks_forward(q, k, v, src: int, me: int, scale: float, docs: DocBlocks, out, lse):
    """Fold q's attention over rank src's keys, rectangle by rectangle, into (out, lse) (made at the own step,
    whose causal squares come first and fill every row)."""
    for w, rows, keys, causal in docs.rects(me, src):
        win = slice(w, w + 1)
        part_out, part_lse = block_attention(q[win, :, rows], k[win, :, keys], v[win, :, keys], causal, scale)
        if out is None:
            acc = part_out.dtype
            out = q.new_empty((*q.shape[:3], v.shape[-1]), dtype=acc)
            lse = q.new_empty(q.shape[:3], dtype=acc)
        if causal:  # a document's square: the first block of its rows
            out[win, :, rows], lse[win, :, rows] = part_out, part_lse
        else:
            _merge(out[win], lse[win], part_out, part_lse, rows)
    return out, lse


def doc_blocks_backward(dout, q, k, v, out, lse, src: int, me: int, scale: float, docs: DocBlocks, dq):
    """(dk, dv) of rank src's keys from this rank's queries, rectangle by rectangle; dq accumulated in place."""
    acc = acc_dtype(q.dtype)
    dk, dv = torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)
    for w, rows, keys, causal in docs.rects(me, src):
        win = slice(w, w + 1)
        dq_b, dk_b, dv_b = block_attention_backward(dout[win, :, rows], q[win, :, rows], k[win, :, keys],
                                                    v[win, :, keys], out[win, :, rows], lse[win, :, rows], causal,
                                                    scale)
        dq[win, :, rows] += dq_b
        dk[win, :, keys] += dk_b
        dv[win, :, keys] += dv_b
    return dk, dv


def _step_blocks(src: int, rank: int, c: int):
    """(query rows, key rows) of the visible half of the block against rank src's chunks (src != rank)."""
    if src < rank:
        return slice(None), slice(0, c)
    return slice(c, None), slice(None)


class _Exchange:
    """One posted ring transfer: send each of `bufs` (name -> tensor) to the next rank, receive the previous rank's
    into fresh buffers. Tensors posted together go as one batch: one link latency for all of them (NCCL's group
    call; the emulator's batch), where separate posts on the axis would queue one behind the other."""

    def __init__(self, cp: CPGroup, bufs: dict):
        self.out = {name: torch.empty_like(buf) for name, buf in bufs.items()}
        ops = []
        for name, buf in bufs.items():
            tag = TAGS[name]
            ops += [dist.P2POp(dist.isend, buf, cp.next, cp.group, tag),
                    dist.P2POp(dist.irecv, self.out[name], cp.prev, cp.group, tag)]
        self.work = comm.batch_isend_irecv(ops, axis=AXIS, async_op=True)

    def wait(self) -> dict:
        self.work.wait()
        return self.out


TAGS = {"kv": 0, "grad": 1}  # a payload (K|V or MLA's latent); a payload's gradient on its way home


def _ring_forward(q, payload, ring: CPGroup, scale: float, to_kv: Callable, docs: "DocBlocks | None" = None):
    """(out, lse, first): q's causal attention over every rank's `payload` (to_kv(payload) -> (k, v)), out and lse
    at least fp32, and the first payload received (the previous rank's; None at cp 1), which backward keeps so
    that its ring starts one hop ahead. docs: within each document only (a block no query can see is skipped)."""
    c = q.shape[2] // 2
    cur, first = payload, None
    out = lse = None
    for step in range(ring.size):
        nxt = _Exchange(ring, {"kv": cur}) if step < ring.size - 1 else None  # posted before this block's compute
        src = (ring.rank - step) % ring.size
        if docs is not None:  # chunk pair by chunk pair; a rank none of whose keys are seen is skipped
            if docs.sees(ring.rank, src):
                out, lse = doc_blocks_forward(q, *to_kv(cur), src, ring.rank, scale, docs, out, lse)
        elif step == 0:
            out, lse = block_attention(q, *to_kv(cur), True, scale)
        else:
            rows, keys = _step_blocks(src, ring.rank, c)
            k, v = to_kv(cur)
            part_out, part_lse = block_attention(q[:, :, rows], k[:, :, keys], v[:, :, keys], False, scale)
            _merge(out, lse, part_out, part_lse, rows)
        if nxt is not None:
            cur = nxt.wait()["kv"]
            first = cur if first is None else first
    return out, lse, first


def _ring_backward(dout, q, payload, first, out, lse, ring: CPGroup, scale: float, to_kv: Callable,
                   kv_grad: Callable, docs: "DocBlocks | None" = None):
    """(dq, d payload): the payload ring runs again, and each payload's gradient travels with it back to its owner
    (d payload = kv_grad(payload, dk, dv), summed over the ranks that used it).

    Forward kept `first` (the previous rank's payload), so the ring starts with a block to compute and one payload
    hop in flight; from then on each step's gradient leaves in one batch with the next payload hop (one latency for
    both), posted once the block is done and waited for after the next. The own (causal) block runs last, while
    the other ranks' summed gradient of this rank's payload makes its final hop home; its own share joins there."""
    acc = acc_dtype(q.dtype)
    c = q.shape[2] // 2
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    if ring.size == 1:
        return dq, _own_backward(dout, q, payload, out, lse, ring, scale, to_kv, kv_grad, docs, dq)
    pending = _Exchange(ring, {"kv": first}) if ring.size > 2 else None  # step 2's payload, behind step 1's block
    cur = first
    for step in range(1, ring.size):
        src = (ring.rank - step) % ring.size
        if docs is not None and docs.sees(ring.rank, src):
            dk, dv = doc_blocks_backward(dout, q, *to_kv(cur), out, lse, src, ring.rank, scale, docs, dq)
            dpay = kv_grad(cur, dk, dv).to(acc)
        elif docs is None:
            rows, keys = _step_blocks(src, ring.rank, c)
            k, v = to_kv(cur)
            dq_b, dk_b, dv_b = block_attention_backward(dout[:, :, rows], q[:, :, rows], k[:, :, keys],
                                                        v[:, :, keys], out[:, :, rows], lse[:, :, rows],
                                                        False, scale)
            dq[:, :, rows] += dq_b
            dk, dv = k.new_zeros(k.shape), v.new_zeros(v.shape)
            dk[:, :, keys], dv[:, :, keys] = dk_b, dv_b
            dpay = kv_grad(cur, dk, dv).to(acc)
        else:  # no query here sees this payload: its gradient from this rank is zero
            dpay = torch.zeros(cur.shape, dtype=acc, device=cur.device)
        got = pending.wait() if pending is not None else {}
        if "grad" in got:  # the previous ranks' share of this payload's gradient
            dpay += got["grad"]
        cur = got.get("kv")
        # on to the next rank that holds this payload (the owner, at the end), beside the next payload hop
        pending = _Exchange(ring, {"grad": dpay, "kv": cur} if step + 2 < ring.size else {"grad": dpay})
    own = _own_backward(dout, q, payload, out, lse, ring, scale, to_kv, kv_grad, docs, dq)
    return dq, own + pending.wait()["grad"]


def _own_backward(dout, q, payload, out, lse, ring: CPGroup, scale: float, to_kv: Callable, kv_grad: Callable,
                  docs: "DocBlocks | None", dq):
    """The own (causal) block's d payload; its dq added to dq in place."""
    k, v = to_kv(payload)
    if docs is not None:
        dk, dv = doc_blocks_backward(dout, q, k, v, out, lse, ring.rank, ring.rank, scale, docs, dq)
    else:
        dq_b, dk, dv = block_attention_backward(dout, q, k, v, out, lse, True, scale)
        dq += dq_b
    return kv_grad(payload, dk, dv).to(acc_dtype(q.dtype))


def _split_kv(dk: int):
    return lambda kv: (kv[..., :dk], kv[..., dk:])


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp, scale, docs):
        kv = torch.cat([k, v], dim=-1).contiguous()  # one message per step: Hkv heads of K and V
        out, lse, first = _ring_forward(q, kv, cp, scale, _split_kv(k.shape[-1]), docs)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, first)
        ctx.cp, ctx.scale, ctx.docs = cp, scale, docs
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, first = ctx.saved_tensors
        cp, scale, dk_ = ctx.cp, ctx.scale, k.shape[-1]
        dout = dout.contiguous()
        kv = torch.cat([k, v], dim=-1).contiguous()
        dq, dkv = _ring_backward(dout, q, kv, first, out, lse, cp, scale, _split_kv(dk_),
                                 lambda _kv, dk, dv: torch.cat([dk, dv], dim=-1), ctx.docs)
        return dq.to(q.dtype), dkv[..., :dk_].to(k.dtype), dkv[..., dk_:].to(v.dtype), None, None, None


def _check_local(q, k, v, cp: CPGroup) -> None:
    if q.shape[2] % 2:
        raise ValueError(f"context parallel: the local sequence ({q.shape[2]} tokens) must be two equal chunks; "
                         f"set --train.seq_len to a multiple of 2 * --parallel.cp ({2 * cp.size})")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(f"context parallel: --model.n_heads ({q.shape[1]}) must be a multiple of "
                         f"--model.n_kv_heads ({k.shape[1]})")


def ring_attention(q, k, v, cp: CPGroup, scale: float, docs: torch.Tensor | None = None,
                   layout: CPLayout | None = None):
    """Exact causal attention of this CP rank's queries over the whole sequence (module docstring). q: (B, Hq, S_loc,
    Dk), k: (B, Hkv, S_loc, Dk), v: (B, Hkv, S_loc, Dv) in the balanced local order; returns (B, Hq, S_loc, Dv).
    docs: the whole windows' document starts (B, S) (model/docs.py): within each document only; layout: which
    chunks each rank holds (parallel/cp_split.py; None: zigzag's two), read only with docs."""
    _check_local(q, k, v, cp)
    return _RingAttention.apply(q, k, v, cp, scale, DocBlocks.of(docs, cp, layout))


# --- MLA: the ring carries the latent --------------------------------------------------------------------------
class _Expander:
    """expand(latent) -> (k, v) for the ring: values only in forward; in backward each step's expansion keeps its
    graph so that (dk, dv) turn into d latent (which travels home) and the expand weights' gradient (kept here:
    every rank's own queries' share, summed over CP by the gradient reduction of params replicated over CP)."""

    def __init__(self, expand, params, grad: bool):
        self.expand, self.params, self.grad = expand, params, grad
        self.param_grads = [None] * len(params)
        self._last = None

    def to_kv(self, latent):
        # Autocast off, in forward as in backward's recompute: one function both ways, and (k, v) in the roped
        # queries' fp32 under bf16 autocast (as the plain ring's K|V): autocast's bf16 v beside an fp32 k and q
        # failed in the attention kernel (verify's fuzzer: MLA, bf16, CP ring).
        with torch.autocast(latent.device.type, enabled=False):
            if not self.grad:
                return self.expand(latent.to(acc_dtype(latent.dtype)))
            with torch.enable_grad():
                lat = latent.detach().requires_grad_()
                k, v = self.expand(lat.to(acc_dtype(lat.dtype)))
        self._last = (lat, k, v)
        return k.detach(), v.detach()

    def kv_grad(self, latent, dk, dv):
        lat, k, v = self._last
        self._last = None
        with torch.enable_grad():
            grads = torch.autograd.grad((k, v), [lat, *self.params], (dk.to(k.dtype), dv.to(v.dtype)),
                                        allow_unused=True)
        for i, g in enumerate(grads[1:]):
            if g is not None:
                self.param_grads[i] = g if self.param_grads[i] is None else self.param_grads[i] + g
        return grads[0] if grads[0] is not None else torch.zeros_like(latent)


class _RingLatentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, latent, cp, scale, docs, expand, *params):
        latent = latent.contiguous()
        out, lse, first = _ring_forward(q, latent, cp, scale, _Expander(expand, params, False).to_kv, docs)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, latent, out, lse, first)
        ctx.cp, ctx.scale, ctx.expand, ctx.n_params, ctx.docs = cp, scale, expand, len(params), docs
        ctx.params = params  # leaves (the module's own parameters): nothing is freed by saving them
        return out

    @staticmethod
    def backward(ctx, dout):
        q, latent, out, lse, first = ctx.saved_tensors
        ex = _Expander(ctx.expand, ctx.params, True)
        dq, dlat = _ring_backward(dout.contiguous(), q, latent, first, out, lse, ctx.cp, ctx.scale, ex.to_kv,
                                  ex.kv_grad, ctx.docs)
        return (dq.to(q.dtype), dlat.to(latent.dtype), None, None, None, None, *ex.param_grads)


def ring_latent_attention(q, latent, expand, cp: CPGroup, scale: float, docs: torch.Tensor | None = None,
                          layout: CPLayout | None = None):
    """MLA's exact causal attention under CP with the compressed latent on the ring. q: (B, H, S_loc, Dqk);
    latent: (B, S_loc, kv_lora_rank + rope_dim), the post-norm c_kv and the already roped k_rope; expand: an
    nn.Module (or a callable with no weights of its own) mapping a latent (B, S, R + Dr) to (k (B, H, S, Dqk),
    v (B, H, S, Dv)). Gradients reach q, the latent and expand's parameters, exactly. Returns (B, H, S_loc, Dv).
    docs, layout: as `ring_attention`."""
    if q.shape[2] % 2 or latent.shape[1] != q.shape[2]:
        raise ValueError(f"context parallel: the local sequence ({q.shape[2]} queries, {latent.shape[1]} latents) "
                         f"must be two equal chunks; set --train.seq_len to a multiple of 2 * --parallel.cp "
                         f"({2 * cp.size})")
    params = [p for p in expand.parameters() if p.requires_grad] if isinstance(expand, torch.nn.Module) else []
    return _RingLatentAttention.apply(q, latent, cp, scale, DocBlocks.of(docs, cp, layout), expand, *params)


def latent_bytes_per_token(kv_lora_rank: int = 512, rope_dim: int = 64, n_heads: int = 128, nope_dim: int = 128,
                           v_dim: int = 128, n_kv_heads: int | None = None) -> dict:
    """Values per token per ring step: MLA's latent against the whole per-head K/V it expands to (DeepSeek-V3's
    shape by default), and a plain attention's K/V with n_kv_heads heads of nope+rope / v dims."""
    latent = kv_lora_rank + rope_dim
    whole = n_heads * (nope_dim + rope_dim) + n_heads * v_dim
    kv = None if n_kv_heads is None else n_kv_heads * (nope_dim + rope_dim + v_dim)
    return {"latent": latent, "whole_kv": whole, "ratio": whole / latent, "gqa_kv": kv}


# --- Ulysses: all-to-all from sequence shard to head shard -------------------------------------------------------
def _a2a(x: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """all_to_all_single over dim 0 (one slab per CP rank)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    comm.all_to_all_single(out, x, group=cp.group, axis=AXIS)
    return out


def _seq_to_heads(x, cp: CPGroup, order: torch.Tensor):
    """(B, H, S_loc, D) sequence shard -> (B, H/N, S, D) head shard in GLOBAL token order (`order`: the global
    position of each token in rank order, parallel/cp_split.py)."""
    n = cp.size
    y = _a2a(x.unflatten(1, (n, -1)).movedim(1, 0), cp)  # (N src, B, H/N, S_loc, D)
    y = y.movedim(0, 2).flatten(2, 3)  # tokens in rank order: rank 0's chunks, rank 1's, ...
    return y.index_select(2, torch.argsort(order).to(y.device))


def _heads_to_seq(y, cp: CPGroup, order: torch.Tensor):
    """The inverse of _seq_to_heads."""
    n = cp.size
    y = y.index_select(2, order.to(y.device)).unflatten(2, (n, -1)).movedim(2, 0)
    return _a2a(y, cp).movedim(0, 1).flatten(1, 2)  # (B, N head groups, H/N, S_loc, D) -> (B, H, S_loc, D)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, route, inverse):  # route: (the CP group, the layout's order)
        ctx.route, ctx.inverse = route, inverse
        return _heads_to_seq(x, *route) if inverse else _seq_to_heads(x, *route)

    @staticmethod
    def backward(ctx, g):
        return (_seq_to_heads(g, *ctx.route) if ctx.inverse else _heads_to_seq(g, *ctx.route)), None, None


def ulysses_attention(q, k, v, cp: CPGroup, scale: float, docs: torch.Tensor | None = None,
                      layout: CPLayout | None = None):
    """Exact causal attention by all-to-all (DeepSpeed-Ulysses): each rank attends the whole sequence for Hq/N
    query heads. KV heads: Hkv % N == 0 shards them too; Hkv dividing N replicates each KV head N/Hkv times
    before the exchange, so that every rank receives the one KV head its query heads share. layout: which chunks
    each rank holds (parallel/cp_split.py; None: zigzag's two)."""
    hq, hkv, n = q.shape[1], k.shape[1], cp.size
    if hq % n or hq % hkv or (hkv % n and n % hkv):
        raise ValueError(f"parallel.cp_impl a2a: --model.n_heads ({hq}) must be a multiple of --parallel.cp ({n}) "
                         f"and --model.n_kv_heads ({hkv}) a multiple or a divisor of it; use --parallel.cp_impl "
                         f"ring or another --parallel.cp")
    if hkv % n:
        k, v = k.repeat_interleave(n // hkv, dim=1), v.repeat_interleave(n // hkv, dim=1)
    order = (layout or zigzag(q.shape[2] * n, n)).order()
    qh, kh, vh = (_SeqToHeads.apply(t, (cp, order), False) for t in (q, k, v))
    if docs is not None:  # the whole sequence in global order: per document, as on one device
        out = doc_attention(qh, kh, vh, docs, scale)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                                               enable_gqa=True)
    return _SeqToHeads.apply(out, (cp, order), True)
