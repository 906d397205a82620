"""Muon's single-device maths against torch.optim.Muon, its parameter split, and the owners' plan."""

import pytest
import torch

from nanotitan.model.transformer import Transformer
from nanotitan.model.families import HIDDEN, VECTOR, is_muon_matrix
from nanotitan.optim.muon import Muon, whole_pieces
from nanotitan.optim.newton_schulz import orthogonalize
from nanotitan.optim.owners import Box, make_plan
from tests.helpers.tiny import tiny_model


def _groups(ps, weight_decay=0.0):
    """Tagged groups as optim/build.py hands them to Muon: an empty AdamW one, and `ps` in Muon's (HIDDEN)."""
    return [{"params": [], "weight_decay": 0.0, "tag": VECTOR},
            {"params": ps, "weight_decay": weight_decay, "tag": HIDDEN}]


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 24), (40, 12), (8, 8)]  # wide, tall, square
    ws = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]
    return ws, grads


def test_muon_matches_torch_muon():
    """With bf16 Newton-Schulz (torch's) and Moonlight's RMS match, our Muon steps what torch.optim.Muon steps."""
    ws, grads = _problem()
    ours = [torch.nn.Parameter(w.clone()) for w in ws]
    theirs = [torch.nn.Parameter(w.clone()) for w in ws]
    opt = Muon(_groups(ours, 0.1), lr=1e-3, betas=(0.9, 0.95), muon_lr=0.02,
               pieces=whole_pieces([(str(i), p) for i, p in enumerate(ours)]), ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                           adjust_lr_fn="match_rms_adamw")
    for step in grads:
        for p, q, gr in zip(ours, theirs, step):
            p.grad, q.grad = gr.clone(), gr.clone()
        opt.step()
        ref.step()
    for p, q, w in zip(ours, theirs, ws):
        moved = (q - w).abs().max()
        assert moved > 1e-2  # the test can fail: the updates are not negligible
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=2e-3 * moved.item())
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])


def test_newton_schulz_batched_is_per_matrix_and_near_orthogonal():
    """A [k, m, n] batch orthogonalizes each matrix as alone; singular values land in NS5's ~[0.5, 1.5] band."""
    G = torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(1))
    out = orthogonalize(G)
    for i in range(3):
        torch.testing.assert_close(out[i], orthogonalize(G[i]), rtol=1e-5, atol=1e-6)
    s = torch.linalg.svdvals(out)
    assert s.min() > 0.3 and s.max() < 1.6, (s.min(), s.max())
    tall = orthogonalize(G.mT)
    torch.testing.assert_close(tall, out.mT, rtol=1e-5, atol=1e-6)


def test_parameter_split_deepseek_shaped():
    """Muon takes attention/MLA projections, dense and shared-expert FFNs, MTP's eh_proj and the expert stacks;
    AdamW the embeddings, head, norms and routers."""
    cfg = tiny_model(n_layers=3, first_k_dense=1, shared_experts=1, kv_lora_rank=16, q_lora_rank=12,
                     qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, mtp_layers=1, vocab_size=64,
                     router_score="sigmoid", bias_update_rate=1e-3)
    named = dict(Transformer(cfg).named_parameters())
    muon = {n for n, p in named.items() if is_muon_matrix(n, p)}
    for n in ["layers.1.attn.q_a_proj.weight", "layers.1.attn.kv_b_proj.weight", "layers.1.attn.o_proj.weight",
              "layers.1.moe.experts.W_gate", "layers.1.moe.shared_expert.down_proj.weight", "mtp.3.eh_proj.weight"]:
        assert n in muon, n
    for n in ["tok_emb.weight", "head.weight", "layers.1.moe.router.weight", "layers.1.attn_norm.weight",
              "norm.weight"]:
        assert n in named and n not in muon, n
    assert any(".mlp." in n or "ffn" in n for n in muon if n.startswith("layers.0")), sorted(muon)


def _box(key, off, sz):
    return Box(key, off, sz, 0, 0, (sz[1], 1))


def test_plan_owners_balanced_and_whole_matrices_stay_local():
    """Split matrices go to their least-loaded holder, largest first; a matrix whole on a rank moves nowhere."""
    shapes = {"a": (8, 8), "b": (8, 8), "c": (4, 8), "w": (8, 4)}
    halves = {k: [((0, 0), (s[0] // 2, s[1]))] for k, s in shapes.items() if k != "w"}
    others = {k: [((s[0] // 2, 0), (s[0] // 2, s[1]))] for k, s in shapes.items() if k != "w"}
    geometry = [{**halves, "w": [((0, 0), (8, 4))]}, {**others, "w": [((0, 0), (8, 4))]}]
    plans = [make_plan(shapes, geometry, r, [_box(k, o, s) for k, bs in geometry[r].items() for o, s in bs], 5)
             for r in range(2)]
    owners = {k: [r for r in range(2) if k in plans[r].computes] for k in shapes}
    assert owners["w"] == [0, 1]  # whole on both: each computes it, nothing travels for it
    assert sorted(owners["a"] + owners["b"]) == [0, 1]  # the two big ones on different ranks
    assert all(len(owners[k]) == 1 for k in "abc")
    assert plans[0].flops == plans[1].flops  # same view of the load on every rank
    o = owners["a"][0]
    assert [k for k, _, _ in plans[o].gather_recv[1 - o]].count("a") == 1
    assert [b.key for b in plans[1 - o].scatter_recv[o]].count("a") == 1
    assert not any(b.key == "w" for p in plans for bs in p.gather_send + p.scatter_recv for b in bs)


def test_costs_follow_the_layout():
    """The planner's Muon figures (optim/cost.py): ZeRO-1 over 4 data ranks splits the Newton-Schulz work 4 ways and
    moves the non-owned pieces; zero 0 moves nothing; Muon's state is half of AdamW's for the same matrices."""
    from nanotitan.config.config import load_config
    from nanotitan.optim.cost import muon_costs
    from nanotitan.optim.newton_schulz import ns_flops

    def costs(*flags):
        cfg = load_config(None, ["--model.vocab_size", "512", "--data.vocab_size", "512", "--model.d_model", "64",
                                 "--model.ffn_dim", "96", "--model.num_experts", "4", "--model.n_layers", "2", *flags])
        return muon_costs(cfg)

    one, dp4 = costs(), costs("--parallel.dp", "4", "--parallel.zero", "1")
    assert one["traffic_bytes_rank"] == 0 and dp4["traffic_bytes_rank"] > 0
    assert dp4["ns_flops_rank"] == pytest.approx(one["ns_flops_rank"] / 4)
    assert one["muon_state_bytes"] * 2 == one["adamw_state_bytes_same_params"]
    # 2 layers x (4 attention matrices + 4 experts x 3 matrices)
    assert one["matrices"] == 2 * (4 + 4 * 3)
    assert one["largest_matrix_flops"] == ns_flops(64, 96)


def test_tall_and_wide_share_a_batch_and_bad_ns_dtype_is_refused():
    """A tall matrix joins its transpose's Newton-Schulz batch (one bmm chain) and gets what it gets alone; an
    ns_dtype other than bf16/fp32 is refused in one line."""
    g = torch.Generator().manual_seed(3)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(16, 24), (24, 16), (16, 24)]]
    grads = [torch.randn(p.shape, generator=g) for p in ps]
    opt = Muon(_groups(ps), lr=1e-3, betas=(0.9, 0.95), muon_lr=0.02,
               pieces=whole_pieces([(str(i), p) for i, p in enumerate(ps)]), ns_dtype=torch.float32)
    before = [p.detach().clone() for p in ps]
    for p, gr in zip(ps, grads):
        p.grad = gr.clone()
    opt.step()
    assert list(opt.orthogonalizer.batches) == [(16, 24)]
    for p, w, gr in zip(ps, before, grads):  # first step: buf = 0.05 g, u = 0.05 g + 0.95 buf
        u = orthogonalize(gr * (0.05 + 0.95 * 0.05)) * 0.2 * 24 ** 0.5
        torch.testing.assert_close(p.detach(), w - 0.02 * u, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="ns_dtype=torch.float16: use torch.float32"):
        Muon(_groups(ps), lr=1e-3, betas=(0.9, 0.95), muon_lr=0.02, ns_dtype=torch.float16)


def test_muon_ns_dtype_config_refused_in_one_line():
    """train.muon_ns_dtype takes fp32 (the default) or bf16; anything else is one line naming the field."""
    from nanotitan.config.config import load_config
    from nanotitan.config.errors import ConfigError

    assert load_config(None, []).train.muon_ns_dtype == "fp32"
    assert load_config(None, ["--train.muon_ns_dtype", "bf16"]).train.muon_ns_dtype == "bf16"
    with pytest.raises(ConfigError, match=r"^train.muon_ns_dtype='fp16' is not one of \['fp32', 'bf16'\]"):
        load_config(None, ["--train.muon_ns_dtype", "fp16"])


def test_a_geometry_that_disagrees_with_the_rank_s_own_pieces_fails_in_one_line():
    """The Orthogonalizer takes the computed geometry (optim/geometry.py) only if its row for this rank is what the
    rank holds: the plan of a right one is the gathered one's; a wrong box fails at once, naming the matrix."""
    from nanotitan.optim.owners import Orthogonalizer

    buf = torch.zeros(4, 6)
    pieces = {"w": ((4, 6), [((0, 0), buf)])}
    right = Orthogonalizer(pieces, [buf], None, 5, geometry=({"w": (4, 6)}, [{"w": [((0, 0), (4, 6))]}]))
    assert right.plan == Orthogonalizer(pieces, [buf], None, 5).plan and right.plan.computes == ["w"]
    with pytest.raises(AssertionError, match="disagrees with this rank's pieces of w: rule .*2, 6"):
        Orthogonalizer(pieces, [buf], None, 5, geometry=({"w": (4, 6)}, [{"w": [((0, 0), (2, 6))]}]))
