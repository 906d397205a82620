"""Attention under context parallelism (parallel/cp_attn.py, docs/cp.md): ring, Ulysses and MLA's latent ring each
equal one process's whole-sequence causal SDPA, forward and every input gradient, to fp32 relative 1e-6.

One 4-rank gloo launch runs every case at cp 4 (the world) and at cp 2 (two groups, ranks {0, 1} and {2, 3}); each
rank holds its chunks i and 2N-1-i of the same global tensors the reference attends whole."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanotitan.parallel import cp_attn
from nanotitan.parallel.cp_attn import CPRing, balanced_order
from tests.helpers.mp import run_ranks

TOL = 1e-6  # fp32, relative to the reference's largest entry
SCALE = 0.2


class Expand(torch.nn.Module):
    """MLA's up-projection as the model does it: c_kv -> per-head k_nope and v; k_rope (already roped) shared."""

    def __init__(self, rank: int, rope: int, heads: int, nope: int, v: int):
        super().__init__()
        self.rank, self.heads, self.nope, self.v = rank, heads, nope, v
        self.w = torch.nn.Linear(rank, heads * (nope + v), bias=False)

    def forward(self, latent):  # (B, S, R + Dr) -> (B, H, S, nope + Dr), (B, H, S, v)
        c, k_rope = latent[..., :self.rank], latent[..., self.rank:]
        kv = self.w(c).unflatten(-1, (self.heads, self.nope + self.v)).transpose(1, 2)
        k = torch.cat([kv[..., :self.nope], k_rope.unsqueeze(1).expand(-1, self.heads, -1, -1)], dim=-1)
        return k, kv[..., self.nope:]


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _case_qkv(fn, cp, idx, hq, hkv, seed):
    """Errors of fn (ring or Ulysses) against whole-sequence SDPA, and the bytes it put on the cp axis."""
    from nanotitan.parallel.comm.collectives import COMM

    g = torch.Generator().manual_seed(seed)
    b, s, d = 2, idx.numel() * cp.size, 8
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, s, d, generator=g)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*whole, is_causal=True, scale=SCALE, enable_gqa=True).backward(dout)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
    local = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    COMM.reset()
    out = fn(*local, cp, SCALE)
    out.backward(dout[:, :, idx])
    errs = [_rel(out, ref[:, :, idx])] + [_rel(t.grad, w.grad[:, :, idx]) for t, w in zip(local, whole)]
    return errs, COMM.bytes["cp"]


def _case_bf16(cp, idx, seed):
    """The ring in bf16 and one process's SDPA in bf16, each against the fp32 whole-sequence reference."""
    g = torch.Generator().manual_seed(seed)
    b, s, d, bf = 2, idx.numel() * cp.size, 8, torch.bfloat16
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h in (4, 2, 2))
    dout = torch.randn(b, 4, s, d, generator=g)
    errs = {}
    for name, dtype in (("fp32", torch.float32), ("bf16 one process", bf)):
        whole = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*whole, is_causal=True, scale=SCALE, enable_gqa=True)
        out.backward(dout.to(dtype))
        errs[name] = [out.float()[:, :, idx]] + [w.grad.float()[:, :, idx] for w in whole]
    local = [t[:, :, idx].to(bf).requires_grad_() for t in (q, k, v)]
    out = cp_attn.ring_attention(*local, cp, SCALE)
    out.backward(dout[:, :, idx].to(bf))
    mine = [out.float()] + [t.grad.float() for t in local]
    assert all(t.dtype == bf for t in [out] + [t.grad for t in local])
    ref = errs.pop("fp32")
    return [_rel(a, r) for a, r in zip(mine, ref)], [_rel(a, r) for a, r in zip(errs["bf16 one process"], ref)]


def _case_latent(cp, idx, seed):
    """MLA latent ring against whole-sequence SDPA of the expanded K/V: out, dq, d latent, d expand weight."""
    from nanotitan.parallel.comm.collectives import COMM

    torch.manual_seed(seed)
    r, rope, h, nope, dv = 16, 8, 4, 8, 6
    ex = Expand(r, rope, h, nope, dv)
    b, s = 2, idx.numel() * cp.size
    latent, q, dout = torch.randn(b, s, r + rope), torch.randn(b, h, s, nope + rope), torch.randn(b, h, s, dv)
    lat_w, q_w = latent.clone().requires_grad_(), q.clone().requires_grad_()
    ref = F.scaled_dot_product_attention(q_w, *ex(lat_w), is_causal=True, scale=SCALE)
    ref.backward(dout)
    w_ref, ex.w.weight.grad = ex.w.weight.grad, None
    lat_l, q_l = latent[:, idx].clone().requires_grad_(), q[:, :, idx].clone().requires_grad_()
    COMM.reset()
    out = cp_attn.ring_latent_attention(q_l, lat_l, ex, cp, SCALE)
    out.backward(dout[:, :, idx])
    sent = COMM.bytes["cp"]
    w = ex.w.weight.grad.clone()
    dist.all_reduce(w, group=cp.group)  # each rank holds its queries' share; CP's gradient reduction sums them
    errs = [_rel(out, ref[:, :, idx]), _rel(q_l.grad, q_w.grad[:, :, idx]), _rel(lat_l.grad, lat_w.grad[:, idx]),
            _rel(w, w_ref)]
    return errs, sent


def _case_docs(fn, cp, idx, hq, hkv, seed, split=None):
    """fn (ring or Ulysses) with packed documents against one process's per-document SDPA over the whole sequence,
    and how many of the ring's block pairs this rank computed (the others: no query of the pair sees a key of it).
    split: None (zigzag), "docs" (the balanced layout of these documents) or "contiguous" (rank r holds chunks 2r
    and 2r+1: a layout neither zigzag nor balanced, held in global order all the same)."""
    from nanotitan.model.docs import doc_starts
    from nanotitan.model.tokens import doc_attention
    from nanotitan.parallel import cp_split

    g = torch.Generator().manual_seed(seed)
    b, s, d = 2, idx.numel() * cp.size, 8
    x = torch.zeros(b, s, dtype=torch.long)
    for row, eots in enumerate(((3, 12, 14, 26), (3, 5, 20))):  # each row's first document ends with chunk 0
        x[row, [e for e in eots if e < s]] = 1
    starts = doc_starts(x, 1)
    layout = {None: None, "docs": cp_split.balanced(starts, cp.size),
              "contiguous": cp_split.CPLayout(4, tuple(j // 2 for j in range(2 * cp.size)), cp.size)}[split]
    idx = idx if layout is None else layout.positions(cp.rank)
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, s, d, generator=g)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = doc_attention(*whole, starts, SCALE)
    ref.backward(dout)
    local = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    computed, block = [], cp_attn.block_attention
    cp_attn.block_attention = lambda *a, **kw: computed.append(1) or block(*a, **kw)
    try:
        out = fn(*local, cp, SCALE, starts, layout)
    finally:
        cp_attn.block_attention = block
    out.backward(dout[:, :, idx])
    errs = [_rel(out, ref[:, :, idx])] + [_rel(t.grad, w.grad[:, :, idx]) for t, w in zip(local, whole)]
    return errs, len(computed)


def _rank(rank: int, world: int) -> dict:
    rings = {4: cp_attn.cp_ring(dist.group.WORLD)}
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    rings[2] = cp_attn.cp_ring(pairs[rank // 2])
    out = {}
    for n, cp in rings.items():
        idx = balanced_order(8 * n, n).view(n, -1)[cp.rank]  # 8 tokens per rank: chunks of 4
        for name, fn, hq, hkv in (("ring mha", cp_attn.ring_attention, 4, 4),
                                  ("ring gqa", cp_attn.ring_attention, 4, 1),
                                  ("a2a", cp_attn.ulysses_attention, 4, 4),
                                  ("a2a kv-rep", cp_attn.ulysses_attention, 8, 2)):
            out[n, name] = _case_qkv(fn, cp, idx, hq, hkv, seed=n)
        out[n, "mla"] = _case_latent(cp, idx, seed=n)
        out[n, "ring docs"] = _case_docs(cp_attn.ring_attention, cp, idx, 4, 2, seed=n)
        out[n, "a2a docs"] = _case_docs(cp_attn.ulysses_attention, cp, idx, 4, 4, seed=n)
        for split in ("docs", "contiguous"):
            out[n, f"ring docs {split}"] = _case_docs(cp_attn.ring_attention, cp, idx, 4, 2, n, split)
            out[n, f"a2a docs {split}"] = _case_docs(cp_attn.ulysses_attention, cp, idx, 4, 4, n, split)
        out[n, "bf16"] = _case_bf16(cp, idx, seed=n)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, 4, timeout=120)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", ["ring mha", "ring gqa", "a2a", "a2a kv-rep", "mla"])
def test_equals_whole_sequence_sdpa(results, n, name):
    """Forward and every input gradient (and the expand weight's, summed over CP) within fp32 relative 1e-6."""
    for rank, res in enumerate(results):
        errs, _ = res[n, name]
        assert max(errs) <= TOL, (rank, n, name, errs)


@pytest.mark.parametrize("n", [2, 4])
def test_packed_documents_equal_one_process_and_the_ring_skips_blocks_no_query_sees(results, n):
    """Documents that cross the chunks: ring and Ulysses equal one process's per-document attention (forward and
    every input gradient), on zigzag's layout, the documents' balanced one and a contiguous one; at CP4 a rank
    whose queries share no document with an earlier chunk skips that pair (the first document of each row ends
    with chunk 0)."""
    for rank, res in enumerate(results):
        for name in ("ring docs", "a2a docs", "ring docs docs", "a2a docs docs", "ring docs contiguous",
                     "a2a docs contiguous"):
            errs, _ = res[n, name]
            assert max(errs) <= TOL, (rank, n, name, errs)
    if n == 4:  # the first document of each row ends with chunk 0: rank 0's ring skips a peer's keys entirely
        assert min(res[n, "ring docs"][1] for res in results) < max(res[n, "ring docs"][1] for res in results)


def test_doc_rectangles_cover_exactly_the_pairs_of_one_document():
    """The ring's rectangles for every (rank, peer) cover each visible (query, key) pair once (same document, key
    not after the query) and nothing else, on zigzag's, the balanced and a contiguous layout: the work done is the
    documents' causal area."""
    from nanotitan.model.docs import doc_starts
    from nanotitan.parallel import cp_split

    g = torch.Generator().manual_seed(0)
    for n, S in ((2, 32), (4, 64)):
        x = (torch.rand(3, S, generator=g) < 0.15).long()
        x[1, :] = 0  # one window a single document
        starts = doc_starts(x, 1)
        for layout in (cp_split.zigzag(S, n), cp_split.balanced(starts, n),
                       cp_split.CPLayout(S // (2 * n), tuple(j // 2 for j in range(2 * n)), n)):
            docs = cp_attn.DocBlocks.of(starts, cp_attn.CPRing(None, 0, n, 0, 0), layout)
            for me in range(n):
                for src in range(n):
                    pq, pk = layout.positions(me), layout.positions(src)
                    same = starts[:, pq].unsqueeze(2) == starts[:, pk].unsqueeze(1)
                    want = same & (pk[None, None] <= pq[None, :, None])
                    got = torch.zeros_like(want, dtype=torch.int64)
                    for w, rows, keys, causal in docs.rects(me, src):
                        block = torch.ones(rows.stop - rows.start, keys.stop - keys.start, dtype=torch.int64)
                        got[w, rows, keys] += block.tril() if causal else block
                    assert torch.equal(got, want.long()), (n, layout, me, src)
                    assert docs.sees(me, src) == bool(want.any()) or src == me


@pytest.mark.parametrize("n", [2, 4])
def test_ring_sends_kv_heads_and_latent_only(results, n):
    """Forward N-1 sends of Hkv heads' K|V (GQA never repeats them), backward N-2 more (forward kept the first it
    received) plus N-1 of dK|dV (fp32): each counted sent and received. MLA: the latent (R + Dr = 24 values per
    token) instead of 4 heads of K|V."""
    b, s_loc, d = 2, 8, 8
    for res in results:
        kv = b * 1 * s_loc * 2 * d * 4  # one KV head, K and V, fp32
        assert res[n, "ring gqa"][1] == 2 * kv * (3 * (n - 1) - 1)
        lat = b * s_loc * 24 * 4
        assert res[n, "mla"][1] == 2 * lat * (3 * (n - 1) - 1)


@pytest.mark.parametrize("n", [2, 4])
def test_bf16_ring_within_one_process_bf16_bound(results, n):
    """In bf16 the ring (blocks merged and gradients summed in fp32) is as close to the fp32 reference as one
    process's bf16 SDPA is: within twice its error, forward and every input gradient."""
    for res in results:
        ring, one = res[n, "bf16"]
        assert all(r <= 2 * o + 1e-3 for r, o in zip(ring, one)), (n, ring, one)


def test_cp1_is_plain_causal_attention():
    """A one-rank CPGroup (no process group) runs the local block alone: whole-sequence SDPA, grads included."""
    cp = CPRing(None, 0, 1, 0, 0)
    q, k, v = (torch.randn(1, 4, 16, 8, requires_grad=True) for _ in range(3))
    out = cp_attn.ring_attention(q, k, v, cp, SCALE)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)
    assert _rel(out, ref) <= TOL
    g = torch.autograd.grad(out.sum(), (q, k, v))
    g_ref = torch.autograd.grad(ref.sum(), (q, k, v))
    assert max(_rel(a, b) for a, b in zip(g, g_ref)) <= TOL


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dk,dv,hkv", [(8, 8, 4), (8, 8, 2), (12, 8, 2), (8, 12, 1)])
def test_block_kernel_against_sdpa(causal, dk, dv, hkv):
    """One block's (out, lse) and its backward from the merged out/lse, on torch's CPU flash kernel (dv <= dk) and
    the math path (dv > dk), against SDPA's autograd and logsumexp."""
    q, k = torch.randn(2, 4, 16, dk, requires_grad=True), torch.randn(2, hkv, 16, dk, requires_grad=True)
    v, dout = torch.randn(2, hkv, 16, dv, requires_grad=True), torch.randn(2, 4, 16, dv)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=SCALE, enable_gqa=True)
    grads = torch.autograd.grad(ref, (q, k, v), dout)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(4 // hkv, 1)) * SCALE
    if causal:
        s = s.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    out, lse = cp_attn.block_attention(q.detach(), k.detach(), v.detach(), causal, SCALE)
    assert _rel(out, ref) <= TOL and _rel(lse, s.logsumexp(-1)) <= TOL
    mine = cp_attn.block_attention_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, causal, SCALE)
    assert max(_rel(a, b) for a, b in zip(mine, grads)) <= TOL


def test_bad_heads_and_lengths_fail_in_one_line():
    """a2a with heads cp does not divide, and a local stream that is not two equal chunks: one line naming the fix,
    before any collective (the CPGroup here has no process group at all)."""
    cp = CPRing(None, 0, 4, 3, 1)
    x = torch.randn(1, 6, 8, 4)
    with pytest.raises(ValueError, match=r"--model.n_heads \(6\) must be a multiple of --parallel.cp \(4\)") as e:
        cp_attn.ulysses_attention(x, x, x, cp, SCALE)
    assert "\n" not in str(e.value)
    q, kv = torch.randn(1, 8, 8, 4), torch.randn(1, 3, 8, 4)
    with pytest.raises(ValueError, match=r"--model.n_kv_heads \(3\)"):
        cp_attn.ulysses_attention(q, kv, kv, cp, SCALE)
    odd = torch.randn(1, 4, 7, 4)
    with pytest.raises(ValueError, match=r"--train.seq_len to a multiple of 2 \* --parallel.cp \(8\)") as e:
        cp_attn.ring_attention(odd, odd, odd, cp, SCALE)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="--train.seq_len"):
        cp_attn.ring_latent_attention(odd, torch.randn(1, 7, 6), torch.nn.Identity(), cp, SCALE)


def test_latent_bytes_at_deepseek_v3():
    """DeepSeek-V3: 576 latent values per token against 128 heads of (128 + 64) K and 128 V."""
    got = cp_attn.latent_bytes_per_token()
    assert got["latent"] == 576 and got["whole_kv"] == 128 * (128 + 64) + 128 * 128
    assert round(got["ratio"], 1) == 71.1


def test_local_positions_are_chunks_i_and_2n_minus_1_minus_i():
    """cp.md's split: at S = 16, N = 2, rank 0 holds [0, 4) + [12, 16), rank 1 [4, 8) + [8, 12); every position once."""
    assert cp_attn.local_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_attn.local_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(balanced_order(48, 4).tolist()) == list(range(48))
