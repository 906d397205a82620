"""Model options of the published MoE families (GQA, head_dim, q/k norms, q/k/v biases, shared experts, dense
layers by index): each equals a naive per-head / per-token reference, shards stay slices of the full model,
and the layer rule, the parameter count and flops_per_token agree with the modules actually built."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from nanotitan.config.config import ConfigError, load_config
from nanotitan.model.moe import MoE
from tests.helpers.specs import build_shard_spec
from nanotitan.model.transformer import (Attention, Transformer, flops_per_token, is_expert_param, is_moe_layer,
                                         num_moe_layers)
from nanotitan.resolve import resolve
from tests.helpers.tiny import tiny_args

TINY = tiny_args("seq_len", ffn_dim=24)
# Every option at once, the way Qwen2-MoE (biases, gated shared expert, dense layers) and Qwen3-MoE
# (per-head norms, wide heads) combine them, plus DeepSeek's first_k_dense.
ALL_OPTIONS = ["--model.n_kv_heads", "2", "--model.head_dim", "12", "--model.qk_norm", "head",
               "--model.attn_bias", "true", "--model.shared_experts", "2", "--model.shared_ffn_dim", "20",
               "--model.shared_expert_gate", "true", "--model.first_k_dense", "1", "--model.dense_layers", "3",
               "--model.dense_ffn_dim", "40"]


def _randomise(module, seed=0):
    """Norm weights, biases and gates away from their init values, so a mis-wired one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def naive_attention(attn: Attention, x, cos, sin, eps):
    """Head by head: query head h attends with key/value head h // (H / Hkv); norms, biases and RoPE by hand."""
    B, S, _ = x.shape
    H, Hkv, Dh = attn.n_heads, attn.n_kv_heads, attn.head_dim

    def proj(lin):
        return x @ lin.weight.T + (lin.bias if lin.bias is not None else 0.0)

    q, k, v = proj(attn.q_proj), proj(attn.k_proj), proj(attn.v_proj)
    if attn.qk_norm == "full":
        q, k = _rms(q, attn.q_norm.weight, eps), _rms(k, attn.k_norm.weight, eps)

    def rot(t):  # rotate_half RoPE, positions 0..S-1
        t1, t2 = t[..., :Dh // 2], t[..., Dh // 2:]
        return t * cos[:S] + torch.cat([-t2, t1], -1) * sin[:S]

    mask = torch.full((S, S), float("-inf")).triu(1)
    heads = []
    for h in range(H):
        g = h // (H // Hkv)
        qh, kh, vh = q[..., h * Dh:(h + 1) * Dh], k[..., g * Dh:(g + 1) * Dh], v[..., g * Dh:(g + 1) * Dh]
        if attn.qk_norm == "head":
            qh, kh = _rms(qh, attn.q_norm.weight, eps), _rms(kh, attn.k_norm.weight, eps)
        scores = rot(qh) @ rot(kh).transpose(-1, -2) / math.sqrt(Dh) + mask
        heads.append(scores.softmax(-1) @ vh)
    return torch.cat(heads, -1) @ attn.o_proj.weight.T


@pytest.mark.parametrize("n_kv_heads,head_dim,qk_norm,bias", [
    (0, 0, "none", False), (2, 0, "none", False), (1, 0, "full", False), (2, 12, "head", True), (4, 6, "full", True)])
def test_attention_matches_naive_reference(n_kv_heads, head_dim, qk_norm, bias):
    cfg = resolve(load_config(None, TINY + ["--model.n_kv_heads", str(n_kv_heads), "--model.head_dim", str(head_dim),
                                            "--model.qk_norm", qk_norm, "--model.attn_bias", str(bias).lower()]))
    model = Transformer(cfg.model, seed=1)
    attn = model.layers["0"].attn
    _randomise(attn)
    x = torch.randn(2, 16, 32)
    y = attn(x, (model.rope_cos, model.rope_sin))
    ref = naive_attention(attn, x, model.rope_cos, model.rope_sin, cfg.model.norm_eps)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert (attn.q_proj.bias is not None) == bias and attn.o_proj.bias is None
    assert attn.k_proj.weight.shape == ((n_kv_heads or 4) * (head_dim or 8), 32)


@pytest.mark.parametrize("gate", [False, True])
def test_shared_experts_add_a_gated_swiglu_to_the_routed_experts(gate):
    """MoE output = routed experts (unchanged) + [sigmoid(x @ w)] * SwiGLU_shared(x), per token."""
    torch.manual_seed(0)
    moe = MoE(16, 24, 4, 2, True, 0, 4, shared_ffn_dim=20, shared_gate=gate)
    _randomise(moe)
    x = torch.randn(2, 5, 16)
    y, _ = moe(x)
    moe_routed = MoE(16, 24, 4, 2, True, 0, 4)
    moe_routed.load_state_dict({k: v for k, v in moe.state_dict().items() if "shared" not in k})
    routed, _ = moe_routed(x)
    s = moe.shared_expert
    for t in range(x.shape[1]):
        xt = x[0, t]
        shared = (F.silu(xt @ s.gate_proj.weight.T) * (xt @ s.up_proj.weight.T)) @ s.down_proj.weight.T
        if gate:
            shared = torch.sigmoid(xt @ moe.shared_expert_gate.weight[0]) * shared
        torch.testing.assert_close(y[0, t], routed[0, t] + shared, rtol=1e-5, atol=1e-6)
    # replicated, never sharded over EP: no shared-expert name may look like an expert tensor
    names = [n for n, _ in moe.named_parameters() if "shared" in n]
    assert len(names) == 3 + gate and not any(is_expert_param("layers.0.moe." + n) for n in names)


def test_dense_layers_by_index_one_rule_everywhere():
    cfg = resolve(load_config(None, TINY + ["--model.n_layers", "6", "--model.moe_every", "2",
                                            "--model.first_k_dense", "1", "--model.dense_layers", "4",
                                            "--model.dense_ffn_dim", "40"]))
    m = cfg.model
    want = [False, False, True, False, False, False]  # 0: first_k_dense, odd: moe_every, 4: dense_layers
    assert [is_moe_layer(m, i) for i in range(6)] == want
    model = Transformer(m)
    assert [b.is_moe for b in model.layers.values()] == want
    assert num_moe_layers(m) == 1 and len(model.moe_layers()) == 1
    assert model.layers["1"].mlp.up_proj.weight.shape == (40, 32)  # dense_ffn_dim


def _active_matmul_params(model: Transformer) -> float:
    """From the modules actually built: every matrix except the token table, routed experts at top_k/E."""
    cfg, n = model.cfg, 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.startswith("tok_emb"):
            continue
        n += p.numel() * (cfg.top_k / cfg.num_experts if is_expert_param(name) else 1.0)
    return n


@pytest.mark.parametrize("opts", [[], ALL_OPTIONS])
def test_flops_per_token_counts_the_modules_built(opts):
    cfg = resolve(load_config(None, TINY + opts))
    model = Transformer(cfg.model)
    attn = model.layers["0"].attn
    S = 16
    scores = 12 * cfg.model.n_layers * S * attn.n_heads * attn.head_dim
    assert flops_per_token(cfg.model, S) == pytest.approx(6 * _active_matmul_params(model) + scores, rel=1e-12)


@pytest.mark.parametrize("pp,ep", [(2, 2), (4, 1)])
def test_shards_are_slices_of_the_full_model_with_every_option(pp, ep):
    cfg = resolve(load_config(None, TINY + ALL_OPTIONS + ["--parallel.pp", str(pp), "--parallel.ep", str(ep)]))
    full = Transformer(cfg.model, seed=5)
    full_params = dict(full.named_parameters())
    assert full.layers["1"].moe.shared_expert.up_proj.weight.shape == (40, 32)  # 2 shared experts of 20
    assert full.layers["1"].attn.q_proj.bias.abs().sum() == 0  # biases start at zero
    seen = set()
    for p_rank, e_rank in itertools.product(range(pp), range(ep)):
        spec = build_shard_spec(cfg, p_rank, e_rank)
        for name, t in Transformer(cfg.model, spec, seed=5).named_parameters():
            ref = full_params[name][spec.expert_start:spec.expert_end] if is_expert_param(name) else full_params[name]
            assert torch.equal(t, ref), name
            seen.add(name)
    assert seen == set(full_params)


def test_stage_chain_equals_full_forward_with_every_option():
    cfg = resolve(load_config(None, TINY + ALL_OPTIONS + ["--parallel.pp", "2"]))
    full = Transformer(cfg.model, seed=5)
    _randomise(full)
    state = full.state_dict()
    x, y = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    want, aux_want = full(x, y)
    stages = [Transformer(cfg.model, build_shard_spec(cfg, s, 0), seed=5) for s in range(2)]
    for stage in stages:
        stage.load_state_dict({k: state[k] for k in stage.state_dict()})
    h, aux0 = stages[0](x)
    ce, aux1 = stages[1](h, y)
    torch.testing.assert_close(ce, want, rtol=0, atol=0)
    torch.testing.assert_close(aux0 + aux1, aux_want)


@pytest.mark.parametrize("args,field", [
    (["--model.n_kv_heads", "3"], "model.n_kv_heads"),
    (["--model.head_dim", "7"], "model.head_dim"),
    (["--model.n_heads", "3"], "model.n_heads"),
    (["--model.dense_layers", "4"], "model.dense_layers"),
    (["--model.first_k_dense", "5"], "model.first_k_dense"),
    (["--model.shared_expert_gate", "true"], "model.shared_expert_gate"),
    (["--model.shared_experts", "-1"], "model.shared_experts"),
    (["--model.qk_norm", "layer"], "model.qk_norm"),
])
def test_bad_options_fail_in_one_line(args, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, TINY + args)
    msg = str(e.value)
    assert field in msg and "\n" not in msg
