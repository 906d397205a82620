"""model.experts_impl "grouped" (one torch._grouped_mm per projection, offsets on the device) against the per-expert
loop: ExpertFFN alone (empty experts included), the MoE layer with capacity drops (the rows past the kept prefix),
zb1's deferred weight gradients (model/wgrad.py, fused and not) and the chunked EP trip's building blocks;
≤ 1e-6 relative in fp32, the bf16 bound under bf16 autocast. Multi-rank rows (EP2 with zb1, the chunked trips and
the lanes) are in tests/equivalence/test_equivalence_pp.py and tests/equivalence/test_equivalence_ep_lanes.py."""

import contextlib

import pytest
import torch

from nanotitan.model import wgrad
from nanotitan.model.moe import MoE, ExpertFFN, expert_counts

D, F, L = 16, 24, 4


def _experts(impl):
    torch.manual_seed(0)
    e = ExpertFFN(L, D, F, impl)
    for w in (e.W_gate, e.W_val, e.W_out):
        torch.nn.init.normal_(w, std=0.2)
    return e


def _run(impl, counts, dtype, store=None, fuse_twice=False):
    e = _experts(impl)
    torch.manual_seed(1)
    x = torch.randn(sum(counts), D, requires_grad=True)
    dy = torch.randn(sum(counts), D)
    if store is not None:
        wgrad.attach(e, store)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == torch.bfloat16 else contextlib.nullcontext()
    with ctx:
        y = e(x, torch.tensor(counts) if impl == "grouped" else counts)
    defer = store.deferring() if store is not None else contextlib.nullcontext()
    with defer:
        y.backward(dy.to(y.dtype))
    if store is not None:
        work = store.take()
        if fuse_twice:  # a .grad already there: the fused path adds into it
            for p in e.parameters():
                p.grad = torch.zeros_like(p)
        wgrad.WeightGradStore.run(work)
    return y.float(), x.grad, [p.grad for p in e.parameters()]


def _close(a, b, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * b.abs().max().item())
    else:  # bf16: one rounding of the output/gradient on either side
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1.6e-2 * b.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("store", [None, "plain", "fused"])
def test_grouped_matches_loop(dtype, store):
    counts = [5, 0, 9, 3]  # an empty expert: its rows, output and weight gradient are empty / zero
    make = {None: lambda: None, "plain": wgrad.WeightGradStore, "fused": lambda: wgrad.WeightGradStore(fuse=True)}
    ref = _run("loop", counts, dtype)
    got = _run("grouped", counts, dtype, make[store](), fuse_twice=store == "fused")
    for a, b in zip([got[0], got[1], *got[2]], [ref[0], ref[1], *ref[2]]):
        _close(a, b, dtype)
    assert torch.count_nonzero(got[2][0][1]) == 0  # expert 1 saw no row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_capacity_grouped(dtype):
    """Capacity drops: the dropped rows sit past the kept prefix, which only the device knows; no expert computes
    them, they add nothing to the output and no gradient (x, router, weights) comes back through them."""
    outs = {}
    for impl in ("loop", "grouped"):
        torch.manual_seed(0)
        moe = MoE(D, F, 4, 2, True, 0, 4, capacity_factor=0.6, experts_impl=impl)
        for w in (moe.experts.W_gate, moe.experts.W_val, moe.experts.W_out):
            torch.nn.init.normal_(w, std=0.2)
        torch.manual_seed(1)
        x = torch.randn(2, 12, D, requires_grad=True)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == torch.bfloat16 else contextlib.nullcontext()
        with ctx:
            y, aux = moe(x)
        (y.float().square().sum() + aux).backward()
        assert moe.last_router_stats[2] > 0  # some assignments were dropped
        outs[impl] = [y.float(), x.grad] + [p.grad for p in moe.parameters()]
    for a, b in zip(outs["grouped"], outs["loop"]):
        _close(a, b, dtype)


def test_expert_counts_is_bincount():
    ids = torch.randint(0, 5, (37, 2))
    assert torch.equal(expert_counts(ids, 6), torch.bincount(ids.reshape(-1), minlength=6))


def test_auto_keeps_the_loop_on_cpu():
    """auto's table (docs/moe.md: a tie on CPU, so the loop); grouped and loop are what they say."""
    x = torch.zeros(2, D)
    assert not ExpertFFN(L, D, F, "auto").grouped(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not ExpertFFN(L, D, F, "auto").grouped(x)
    assert ExpertFFN(L, D, F, "grouped").grouped(x) and not ExpertFFN(L, D, F, "loop").grouped(x)
