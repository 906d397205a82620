"""Packed documents against transformers: our exported model's logits of a packed window under model.attn_mask=doc
equal transformers' on the same window with a block-diagonal 4-D causal mask and position_ids that restart at each
document (Mixtral, Qwen3-MoE, DeepSeek-V3 with MLA and YaRN)."""

import pytest
import torch

from nanotitan.interop import hf
from nanotitan.model.docs import doc_positions, doc_starts
from nanotitan.model.transformer import Transformer
from tests.helpers.hf import DS_OPTIONS, _assert_logits_close, _randomise, tiny_config

V, EOT = 320, 3
OPTIONS = {"mixtral": ["--model.n_kv_heads", "2"],
           "qwen3_moe": ["--model.qk_norm", "head", "--model.head_dim", "12", "--model.n_kv_heads", "2"],
           "deepseek_v3": [*DS_OPTIONS[:10], "--model.router_score", "sigmoid", "--model.n_group", "2",
                           "--model.topk_group", "1", "--model.first_k_dense", "1", "--model.shared_experts", "1",
                           *DS_OPTIONS[-8:]]}


def _window() -> torch.Tensor:
    """Two windows of 24 tokens packing documents of different lengths (EOT-ended; one runs past the end)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(EOT + 1, V, (2, 24), generator=g)
    for row, ends in ((0, (4, 11, 12, 19)), (1, (8,))):
        x[row, list(ends)] = EOT
    return x


@pytest.mark.parametrize("family", OPTIONS)
def test_doc_masked_logits_equal_transformers_block_diagonal_mask(family, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(V, 8 if family == "deepseek_v3" else 4, 64, "--model.attn_mask", "doc", *OPTIONS[family])
    model = Transformer(cfg.model, seed=3)
    _randomise(model.parameters(), seed=11)
    out = hf.save_pretrained(model, cfg, tmp_path / family)
    x = _window()
    starts = doc_starts(x, EOT)
    pos = torch.arange(x.shape[1])
    seen = (starts[:, :, None] == starts[:, None, :]) & (pos[:, None] >= pos[None, :])  # (B, S, S)
    mask = torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.float32).min)[:, None]  # (B, 1, S, S)
    with torch.no_grad():
        got, _ = model.eval()(x, docs=starts)
        want = AutoModelForCausalLM.from_pretrained(out).eval()(x, attention_mask=mask,
                                                                 position_ids=doc_positions(starts)).logits
        causal = AutoModelForCausalLM.from_pretrained(out).eval()(x).logits
    _assert_logits_close(got, want)
    assert (causal - want).abs().max() > 1e-3  # the mask and positions matter to transformers too
