"""The local token shard (model/tokens.py: `LOCAL`) is one device: its identities hand back their tensor itself (no op
on the hot path), and what the model computes through it is the plain ops' result to the bit: the loss is
F.cross_entropy over the fp32 logits, the balance loss and the z-loss are the plain means (both scopes)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanotitan.model.moe import MoE, expert_counts
from nanotitan.model.tokens import LOCAL
from nanotitan.model.transformer import Transformer
from tests.helpers.tiny import tiny_model


def test_local_shard_is_one_device():
    t = torch.randn(2, 6, 4)
    assert LOCAL.sum(t) is t and LOCAL.split_sum(t) is t and LOCAL.vocab_sum(t) is t
    assert LOCAL.gather(t, 1) is t and LOCAL.seq_gather(t, 1) is t
    w, ids = torch.rand(2, 6, 2), torch.randint(0, 4, (2, 6, 2))
    w_all, ids_all = LOCAL.gather_routing(w, ids, 8, 4)
    assert w_all is w and ids_all is ids
    assert LOCAL.runs(6) == LOCAL.seq_runs(6) == [(0, 6)] and LOCAL.stream_len(6) == 6
    assert (LOCAL.rank, LOCAL.size, LOCAL.split_rank, LOCAL.split_size) == (0, 1, 0, 1)
    assert not LOCAL.splits(4)  # a full q/k norm is a plain RMSNorm
    assert type(LOCAL.embedding(10, 4)) is nn.Embedding
    assert torch.equal(LOCAL.mean(t, 1, 6), t.mean(1))


def test_one_device_loss_is_plain_cross_entropy():
    torch.manual_seed(0)
    model = Transformer(tiny_model(n_layers=2, vocab_size=300), seed=0)
    assert model.tokens is LOCAL and type(model.tok_emb) is nn.Embedding
    idx, tgt = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    loss, _ = model(idx, tgt)
    logits, _ = model(idx)
    assert torch.equal(loss, F.cross_entropy(logits.float().view(-1, logits.shape[-1]), tgt.reshape(-1)))


@pytest.mark.parametrize("scope", ["micro", "sequence"])
def test_one_device_router_losses_are_plain_means(scope):
    torch.manual_seed(0)
    E, K, B, S = 4, 2, 3, 5
    moe = MoE(16, 24, E, K, True, 0, E, aux_scope=scope, z_loss_coef=0.1)
    x_TD = torch.randn(B * S, 16)
    ids_TK, _, _ = moe.route(x_TD, B, S)
    balance, z = moe.last_router_stats[:2]
    logits_TE = x_TD @ moe.router.weight.T
    probs_TE = logits_TE.softmax(-1)
    if scope == "micro":  # the formulas one process ran before the shard was always present
        want = E * (expert_counts(ids_TK, E).float() / (B * S * K) * probs_TE.mean(dim=0)).sum()
    else:
        f_BE = probs_TE.new_zeros(B, E).scatter_add_(1, ids_TK.view(B, S * K), probs_TE.new_ones(B, S * K)) / (S * K)
        want = E * (f_BE * probs_TE.view(B, S, E).mean(dim=1)).sum(dim=1).mean()
    assert torch.equal(balance, want)
    assert torch.equal(z, logits_TE.logsumexp(dim=-1).square().mean())
