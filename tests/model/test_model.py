"""The model: shards built alone equal slices of the full model; routing/packing match a naive reference."""

import itertools

import pytest
import torch

from nanotitan.config.config import load_config
from nanotitan.model.moe import MoE, pack_expert_major
from nanotitan.model.spec import layer_bounds
from tests.helpers.specs import build_shard_spec
from nanotitan.model.transformer import Transformer, flops_per_token, is_expert_param
from nanotitan.resolve import resolve
from tests.helpers.tiny import tiny_args

TINY = tiny_args("seq_len")


@pytest.mark.parametrize("pos", ["rope", "learned"])
@pytest.mark.parametrize("pp,ep", [(1, 2), (2, 1), (2, 2), (4, 4), (3, 1)])
def test_shard_equals_slice_of_full(pp, ep, pos):
    cfg = resolve(load_config(None, TINY + ["--parallel.pp", str(pp), "--parallel.ep", str(ep),
                                            "--model.pos_emb", pos]))
    full = dict(Transformer(cfg.model, seed=7).named_parameters())
    seen = set()
    for p_rank, e_rank in itertools.product(range(pp), range(ep)):
        spec = build_shard_spec(cfg, p_rank, e_rank)
        shard = Transformer(cfg.model, spec, seed=7)
        for name, t in shard.named_parameters():
            ref = full[name]
            if is_expert_param(name):
                ref = ref[spec.expert_start:spec.expert_end]
                seen.add((name, spec.expert_start))
            else:
                seen.add((name, None))
            assert torch.equal(t, ref), name
    # together the shards own every parameter of the full model
    assert {n for n, _ in seen} == set(full)


def test_layer_bounds_uneven_and_explicit():
    assert [layer_bounds(5, 2, r) for r in range(2)] == [(0, 3), (3, 5)]
    assert [layer_bounds(4, 3, r) for r in range(3)] == [(0, 2), (2, 3), (3, 4)]
    assert [layer_bounds(4, 2, r, [3, 1]) for r in range(2)] == [(0, 3), (3, 4)]


def test_stage_chain_equals_full_forward():
    cfg = resolve(load_config(None, TINY + ["--parallel.pp", "2"]))
    full = Transformer(cfg.model, seed=3)
    s0 = Transformer(cfg.model, build_shard_spec(cfg, 0, 0), seed=3)
    s1 = Transformer(cfg.model, build_shard_spec(cfg, 1, 0), seed=3)
    x = torch.randint(0, 300, (2, 16))
    y = torch.randint(0, 300, (2, 16))
    ce_full, aux_full = full(x, y)
    h, aux0 = s0(x)
    ce, aux1 = s1(h, y)
    torch.testing.assert_close(ce, ce_full, rtol=0, atol=0)
    torch.testing.assert_close(aux0 + aux1, aux_full)


def naive_moe(moe: MoE, x_TD):
    """Per-token, per-choice reference: out[t] = sum_k w[t,k] * expert_{id[t,k]}(x[t])."""
    probs = torch.softmax(x_TD @ moe.router.weight.T, -1)
    w, ids = probs.topk(moe.top_k, -1)
    if moe.norm_topk:
        w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x_TD)
    E = moe.experts
    for t in range(x_TD.shape[0]):
        for k in range(moe.top_k):
            e = ids[t, k]
            h = torch.nn.functional.silu(x_TD[t] @ E.W_gate[e]) * (x_TD[t] @ E.W_val[e])
            out[t] += w[t, k] * (h @ E.W_out[e])
    return out


@pytest.mark.parametrize("num_experts,top_k", [(4, 1), (4, 2), (4, 4), (8, 3)])
@pytest.mark.parametrize("skew", [False, True])
def test_moe_matches_naive_reference(num_experts, top_k, skew):
    torch.manual_seed(0)
    moe = MoE(16, 24, num_experts, top_k, True, 0, num_experts)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 10, 16)
    if skew:  # one expert takes most tokens, expert 1 gets none
        x[..., 0] += 5.0
        with torch.no_grad():
            moe.router.weight[0, 0] = 3.0
            moe.router.weight[1, 0] = -30.0
    x.requires_grad_(True)
    y, aux = moe(x)
    if skew and top_k < num_experts:
        assert moe.last_counts_E[1] == 0
    ref = naive_moe(moe, x.detach().view(-1, 16))
    torch.testing.assert_close(y.view(-1, 16), ref, rtol=1e-5, atol=1e-6)
    (y.square().sum() + aux).backward()  # experts with zero tokens still get a (zero) gradient
    idle = (moe.last_counts_E == 0).nonzero().flatten().tolist()
    # busy experts learn (expert 1 under skew may be picked with a weight that underflows to 0)
    busy = [e for e in (moe.last_counts_E > 0).nonzero().flatten().tolist() if not (skew and e == 1)]
    if skew and top_k < num_experts:
        assert 1 in idle
    for W in (moe.experts.W_gate, moe.experts.W_val, moe.experts.W_out):
        assert W.grad is not None
        for e in idle:  # an expert that saw no token has an exactly zero gradient row
            assert torch.count_nonzero(W.grad[e]) == 0, e
        for e in busy:
            assert torch.count_nonzero(W.grad[e]) > 0, e


def test_pack_expert_major_matches_loop():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [3, 2]])
    order, token_idx, counts = pack_expert_major(ids, 5)
    assert counts.tolist() == [2, 1, 4, 1, 0]
    flat = ids.reshape(-1)
    ref = [i for e in range(5) for i in range(flat.numel()) if flat[i] == e]  # loop version of the seed
    assert order.tolist() == ref
    assert token_idx.tolist() == [i // 2 for i in ref]


def test_flops_per_token_matches_baselines_mid():
    cfg = resolve(load_config(None, ["--model.d_model", "256", "--model.n_layers", "4", "--model.ffn_dim", "512",
                                     "--model.num_experts", "8", "--data.vocab_size", "4096"]))
    assert abs(flops_per_token(cfg.model, 128) / 1e6 - 33.1) < 0.2  # BASELINES: ~33 MFLOP per token
    assert abs(sum(p.numel() for p in Transformer(cfg.model).parameters()) / 1e6 - 15.8) < 0.1
