"""DeepSeek-V3 (MLA, YaRN, DeepSeekMoE's group-limited routing) against transformers as the oracle.

Contracts: a tiny random DeepseekV3ForCausalLM, built offline, imports with logits equal to transformers' (max |diff|
<= 1e-5 of the logits' scale, fp32) and decodes greedily to the same tokens: (a) DeepSeek-V3's shape (q low rank,
YaRN with mscale, n_group/topk_group routing with a non-zero selection bias, 1 dense layer, shared expert),
(b) DeepSeek-V2-Lite's (plain q_proj, no rope scaling, un-interleaved rope, two shared experts, no top-k
renormalisation). Import -> export is bit-exact and transformers computes our logits from the export; a model
trained here exports too. The group-limited router equals a per-token reference.
"""

import json

import pytest
import torch

from nanotitan.config.config import ConfigError, load_config
from nanotitan.interop import hf
from nanotitan.model.transformer import Transformer, flops_per_token
from nanotitan.resolve import resolve
from tests.helpers.hf import _assert_logits_close, _randomise, _tensors
from tests.helpers.hf import DS_OPTIONS, greedy_full_forward, tiny_config

V = 300
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
              kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=1,
              max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, tie_word_embeddings=False)
SHAPES = {
    "v3": dict(q_lora_rank=12, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
               norm_topk_prob=True, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                     "original_max_position_embeddings": 16, "beta_fast": 32,
                                                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}),
    "v2_lite": dict(q_lora_rank=None, n_shared_experts=2, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                    norm_topk_prob=False, rope_interleave=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
X = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))


def _tiny_deepseek(shape: str, out, seed: int):
    import transformers

    config = transformers.DeepseekV3Config(**COMMON, **SHAPES[shape])
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomise(model.parameters(), seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # a selection bias that changes the choice (our router_bias)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
    model.save_pretrained(out)
    return out


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def ds_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return {s: _tiny_deepseek(s, root / s, seed=i) for i, s in enumerate(SHAPES)}


@pytest.mark.parametrize("shape", SHAPES)
def test_import_logits_and_greedy_decoding_equal_transformers(ds_dirs, shape):
    d = ds_dirs[shape]
    cfg, model = hf.load_pretrained(d)
    m = cfg.model
    assert (m.kv_lora_rank, m.q_lora_rank, m.first_k_dense, m.router_score) == (16, 12 if shape == "v3" else 0, 1,
                                                                              "sigmoid")
    assert m.rope_scaling == ("yarn" if shape == "v3" else "none") and m.n_group == (4 if shape == "v3" else 1)
    ref = _hf(d)
    with torch.no_grad():
        got, _ = model(X)
        _assert_logits_close(got, ref(X).logits)
        if shape == "v3":  # greedy decoding (transformers with its latent cache): the same tokens
            ours = greedy_full_forward(model, X[:, :6], 8)
            theirs = ref.generate(X[:, :6], max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(X[:, :6]))
            assert torch.equal(ours, theirs), (ours, theirs)


def test_import_export_round_trip_and_fresh_export(ds_dirs, tmp_path):
    for shape, d in ds_dirs.items():
        cfg, model = hf.load_pretrained(d)
        out = hf.save_pretrained(model, cfg, tmp_path / shape)
        want, got = _tensors(d), _tensors(out)
        assert want.keys() == got.keys(), shape
        for k in want:  # v2_lite was saved un-interleaved: export writes DeepSeek's interleaved rotary rows
            relaid = shape == "v2_lite" and k.endswith(("q_proj.weight", "kv_a_proj_with_mqa.weight"))
            assert torch.equal(want[k], got[k]) != relaid, (shape, k)
        conf = json.loads((out / "config.json").read_text())
        assert conf["architectures"] == ["DeepseekV3ForCausalLM"] and conf["rope_interleave"] is True
        if shape == "v2_lite":
            with torch.no_grad():
                _assert_logits_close(model(X)[0], _hf(out)(X).logits)
    # one of ours (no router bias: written as transformers' zeros; biased projections) loads with our logits
    cfg = tiny_config(V, 8, 64, *["--model.kv_lora_rank", "16", "--model.q_lora_rank", "12", "--model.qk_nope_head_dim",
                             "8", "--model.qk_rope_head_dim", "4", "--model.v_head_dim", "6", "--model.n_group", "2",
                             "--model.topk_group", "1", "--model.router_score", "sigmoid", "--model.first_k_dense",
                             "1", "--model.shared_experts", "1", "--model.dense_ffn_dim", "40",
                             "--model.rope_scaling", "yarn", "--model.rope_factor", "2",
                             "--model.rope_original_max_len", "32", "--model.rope_mscale_all_dim", "1",
                             "--model.attn_bias", "true"])  # attention_bias: q_a, kv_a and o biased
    model = Transformer(cfg.model, seed=3)
    _randomise(model.parameters(), seed=11)
    out = hf.save_pretrained(model, cfg, tmp_path / "fresh")
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.bias" in _tensors(out)
    with torch.no_grad():
        got, _ = model.eval()(X)
        _assert_logits_close(got, _hf(out)(X).logits)
    cfg.model.router_score = "softmax"
    with pytest.raises(ConfigError, match="MLA with model.router_score=softmax") as e:
        hf.save_pretrained(Transformer(cfg.model), cfg, tmp_path / "x")
    assert "\n" not in str(e.value)


def test_yarn_in_a_gqa_family_equals_transformers(tmp_path):
    """YaRN for the other families (here Mixtral with GQA): the cos/sin attention factor, no softmax mscale."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 8,
                         "beta_fast": 16, "beta_slow": 2})
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomise(model.parameters(), 5)
    model.save_pretrained(tmp_path / "in")
    cfg, ours = hf.load_pretrained(tmp_path / "in")
    assert (cfg.model.rope_scaling, cfg.model.rope_factor, cfg.model.rope_original_max_len) == ("yarn", 8.0, 8)
    with torch.no_grad():
        _assert_logits_close(ours(X)[0], _hf(tmp_path / "in")(X).logits)
    out = hf.save_pretrained(ours, cfg, tmp_path / "out")
    with torch.no_grad():
        _assert_logits_close(ours(X)[0], _hf(out)(X).logits)


def test_group_limited_routing_equals_a_per_token_reference():
    from nanotitan.model.moe import MoE

    torch.manual_seed(0)
    E, G, TG, K = 16, 4, 2, 3
    moe = MoE(8, 4, E, K, True, 0, E, score="sigmoid", routed_scale=2.5, bias_update_rate=1e-3, n_group=G,
              topk_group=TG)
    moe.router_bias.copy_(torch.randn(E) * 0.2)
    x = torch.randn(40, 8)
    ids, w, _ = moe.route(x, 4, 10)
    scores = (x @ moe.router.weight.T).sigmoid()
    for t in range(x.shape[0]):  # DeepSeek-V3 §2.1.2 as written: groups by their top-2 biased sum, then top-k
        biased = scores[t] + moe.router_bias
        group_score = [biased[g * 4:(g + 1) * 4].topk(2).values.sum() for g in range(G)]
        groups = sorted(range(G), key=lambda g: -group_score[g])[:TG]
        allowed = [e for g in groups for e in range(g * 4, (g + 1) * 4)]
        chosen = sorted(allowed, key=lambda e: -biased[e])[:K]
        assert sorted(ids[t].tolist()) == sorted(chosen), t
        want = scores[t, ids[t]] / scores[t, ids[t]].sum() * 2.5  # unbiased scores, renormalised, scaled
        assert torch.allclose(w[t], want, rtol=1e-6), t


def test_init_from_hf_maps_the_family_and_its_options(ds_dirs, tmp_path):
    d = ds_dirs["v3"]
    cfg = resolve(load_config(None, ["--init.from_hf", str(d), "--train.seq_len", "16", "--data.tokenizer", "x"]))
    m = cfg.model
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.n_group,
            m.topk_group, m.routed_scale, m.shared_experts, m.shared_ffn_dim, m.dense_ffn_dim, m.ffn_dim) == \
        (12, 16, 8, 4, 6, 4, 2, 2.5, 1, 16, 40, 16)
    assert (m.rope_scaling, m.rope_factor, m.rope_original_max_len, m.rope_mscale, m.rope_mscale_all_dim) == \
        ("yarn", 4.0, 16, 0.707, 1.0)
    assert m.bias_update_rate == 1e-3  # the checkpoint's selection bias is kept, and moves at DeepSeek-V3's rate
    mine = ["--init.from_hf", str(d), "--train.seq_len", "16", "--data.tokenizer", "x"]
    assert resolve(load_config(None, mine + ["--model.bias_update_rate", "0.01"])).model.bias_update_rate == 0.01
    for args, needle in [(["--model.bias_update_rate", "0"], "model.bias_update_rate=0.0 conflicts"),
                         (["--model.n_group", "2"], "model.n_group=2 conflicts")]:
        with pytest.raises(ConfigError, match=needle) as e:
            resolve(load_config(None, mine + args))
        assert "\n" not in str(e.value)
    for key, value, needle in [("scoring_func", "softmax", "scoring_func='softmax'"),
                               ("num_key_value_heads", 2, "num_key_value_heads=2"),
                               ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                    "original_max_position_embeddings": 16, "truncate": False},
                                "yarn truncate=false")]:
        bad = tmp_path / key
        bad.mkdir()
        conf = json.loads((d / "config.json").read_text())
        conf[key] = value
        (bad / "config.json").write_text(json.dumps(conf))
        with pytest.raises(ConfigError, match=needle) as e:
            resolve(load_config(None, ["--init.from_hf", str(bad), "--data.tokenizer", "x"]))
        assert "\n" not in str(e.value)


def test_flops_count_mla_matmuls_and_widths():
    cfg = load_config(None, ["--model.d_model", "32", "--model.n_heads", "4", "--model.n_layers", "2",
                             "--model.num_experts", "4", "--model.ffn_dim", "16", "--model.vocab_size", str(V),
                             "--data.vocab_size", str(V), "--model.kv_lora_rank", "16", "--model.q_lora_rank", "12", "--model.qk_nope_head_dim",
                             "8", "--model.qk_rope_head_dim", "4", "--model.v_head_dim", "6"]).model
    attn = 32 * 12 + 12 * 4 * 12 + 32 * (16 + 4) + 16 * 4 * (8 + 6) + 4 * 6 * 32  # q_a, q_b, kv_a, kv_b, o
    model = Transformer(cfg)
    counted = sum(p.numel() for n, p in model.named_parameters() if ".attn." in n and "norm" not in n)
    assert attn * 2 == counted
    moe = 2 * 3 * 32 * 16 + 32 * 4
    want = 6 * (2 * attn + 2 * moe + 32 * V) + 6 * 2 * 16 * 4 * (12 + 6)
    assert flops_per_token(cfg, 16) == want


# --- a multi-rank layout trains what one process trains (DESIGN §4): one 4-rank launch --------------------------


DS_CASES = [(1, 2, 2, "zb1", ("--parallel.pp_layers", "2.5,1.5", "--train.ckpt_at_end", "true"))]  # ds-mtp: the rest


def _run_ds_cases(rank, world, corpus_dir, run_root):
    from tests.helpers.mp import train_once
    from tests.helpers.equivalence import base_args, layout_args

    return [train_once(base_args(corpus_dir, f"{run_root}/{i}") + layout_args(*case) + DS_OPTIONS)
            for i, case in enumerate(DS_CASES)]


def test_mla_and_group_routing_train_exactly_on_pp2_ep2_zb1(corpus_dir, tmp_path):
    """PP2·EP2 under zb1 cut at 2.5,1.5 (stage 0 ends on layer 2's MLA half, zb1 defers MLA's weight gradients):
    losses, final parameters and router biases as one process's. Its checkpoint exports, and transformers
    computes our logits from it."""
    from tests.helpers.mp import run_ranks, train_once
    from tests.helpers.equivalence import base_args, check_case, layout_args

    torch.set_num_threads(1)
    ref = train_once(base_args(corpus_dir, tmp_path / "ref") + layout_args(1, 1, 1) + DS_OPTIONS)
    assert any(".attn.kv_b_proj." in n for n in ref["params"]) and ref["biases"]
    results = run_ranks(_run_ds_cases, 4, args=(str(corpus_dir), str(tmp_path / "w4")), timeout=300, pg_timeout=120)
    for i, case in enumerate(DS_CASES):
        ranks = [results[r][i] for r in range(4)]
        check_case(f"{case}", ranks, ref)
        for r in ranks:
            for key, bias in r["biases"].items():
                assert torch.equal(bias, ref["biases"][key]), f"{case} rank {r['coords']}: layer {key} bias"
    out = hf.export_checkpoint(tmp_path / "w4" / "0", tmp_path / "exported")
    _, again = hf.load_pretrained(out)
    for name, (t, start) in ref["params"].items():  # the trained weights, gathered from 4 ranks' shards
        assert torch.allclose(dict(again.named_parameters())[name], t, rtol=1e-4, atol=1e-3 * 3e-3 * 10), name
    with torch.no_grad():
        _assert_logits_close(again(X)[0], _hf(out)(X).logits)
