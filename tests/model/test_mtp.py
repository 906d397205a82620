"""Multi-token prediction (model/mtp.py) in one process: the loss is DeepSeek-V3's, computed by hand from the model's
own modules; the forward returns it as a term of its own beside the main CE (ce_loss stays comparable), and
ce + mtp_coef * mtp has the gradient DeepSeek's objective has; names and shard specs follow DeepSeek's layout; bad
configs fail in one line.
The layouts (PP's embedding replica, zb1, EP, lanes, zero, checkpoints) are equivalence/test_equivalence_deepseek.py's."""

import pytest
import torch
import torch.nn.functional as F

from nanotitan.config.config import Config, ConfigError, ModelConfig, ParallelConfig, load_config
from nanotitan.model.spec import ModelShardSpec, build_chunk_specs
from nanotitan.model.transformer import Transformer

S, V = 12, 64
HV = 300  # the HF test: a vocabulary the byte-level tokenizer allows


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, ffn_dim=48, num_experts=4, top_k=2, max_seq_len=S,
                first_k_dense=1, mtp_layers=2, mtp_coef=0.3)
    return ModelConfig(**{**base, **kw})


def _by_hand(model: Transformer, x, y):
    """DeepSeek-V3 §2.2 written out: depth k joins h (depth 0: the last hidden state before the final norm) with
    emb(token t+k) = emb(y[t+k-1]), runs its block, and predicts y[t+k] through the shared head."""
    rope = (model.rope_cos, model.rope_sin)
    h = model.tok_emb(x)
    for i in range(model.cfg.n_layers):
        h, _ = model.layers[str(i)](h, rope)
    ce = F.cross_entropy(model.head(model.norm(h)).reshape(-1, V), y.reshape(-1))
    losses = []
    for k, mod in enumerate(model.mtp.values(), start=1):
        e = model.tok_emb(y[:, k - 1:S - 1])
        z = mod.eh_proj(torch.cat([mod.enorm(e), mod.hnorm(h[:, :S - k])], -1))
        block = model.layers[str(model.cfg.n_layers + k - 1)]
        assert block.moe.seq_tail == k  # the model runs it on S positions, routing S - k: here it gets only those
        block.moe.seq_tail = 0
        try:
            h, _ = block(z, rope)
        finally:
            block.moe.seq_tail = k
        logits = model.head(mod.shared_head.norm(h))
        losses.append(F.cross_entropy(logits.reshape(-1, V), y[:, k:].reshape(-1)))
    return ce, torch.stack(losses).mean()


def test_mtp_loss_value_and_gradient():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Transformer(_cfg(), seed=3)
    x, y = torch.randint(0, V, (2, S)), torch.randint(0, V, (2, S))
    out, aux, mtp = model(x, y)  # the MTP loss is a third term, weighted by mtp_coef
    ce_hand, mtp_hand = _by_hand(model, x, y)
    torch.testing.assert_close(out, ce_hand, rtol=1e-6, atol=0)  # the value is the main CE only
    torch.testing.assert_close(mtp, 0.3 * mtp_hand, rtol=1e-6, atol=0)
    model.eval()
    ce_eval, _ = model(x, y)  # evaluation: two terms, no MTP
    assert torch.equal(ce_eval, out.detach()), "evaluation reads the main head only"
    model.train()
    params = list(model.parameters())
    got = torch.autograd.grad(out + mtp, params, allow_unused=True)
    want = torch.autograd.grad(ce_hand + 0.3 * mtp_hand, params, allow_unused=True)
    names = [n for n, _ in model.named_parameters()]
    for n, a, b in zip(names, got, want):
        assert a is not None and b is not None, f"{n}: no gradient"
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")


def test_names_follow_deepseek_and_stages():
    cfg = _cfg(n_layers=3)
    names = {n for n, _ in Transformer(cfg).named_parameters()}
    # DeepSeek numbers MTP module k as decoder layer n_layers + k - 1; its extra parts sit beside the block.
    assert {"layers.3.attn.q_proj.weight", "layers.4.moe.router.weight", "mtp.3.enorm.weight", "mtp.3.hnorm.weight",
            "mtp.3.eh_proj.weight", "mtp.4.shared_head.norm.weight"} <= names
    assert ModelShardSpec.full(cfg).mtp_layers == 2
    full = Config(model=cfg, parallel=ParallelConfig(pp=2))
    first, = build_chunk_specs(full, pp_rank=0)
    last, = build_chunk_specs(full, pp_rank=1)
    assert (first.mtp_layers, first.embed_replica) == (0, False)
    assert (last.mtp_layers, last.embed_replica) == (2, True)
    stage = {n for n, _ in Transformer(cfg, last).named_parameters()}
    assert "tok_emb.weight" in stage and "mtp.4.eh_proj.weight" in stage and "layers.4.attn.q_proj.weight" in stage
    # the replica starts as stage 0's table (init by global identity)
    assert torch.equal(Transformer(cfg, first).tok_emb.weight, Transformer(cfg, last).tok_emb.weight)
    # interleaved: the last rank's chunks joined under global names hold the replica and the MTP modules
    from nanotitan.parallel.pp.chunks import StageChunks

    cfg4 = _cfg(n_layers=4)
    inter = Config(model=cfg4, parallel=ParallelConfig(pp=2, schedule="interleaved", virtual_stages=2))
    joined = {n for n, _ in StageChunks([Transformer(cfg4, s) for s in build_chunk_specs(inter, 1)]).named_parameters()}
    assert {"tok_emb.weight", "mtp.4.eh_proj.weight", "layers.5.attn.q_proj.weight", "head.weight"} <= joined


@pytest.mark.parametrize("args,msg", [
    (["--model.mtp_layers", "16", "--train.seq_len", "16"], "model.mtp_layers=16 must be < train.seq_len=16"),
])
def test_bad_mtp_config_one_line(args, msg):
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert msg in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_mtp_under_pp_at_every_zero_level_is_accepted(zero):
    """DeepSeek-V3's own layout (PP with ZeRO DP) with MTP: once refused, now trained exactly (parallel/tied.py; the
    rows are tests/equivalence/test_equivalence_deepseek.py's)."""
    cfg = load_config(None, ["--model.mtp_layers", "1", "--parallel.pp", "2", "--parallel.zero", str(zero),
                             "--parallel.dp", "2"])
    assert (cfg.model.mtp_layers, cfg.parallel.pp, cfg.parallel.zero) == (1, 2, zero)


def test_hf_round_trip_keeps_mtp_bit_exact_and_transformers_loads_the_rest(tmp_path):
    """A DeepSeek-V3-shaped model with 2 MTP modules -> export (DeepSeek's names: model.layers.{3,4}.* with enorm,
    hnorm, eh_proj, shared_head.norm/head, embed_tokens) -> import -> export: every tensor bit-exact, MTP included;
    transformers loads the export (ignoring the MTP layers) and computes our main logits."""
    from transformers import AutoModelForCausalLM

    from nanotitan.interop import hf
    from tests.helpers.hf import DS_OPTIONS, tiny_config
    from tests.helpers.hf import _assert_logits_close, _randomise, _tensors

    torch.set_num_threads(1)
    cfg = tiny_config(HV, 4, 16, *DS_OPTIONS, "--model.mtp_layers", "2")  # test_deepseek's tiny DeepSeek-V3 options
    model = Transformer(cfg.model, seed=3)
    _randomise(model.parameters(), seed=11)
    out = hf.save_pretrained(model, cfg, tmp_path / "a")
    first = _tensors(out)
    for i in (3, 4):
        for part in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens",
                     "self_attn.kv_b_proj", "mlp.gate"):
            assert f"model.layers.{i}.{part}.weight" in first, (i, part)
    assert torch.equal(first["model.layers.4.embed_tokens.weight"], model.tok_emb.weight)
    cfg2, back = hf.load_pretrained(out)
    assert cfg2.model.mtp_layers == 2
    mine = dict(model.named_parameters())
    for n, p in back.named_parameters():
        assert torch.equal(p, mine[n]), n
    again = _tensors(hf.save_pretrained(back, cfg2, tmp_path / "b"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    x = torch.randint(0, HV, (2, S), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _assert_logits_close(back(x)[0], AutoModelForCausalLM.from_pretrained(out).eval()(x).logits)
    # a checkpoint whose MTP copy of the embedding differs from the model's cannot be shared: one line
    from safetensors.torch import save_file
    first["model.layers.3.embed_tokens.weight"] = first["model.layers.3.embed_tokens.weight"] + 1
    save_file(first, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="model.layers.3.embed_tokens.weight differs from the model's own "
                                          "model.embed_tokens.weight"):
        hf.load_pretrained(out)
