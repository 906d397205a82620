"""What every optimizer of the trainer declares (optim/adamw.py), so that no caller asks its type: its kind, each
group's lr ratio, its lazy state as its first step makes it, and what a layout change does; and the family tags
the gradient syncs group by (model/families.py), whose meaning (which optimizer, which decay) is optim/'s."""

import pytest
import torch

from nanotitan.model.families import HIDDEN, MATRIX, VECTOR, is_muon_matrix, keep_tag, tag_of, tag_params
from nanotitan.model.transformer import Transformer
from nanotitan.optim.adamw import AdamW, decay_groups
from nanotitan.optim.muon import TAKES, Muon, whole_pieces
from nanotitan.parallel.dp.sync import tag_groups
from tests.helpers.tiny import tiny_model


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(8, 12), (12,), (6, 8)]]


def _like(state: dict) -> dict:
    return {k: (tuple(v.shape), v.dtype, v.device.type) if torch.is_tensor(v) else v for k, v in state.items()}


@pytest.mark.parametrize("kwargs", [dict(fused=True), dict(), dict(amsgrad=True)])
def test_adamw_state_of_is_the_state_its_first_step_makes(kwargs):
    """Before any step, `state_of` creates what torch's first step would (keys, shapes, dtypes, devices: the fused
    step a tensor on the param's device, amsgrad's max_exp_avg_sq), and the step then runs on it as on its own."""
    fresh, stepped = _params(), _params()
    a = AdamW([{"params": fresh, "weight_decay": 0.1}], lr=1e-2, **kwargs)
    b = AdamW([{"params": stepped, "weight_decay": 0.1}], lr=1e-2, **kwargs)
    a.ensure_state()
    for p, q in zip(fresh, stepped):
        p.grad = q.grad = torch.ones_like(p)
    b.step()
    for p, q in zip(fresh, stepped):
        assert _like(a.state_of(p)) == _like(b.state[q])
        assert not any(v.any() for v in a.state[p].values() if torch.is_tensor(v))  # zero moments, step 0
    a.step()
    for p, q in zip(fresh, stepped):
        assert torch.equal(p, q)


def test_declarations_kind_lr_ratio_and_layout_change():
    """AdamW: kind adamw, every group at lr ratio 1 (a group added later too), nothing on a layout change. Muon:
    kind muon, its groups at muon_lr / lr and AdamW's at adamw_lr / lr, a Muon param's state its momentum alone
    (as torch.optim.Muon's), and a layout change drops the owner plan so that its next step makes a new one."""
    ps = _params()
    adamw = AdamW([{"params": ps[:1]}], lr=1e-3)
    adamw.add_param_group({"params": ps[1:]})
    assert adamw.kind == "adamw" and [g["lr_ratio"] for g in adamw.param_groups] == [1.0, 1.0]
    adamw.on_layout_change()

    hidden, rest = [ps[0], ps[2]], [ps[1]]
    groups = tag_groups([(VECTOR, rest[0]), (HIDDEN, hidden[0]), (HIDDEN, hidden[1])])
    muon = Muon(decay_groups(groups, 0.1), lr=1e-3, betas=(0.9, 0.95), muon_lr=2e-2, adamw_lr=5e-4,
                pieces=whole_pieces([(str(i), p) for i, p in enumerate(hidden)]))
    assert muon.kind == "muon"
    assert sorted((g["tag"], g["lr_ratio"], g["weight_decay"]) for g in muon.param_groups) == \
        [(HIDDEN, 20.0, 0.1), (VECTOR, 0.5, 0.0)]
    assert set(muon.state_of(hidden[0])) == {"momentum_buffer"}
    assert set(muon.state_of(rest[0])) == {"step", "exp_avg", "exp_avg_sq"}
    muon.prepare()  # what the first step makes: the state and the owner plan
    plan = muon.orthogonalizer
    assert plan is not None
    for p in ps:
        p.grad = torch.ones_like(p)
    muon.step()
    assert muon.orthogonalizer is plan  # made once
    muon.on_layout_change()
    assert muon.orthogonalizer is None
    muon.step()
    assert muon.orthogonalizer is not None and muon.orthogonalizer is not plan


def test_family_tags_are_muon_s_split_only_under_muon():
    """Under adamw every matrix is MATRIX (so ZeRO's buckets stay the two families they always were); under muon
    the matrices Muon takes are HIDDEN and only they; a parameter that replaces another keeps its tag; an untagged
    one is a MATRIX or a VECTOR by its rank. Every tag but VECTOR decays; Muon takes HIDDEN alone."""
    cfg = tiny_model(n_layers=2, vocab_size=64)
    for optimizer in ("adamw", "muon"):
        model = Transformer(cfg)
        tag_params(model, optimizer)
        for name, p in model.named_parameters():
            want = HIDDEN if optimizer == "muon" and is_muon_matrix(name, p) else MATRIX if p.dim() >= 2 else VECTOR
            assert tag_of(p) == want, (optimizer, name)
        if optimizer == "muon":
            assert {tag_of(p) for p in model.parameters()} == {HIDDEN, MATRIX, VECTOR}
    new = torch.nn.Parameter(torch.zeros(3))
    keep_tag(next(p for p in model.parameters() if tag_of(p) == HIDDEN), new)
    assert tag_of(new) == HIDDEN and tag_of(torch.zeros(2, 2)) == MATRIX and tag_of(torch.zeros(2)) == VECTOR
    groups = decay_groups(tag_groups((tag_of(p), p) for p in model.parameters()), 0.1)
    assert {g["tag"]: g["weight_decay"] for g in groups} == {HIDDEN: 0.1, MATRIX: 0.1, VECTOR: 0.0}
    assert TAKES == (HIDDEN,)
