"""Deferred weight gradients (model/wgrad.py): with a store attached, the input gradient and every weight gradient
are bitwise autograd's, whether computed at once or deferred and run later; a deferred backward leaves every
.grad untouched, and the gradient sinks see each term once."""

from __future__ import annotations

import pytest
import torch

from nanotitan.config.config import ModelConfig
from nanotitan.model import wgrad
from nanotitan.model.spec import ModelShardSpec
from nanotitan.model.transformer import Transformer

SEED = 3


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=97, d_model=32, n_layers=3, n_heads=4, ffn_dim=48, num_experts=4, top_k=2,
                max_seq_len=16, aux_coef=0.1)
    base.update(kw)
    return ModelConfig(**base)


CASES = {
    "mixtral": {},
    "qwen2": dict(attn_bias=True, shared_experts=1, shared_expert_gate=True, z_loss_coef=1e-3, moe_every=2),
    "qwen3_capacity": dict(qk_norm="head", n_kv_heads=2, capacity_factor=1.0, router_score="sigmoid",
                           pos_emb="learned"),
}


def _middle_stage(cfg: ModelConfig) -> ModelShardSpec:
    """Layers 1.. with the head: the input is a hidden state, as on a later pipeline stage."""
    full = ModelShardSpec.full(cfg)
    return ModelShardSpec(**{**full.__dict__, "layer_start": 1, "has_token_embed": False, "has_pos_embed": False})


def _run(cfg, spec, inp, tgt, mode: str, ckpt: bool, bf16: bool = False):
    """Gradients after one backward of ce + aux: mode plain (no store), now (store, not deferring), later (deferred,
    then run). Returns (input grad or None, {name: grad}, .grad values right after the deferred backward)."""
    model = Transformer(cfg, spec, SEED)
    model.activation_checkpointing = ckpt
    store = wgrad.WeightGradStore() if mode != "plain" else None
    wgrad.attach(model, store)
    if store is not None:  # autograd must never reach a parameter: its hooks would fire even without a gradient
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: pytest.fail("AccumulateGrad ran on an attached model"))
    x = inp.clone().requires_grad_(True) if inp.is_floating_point() else inp
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # the trainer's mixed precision
        ce, aux = model(x, tgt)
    loss = ce + 0.3 * aux
    after_b = None
    if mode == "later":
        with store.deferring():
            loss.backward()
        after_b = [p.grad for p in model.parameters()]
        work = store.take()
        assert work, "nothing was deferred"
        wgrad.WeightGradStore.run(work)
    else:
        loss.backward()
    return (x.grad if inp.is_floating_point() else None), {n: p.grad for n, p in model.named_parameters()}, after_b


@pytest.mark.parametrize("name", sorted(CASES) + ["mixtral_bf16"])
@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("first", [False, True])
def test_deferred_grads_equal_autograds(name, ckpt, first):
    bf16 = name.endswith("_bf16")
    cfg = _cfg(**CASES[name.removesuffix("_bf16")])
    g = torch.Generator().manual_seed(1)
    tgt = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    if first:
        spec, inp = ModelShardSpec.full(cfg), torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    else:
        spec, inp = _middle_stage(cfg), torch.randn(2, 16, cfg.d_model, generator=g)
    ref_in, ref, _ = _run(cfg, spec, inp, tgt, "plain", ckpt, bf16)
    for mode in ("now", "later"):
        got_in, got, after_b = _run(cfg, spec, inp, tgt, mode, ckpt, bf16)
        if ref_in is not None:
            assert torch.equal(got_in, ref_in), f"{mode}: input gradient differs"
        assert got.keys() == ref.keys()
        for n in ref:
            assert ref[n] is not None, n
            assert torch.equal(got[n], ref[n]), f"{name} ckpt={ckpt} {mode}: {n} differs by " \
                                                f"{(got[n] - ref[n]).abs().max().item():.3e}"
        if mode == "later":
            assert all(gr is None for gr in after_b), "a deferred backward accumulated a weight gradient"


def _middle_stage_reference(n: int, seed: int):
    """A middle stage, n microbatches of its input activations and targets, and a reference copy that accumulated
    their plain backwards."""
    cfg = _cfg()
    spec = _middle_stage(cfg)
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2, 16, cfg.d_model, generator=g) for _ in range(n)]
    ys = [torch.randint(0, cfg.vocab_size, (2, 16), generator=g) for _ in range(n)]
    ref = Transformer(cfg, spec, SEED)
    for x, y in zip(xs, ys):
        ce, aux = ref(x, y)
        (ce + aux).backward()
    return cfg, spec, xs, ys, ref


def _deferred_backwards(model, store, xs, ys) -> list:
    """Each microbatch's forward and deferred backward (zb1's B); returns each one's pending weight work (its W)."""
    works = []
    for x, y in zip(xs, ys):
        ce, aux = model(x.requires_grad_(True), y)
        with store.deferring():
            (ce + aux).backward()
        works.append(store.take())
    return works


def test_sinks_take_every_term_once():
    """A registered sink receives each deferred term instead of .grad (the gradient syncs' entry point); two
    microbatches deferred and run in order accumulate as two plain backwards do."""
    cfg, spec, xs, ys, ref = _middle_stage_reference(n=2, seed=2)

    model = Transformer(cfg, spec, SEED)
    store = wgrad.WeightGradStore()
    wgrad.attach(model, store)
    seen: dict[str, int] = {}
    names = {p: n for n, p in model.named_parameters()}
    for p in model.parameters():
        wgrad.set_grad_sink(p, lambda p, gr: (seen.__setitem__(names[p], seen.get(names[p], 0) + 1),
                                              wgrad.accumulate_into(p, gr)))
    works = _deferred_backwards(model, store, xs, ys)
    assert all(p.grad is None for p in model.parameters())
    for work in works:
        wgrad.WeightGradStore.run(work)
    assert seen == {n: 2 for n in names.values()}, seen
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, dict(ref.named_parameters())[n].grad), n


@pytest.mark.parametrize("flavour", ["reducer", "zero1", "zero2_shard", "zero2_full"])
def test_gradient_syncs_count_deferred_terms(flavour):
    """The Reducer / ShardedReducer (one rank, scale 0.5) take zb1's deferred terms through their sinks: nothing
    launches during B, every bucket launches in the final W (before finish), and the gradients are 0.5 x the
    plain backward's. Three microbatches; prepare() before each W, as pp.py calls it."""
    from nanotitan.parallel.dp.reducer import Reducer
    from nanotitan.parallel.dp.zero import ShardedReducer

    cfg, spec, xs, ys, ref = _middle_stage_reference(n=3, seed=4)

    model = Transformer(cfg, spec, SEED)
    named = list(model.named_parameters())
    if flavour == "reducer":
        r = Reducer(named, None, bucket_mb=0.01, scale=0.5)
    else:
        zero, acc = (1, "full") if flavour == "zero1" else (2, flavour.split("_")[1])
        r = ShardedReducer(named, None, bucket_mb=0.01, scale=0.5, zero=zero, accumulate=acc)
    assert len(r.buckets) > 2
    store = wgrad.WeightGradStore()
    wgrad.attach(model, store)
    works = _deferred_backwards(model, store, xs, ys)
    for i, work in enumerate(works):
        r.prepare(sync=i == len(works) - 1)
        assert not any(b.launched for b in r.buckets) or flavour == "zero2_shard"
        wgrad.WeightGradStore.run(work)
    assert all(b.launched for b in r.buckets), "a bucket waited for finish(): a deferred term was not counted"
    r.finish()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    if flavour == "reducer":
        for n, p in named:
            assert torch.equal(p.grad, 0.5 * ref_grads[n]), n
    else:  # one rank: the shard is the whole bucket
        for b in r.buckets:
            want = torch.cat([(0.5 * ref_grads[n]).reshape(-1) for n in b.names])
            assert torch.allclose(b.shard.grad[:want.numel()], want, rtol=0, atol=1e-7), b.names


def test_pending_work_is_counted_as_saved_activations():
    """What a deferred W holds (layer inputs, output gradients) stays counted by the trainer's activation meter
    (memory.SavedActivations, through the saved-tensor hooks in force during B) until W runs."""
    from nanotitan.observe.memory import SavedActivations

    cfg = _cfg()
    model = Transformer(cfg, _middle_stage(cfg), SEED)
    store = wgrad.WeightGradStore()
    wgrad.attach(model, store)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 16, cfg.d_model, generator=g, requires_grad=True)
    y = torch.randint(0, cfg.vocab_size, (2, 16), generator=g)
    meter = SavedActivations(model)
    with meter:
        ce, aux = model(x, y)
        after_forward = meter.bytes
        with store.deferring():
            (ce + aux).backward()
        del ce, aux
        pending = meter.bytes
        wgrad.WeightGradStore.run(store.take())
    assert after_forward > 0 and pending > 0.5 * after_forward, (after_forward, pending)
    assert meter.bytes == 0, meter.bytes


def test_gemm_terms_accumulate_in_place():
    """A GemmTerm lands as GEMMs into an existing .grad of its dtype, in place (no temporary), equal to
    mm-then-add up to float reassociation; the first term, and a term of another dtype (bf16 GEMM, fp32 grad),
    are computed and then land as AccumulateGrad would."""
    g = torch.Generator().manual_seed(3)
    for K in (48, 4096):
        a, b = torch.randn(64, K, generator=g), torch.randn(K, 32, generator=g)
        p = torch.nn.Parameter(torch.zeros(64, 32))
        wgrad.accumulate_into(p, wgrad.GemmTerm([(a, b)]))
        assert torch.equal(p.grad, a.mm(b))
        before, ref = p.grad.data_ptr(), p.grad + a.mm(b)
        wgrad.accumulate_into(p, wgrad.GemmTerm([(a, b)]))
        assert p.grad.data_ptr() == before, "not accumulated in place"
        torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
    # the experts: one GEMM per expert slice
    pairs = [(torch.randn(8, 5 + l, generator=g), torch.randn(5 + l, 4, generator=g)) for l in range(3)]
    p = torch.nn.Parameter(torch.zeros(3, 8, 4))
    for _ in range(2):
        wgrad.accumulate_into(p, wgrad.GemmTerm(pairs, stacked=True))
    one = torch.stack([x.mm(y) for x, y in pairs])
    torch.testing.assert_close(p.grad, one + one, rtol=1e-6, atol=1e-6)
    # a bf16 term into an fp32 gradient: computed in bf16, widened, added
    a, b = torch.randn(16, 8, generator=g).bfloat16(), torch.randn(8, 4, generator=g).bfloat16()
    p = torch.nn.Parameter(torch.zeros(16, 4))
    p.grad = torch.ones(16, 4)
    wgrad.accumulate_into(p, wgrad.GemmTerm([(a, b)]))
    assert torch.equal(p.grad, torch.ones(16, 4) + a.mm(b).float())


def test_fused_store_matches_plain_autograd_over_microbatches():
    """fuse=True (zb1's split stages): three microbatches' deferred W's, each term added into .grad inside its
    GEMM, equal the plain backwards' accumulated gradients up to float reassociation (<= 1e-6 relative)."""
    cfg, spec, xs, ys, ref = _middle_stage_reference(n=3, seed=4)
    model = Transformer(cfg, spec, SEED)
    store = wgrad.WeightGradStore(fuse=True)
    wgrad.attach(model, store)
    for work in _deferred_backwards(model, store, xs, ys):
        wgrad.WeightGradStore.run(work)
    for n, p in model.named_parameters():
        r = dict(ref.named_parameters())[n].grad
        torch.testing.assert_close(p.grad, r, rtol=1e-6, atol=1e-6 * r.abs().max().item(), msg=n)
