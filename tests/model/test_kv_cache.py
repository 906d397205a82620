"""The KV cache (model/kv_cache.py, Transformer.decode): a prompt read at once and the tokens after it one at a time, or
in chunks, give the full forward's logits at every position, for each attention the families use (GQA, Qwen3's
per-head and OLMoE's whole-projection q/k norms, a learned position table, DeepSeek's MLA with its latent cached);
greedy generation with the cache picks the tokens the full forward picks; past model.max_seq_len the context slides.
Cost: ~2 s."""

import pytest
import torch

from nanotitan.config.config import load_config
from nanotitan.generate import Sampling, picker
from nanotitan.model.kv_cache import KVCache
from nanotitan.model.transformer import Transformer
from tests.helpers.hf import greedy_full_forward

V, L = 300, 24
BASE = ["--model.d_model", "32", "--model.n_heads", "4", "--model.ffn_dim", "24", "--model.n_layers", "3",
        "--model.num_experts", "4", "--model.vocab_size", str(V), "--model.max_seq_len", str(L),
        "--data.vocab_size", str(V), "--train.seq_len", "16"]
ATTENTION = {
    "gqa": ["--model.n_kv_heads", "2"],
    "qk_norm_head": ["--model.qk_norm", "head", "--model.head_dim", "12", "--model.n_kv_heads", "2"],
    "qk_norm_full": ["--model.qk_norm", "full", "--model.n_kv_heads", "1"],
    "learned_positions": ["--model.pos_emb", "learned"],
    "mla": ["--model.kv_lora_rank", "16", "--model.q_lora_rank", "12", "--model.qk_nope_head_dim", "8",
            "--model.qk_rope_head_dim", "4", "--model.v_head_dim", "6", "--model.first_k_dense", "1"],
}


def _model(extra) -> Transformer:
    model = Transformer(load_config(None, BASE + extra).model, seed=3).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # away from the init, so attention is far from uniform
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


@pytest.mark.parametrize("name", ATTENTION)
def test_cached_logits_and_greedy_tokens_equal_the_full_forward(name):
    model = _model(ATTENTION[name])
    x = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, _ = model(x)
    cache = KVCache(L)
    parts = [model.decode(x[:, :9], cache), model.decode(x[:, 9:13], cache)]  # a prompt, then a chunk of 4
    parts += [model.decode(x[:, i:i + 1], cache) for i in range(13, 20)]  # then one token at a time
    got = torch.cat(parts, 1)
    assert cache.length == 20
    assert (got - full).abs().max() <= 1e-5 * full.abs().max(), name
    prompt = x[:, :5]
    assert torch.equal(model.generate(prompt, 12, picker(Sampling(greedy=True))),
                       greedy_full_forward(model, prompt, 12)), name


def test_generation_slides_past_max_seq_len_and_seeds_its_draws():
    model = _model(ATTENTION["gqa"])
    prompt = torch.randint(0, V, (1, 30), generator=torch.Generator().manual_seed(2))  # longer than the table
    out = model.generate(prompt, 40, picker(Sampling(greedy=True)))
    assert out.shape == (1, 70) and torch.equal(out[:, :30], prompt)
    # the first token reads the newest L tokens of the prompt; after the slide, the newest L // 2 of the context
    with torch.no_grad():
        assert out[0, 30] == model(prompt[:, -L:])[0][0, -1].argmax()  # the cache is full after it
        assert out[0, 31] == model(out[:, 31 - L // 2:31])[0][0, -1].argmax()
        assert out[0, 32] == model(out[:, 31 - L // 2:32])[0][0, -1].argmax()  # and decoding goes on from there
    draw = lambda seed: model.generate(prompt[:, :4], 20, picker(Sampling(seed=seed)))  # noqa: E731
    assert torch.equal(draw(7), draw(7)) and not torch.equal(draw(7), draw(8))
