"""Packed documents (model/docs.py, model.attn_mask=doc): document starts found from EOTs, and a document's logits in
a packed window equal to its logits alone, with every position option (RoPE, YaRN with MLA, a learned table)."""

import pytest
import torch

from nanotitan.config.config import load_config
from nanotitan.model.docs import doc_positions, doc_starts, segments
from nanotitan.model.tokens import causal_attention, doc_attention
from nanotitan.model.transformer import Transformer
from tests.helpers.hf import DS_OPTIONS
from tests.helpers.tiny import tiny_args

EOT = 5
ARGS = tiny_args(n_layers=2, max_seq_len=64, vocab_size=300) + ["--train.seq_len", "64", "--model.attn_mask", "doc"]


def _reference_starts(x_BS, eot):
    """Per position, the start of its document, one token at a time (the test's reference only)."""
    out = []
    for row in x_BS.tolist():
        start, starts = 0, []
        for i, tok in enumerate(row):
            starts.append(start)
            if tok == eot:
                start = i + 1
        out.append(starts)
    return torch.tensor(out)


def test_doc_starts_and_positions_follow_the_eots():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 12, (4, 40), generator=g)  # EOT = 5: about one token in twelve
    x[0, -1], x[1, 0], x[2] = EOT, EOT, 7  # an EOT last, an EOT first, a window without one
    starts = doc_starts(x, EOT)
    assert torch.equal(starts, _reference_starts(x, EOT))
    assert torch.equal(doc_positions(starts), torch.arange(40) - starts)
    assert segments(starts[1])[0] == (0, 1) and segments(starts[2]) == [(0, 40)]  # the EOT belongs to its document


def _packed(vocab: int, lengths, seed: int = 0):
    """Documents of `lengths` tokens, each ended by EOT, and the window that packs them (1, sum)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.cat([torch.randint(EOT + 1, vocab, (n,), generator=g), torch.tensor([EOT])]) for n in lengths]
    return docs, torch.cat(docs)[None]


MODELS = {"rope": [], "gqa": ["--model.n_kv_heads", "2", "--model.qk_norm", "head"],
          "deepseek": [*DS_OPTIONS[:10], *DS_OPTIONS[-8:], "--model.mtp_layers", "1"],
          "learned": ["--model.pos_emb", "learned"]}


@pytest.mark.parametrize("name", MODELS)
def test_a_documents_logits_in_a_packed_window_equal_it_alone(name):
    cfg = load_config(None, ARGS + MODELS[name])
    model = Transformer(cfg.model, seed=1).eval()
    docs, x = _packed(300, (7, 12, 1, 9))
    with torch.no_grad():
        packed, _ = model(x, docs=doc_starts(x, EOT))
        at, worst = 0, 0.0
        for d in docs:
            alone, _ = model(d[None])
            worst = max(worst, (packed[0, at:at + len(d)] - alone[0]).abs().max().item())
            at += len(d)
        causal, _ = model(x)
    assert worst <= 1e-5 * alone.abs().max().item(), (name, worst)
    assert (causal[0, 8:] - packed[0, 8:]).abs().max() > 1e-3  # the mask matters: causal sees the earlier documents


def test_global_positions_keep_the_windows_and_only_learned_tables_tell():
    """doc_positions=global: a learned table reads window positions, so a later document differs from it alone
    (RoPE's scores depend only on the distance inside a document: both settings agree there)."""
    docs, x = _packed(300, (6, 9))
    out = {}
    for pos_emb in ("learned", "rope"):
        for where in ("doc", "global"):
            cfg = load_config(None, ARGS + ["--model.pos_emb", pos_emb, "--model.doc_positions", where])
            with torch.no_grad():
                out[pos_emb, where] = Transformer(cfg.model, seed=1).eval()(x, docs=doc_starts(x, EOT))[0]
    assert (out["learned", "doc"][0, 7:] - out["learned", "global"][0, 7:]).abs().max() > 1e-3
    assert torch.allclose(out["learned", "doc"][0, :7], out["learned", "global"][0, :7])
    assert torch.allclose(out["rope", "doc"], out["rope", "global"], atol=1e-5)


def test_doc_attention_equals_a_masked_reference_forward_and_backward():
    """Per-document SDPA against one SDPA under the block-diagonal causal mask, GQA and a narrower v included."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 24, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 24, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 24, 6, generator=g, requires_grad=True)
    x = torch.randint(0, 9, (2, 24), generator=g)
    starts = doc_starts(x, EOT)
    got = doc_attention(q, k, v, starts, 0.3)
    pos = torch.arange(24)
    mask = (starts[:, :, None] == starts[:, None, :]) & (pos[:, None] >= pos[None, :])
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = (q @ kk.transpose(-1, -2) * 0.3).masked_fill(~mask[:, None], float("-inf"))
    want = s.softmax(-1) @ vv
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    dy = torch.randn(want.shape, generator=g)
    grads = torch.autograd.grad(got, (q, k, v), dy)
    for a, b in zip(grads, torch.autograd.grad(want, (q, k, v), dy)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    one = torch.zeros(1, 24, dtype=torch.long)  # a single document is plain causal attention
    torch.testing.assert_close(doc_attention(q[:1], k[:1], v[:1], one, 0.3), causal_attention(q[:1], k[:1], v[:1], 0.3))
