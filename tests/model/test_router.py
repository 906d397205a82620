"""The router's load-management options against naive per-token / per-sequence references: sigmoid scores with a
selection-only bias and routed_scale, the micro and sequence-wise balance losses, the z-loss, capacity dropping
(priority by weight, ties to the lower token index, dropped assignments contribute nothing), the bias update
rule, counting once under activation checkpointing, the bias as a checkpointed buffer, and config errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from nanotitan.state.checkpoint import load_checkpoint, save_checkpoint
from tests.helpers.whole_state import keyed_tensors
from nanotitan.config.config import ConfigError, load_config
from nanotitan.model.moe import MoE, capacity_keep
from nanotitan.model.transformer import Transformer, take_routing
from nanotitan.resolve import resolve
from tests.helpers.tiny import tiny_args

D, FH, E = 16, 24, 4


def make_moe(seed=0, **kw) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(D, FH, E, kw.pop("top_k", 2), kw.pop("norm_topk", True), 0, E, **kw)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def naive_route(moe: MoE, x_TD):
    """Per token, as DeepSeek-V3 writes it: select on score + bias, weight by the selected scores."""
    logits = x_TD @ moe.router.weight.T
    scores = logits.softmax(-1) if moe.score == "softmax" else logits.sigmoid()
    bias = moe.router_bias if moe.router_bias is not None else torch.zeros(E)
    ids, ws = [], []
    for t in range(x_TD.shape[0]):
        chosen = sorted(range(E), key=lambda e: -(scores[t, e] + bias[e]).item())[:moe.top_k]
        w = scores[t, chosen]
        if moe.norm_topk:
            w = w / w.sum()
        ids.append(chosen)
        ws.append(w * moe.routed_scale)
    return logits, scores, torch.tensor(ids), torch.stack(ws)


def naive_moe(moe: MoE, x_TD, keep=None):
    _, _, ids, ws = naive_route(moe, x_TD)
    out = torch.zeros_like(x_TD)
    X = moe.experts
    for t in range(x_TD.shape[0]):
        for k in range(moe.top_k):
            if keep is not None and not keep[t, k]:
                continue  # dropped: the residual carries the token
            e = ids[t, k]
            h = F.silu(x_TD[t] @ X.W_gate[e]) * (x_TD[t] @ X.W_val[e])
            out[t] += ws[t, k] * (h @ X.W_out[e])
    return out


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_sigmoid_bias_and_scale_match_naive_reference(score):
    moe = make_moe(score=score, routed_scale=2.5, bias_update_rate=0.1)
    moe.router_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    x = torch.randn(2, 7, D)
    y, _ = moe(x)
    torch.testing.assert_close(y.view(-1, D), naive_moe(moe, x.view(-1, D)), rtol=1e-5, atol=1e-6)
    # The bias steers selection only: a huge bias on expert 3 puts it in every token's top-k, with its own score.
    moe.router_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0]))
    ids_TK, w_TK, _ = moe.route(x.view(-1, D), 2, 7)
    assert (ids_TK == 3).any(dim=1).all()
    _, _, ids_ref, w_ref = naive_route(moe, x.view(-1, D))
    assert torch.equal(ids_TK, ids_ref)
    torch.testing.assert_close(w_TK, w_ref)
    assert w_TK.max() < 2.5 + 1e-6  # weights come from the scores, never from score + bias
    # A buffer, not a parameter: the optimizer never sees it, the state dict (checkpoints) does.
    assert "router_bias" not in dict(moe.named_parameters()) and "router_bias" in moe.state_dict()


@pytest.mark.parametrize("scope", ["micro", "sequence"])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_balance_and_z_loss_match_naive_formulas(scope, score):
    aux_coef, z_coef = 0.7, 0.3
    moe = make_moe(score=score, aux_scope=scope, aux_coef=aux_coef, z_loss_coef=z_coef)
    B, S = 3, 5
    x = torch.randn(B, S, D)
    _, aux = moe(x)
    logits, scores, ids, _ = naive_route(moe, x.view(-1, D))
    probs = scores / scores.sum(-1, keepdim=True)  # a no-op for softmax

    def switch_loss(rows):  # E * sum_e f_e P_e over the tokens in rows
        f = torch.tensor([(ids[rows] == e).sum().item() for e in range(E)]) / (len(rows) * moe.top_k)
        return E * (f * probs[rows].mean(0)).sum()

    if scope == "micro":
        balance = switch_loss(list(range(B * S)))
    else:  # DeepSeek-V3: per sequence, then averaged
        balance = sum(switch_loss(list(range(b * S, (b + 1) * S))) for b in range(B)) / B
    z = (logits.logsumexp(-1) ** 2).mean()
    torch.testing.assert_close(aux, aux_coef * balance + z_coef * z)
    bal, zz, dropped, assigned, calls = moe.last_router_stats.tolist()
    assert math.isclose(bal, balance.item(), rel_tol=1e-5) and math.isclose(zz, z.item(), rel_tol=1e-5)
    assert (dropped, assigned, calls) == (0, B * S * moe.top_k, 1)


def test_sequence_scope_differs_from_micro_when_sequences_differ():
    """The two scopes must not be the same number by accident (else the sequence test above proves nothing)."""
    x = torch.randn(2, 6, D)
    x[1] += 3.0 * torch.randn(D)  # the second sequence routes differently
    a = make_moe(aux_scope="micro")(x)[1]
    b = make_moe(aux_scope="sequence")(x)[1]
    assert abs(a.item() - b.item()) > 1e-4


def test_no_objective_without_coefficients():
    _, aux = make_moe(aux_coef=0.0)(torch.randn(1, 4, D))
    assert not aux.requires_grad and aux.item() == 0.0


def naive_keep(ids, ws, capacity):
    keep = torch.zeros_like(ids, dtype=torch.bool)
    T, K = ids.shape
    for e in range(E):
        queue = [(-ws[t, k].item(), t, k) for t in range(T) for k in range(K) if ids[t, k] == e]
        for _, t, k in sorted(queue)[:capacity]:  # highest weight first, then the lower token index
            keep[t, k] = True
    return keep


def test_capacity_keep_priority_and_ties():
    g = torch.Generator().manual_seed(0)
    T, K = 40, 2
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[:20, 0] = 1  # expert 1 overloaded
    ids[:20, 1] = torch.where(ids[:20, 1] == 1, 2, ids[:20, 1])
    ws = torch.randint(0, 4, (T, K), generator=g).float() / 4  # many exact ties
    for capacity in (1, 5, 13, 100):
        keep = capacity_keep(ids, ws, E, capacity)
        assert torch.equal(keep, naive_keep(ids, ws, capacity)), capacity
        assert all(keep[ids == e].sum() <= capacity for e in range(E))


def test_capacity_drops_contribute_nothing_and_gradients_flow():
    cf = 0.5
    moe = make_moe(capacity_factor=cf, routed_scale=1.5, score="sigmoid")
    x = torch.randn(2, 9, D, requires_grad=True)
    y, aux = moe(x)
    T, K = 18, 2
    _, _, ids, ws = naive_route(moe, x.detach().view(-1, D))
    keep = naive_keep(ids, ws, math.ceil(cf * T * K / E))
    assert (~keep).any()
    torch.testing.assert_close(y.view(-1, D), naive_moe(moe, x.detach().view(-1, D), keep), rtol=1e-5, atol=1e-6)
    assert moe.last_router_stats[2].item() == (~keep).sum().item()
    assert moe.last_counts_E.sum().item() == T * K  # the load is what the router chose, drops included
    (y.square().sum() + aux).backward()
    assert moe.router.weight.grad.abs().sum() > 0


def test_update_bias_sign_rule():
    moe = make_moe(bias_update_rate=0.01)
    moe.update_bias(torch.tensor([10, 2, 4, 0]))  # mean 4: expert 2 sits exactly on it
    torch.testing.assert_close(moe.router_bias, torch.tensor([-0.01, 0.01, 0.0, 0.01]))


TINY = tiny_args("seq_len", ffn_dim=24, n_layers=2, bias_update_rate=0.01, capacity_factor=1.0)


def test_activation_checkpointing_counts_once_and_bias_is_checkpointed():
    cfg = resolve(load_config(None, TINY))
    x = torch.randint(0, 300, (2, 16))
    records = []
    for ac in (False, True):
        model = Transformer(cfg.model, seed=3)
        model.activation_checkpointing = ac
        ce, aux = model(x, x)
        (ce + aux).backward()  # the recompute runs the MoE a second time
        records.append(take_routing(model))  # the step's record: one row per MoE layer, one column per forward
    plain, checkpointed = records
    assert plain.keys == ["0", "1"] and plain.counts.shape == (2, 1, 4) and (plain.counts.sum(-1) == 2 * 16 * 2).all()
    assert torch.equal(plain.counts, checkpointed.counts)
    assert torch.equal(plain.stats, checkpointed.stats)  # calls == 1, not 2
    model.eval()
    model(x)  # eval forwards leave no record
    assert take_routing(model).keys == [] and model.routing == {}
    keys = keyed_tensors(model, None)
    assert "model.layers.0.moe.router_bias" in keys and "model.layers.1.moe.router_bias" in keys


def test_bias_survives_a_checkpoint(tmp_path):
    cfg = resolve(load_config(None, TINY + ["--run.dir", str(tmp_path)]))
    model = Transformer(cfg.model, seed=3)
    for moe in model.moe_layers():
        moe.update_bias(torch.randint(0, 50, (4,)))
        moe.update_bias(torch.randint(0, 50, (4,)))
    path = save_checkpoint(tmp_path, 1, model, None, None, cfg)
    fresh = Transformer(cfg.model, seed=3)
    load_checkpoint(path, fresh, None, None)
    for a, b in zip(model.moe_layers(), fresh.moe_layers()):
        assert a.router_bias.abs().sum() > 0 and torch.equal(a.router_bias, b.router_bias)


@pytest.mark.parametrize("args,msg", [
    (["--model.router_score", "relu"], "model.router_score='relu' is not one of ['softmax', 'sigmoid'] (--model.router_score)"),
    (["--model.aux_scope", "batch"], "model.aux_scope='batch' is not one of ['micro', 'sequence'] (--model.aux_scope)"),
    (["--model.routed_scale", "0"], "model.routed_scale=0.0 must be > 0 (--model.routed_scale)"),
    (["--model.bias_update_rate", "-1e-3"], "model.bias_update_rate=-0.001 must be >= 0 (--model.bias_update_rate)"),
    (["--model.z_loss_coef", "-1"], "model.z_loss_coef=-1.0 must be >= 0 (--model.z_loss_coef)"),
    (["--model.capacity_factor", "-0.5"], "model.capacity_factor=-0.5 must be >= 0 (--model.capacity_factor)"),
])
def test_bad_router_options_one_line(args, msg):
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert str(e.value) == msg
