"""The planner's packed documents (plan/docs.py): document-masked attention priced by the documents' causal areas,
the CP split's balance over them (zigzag against parallel.cp_split=docs), and `plan --what-if --doc-len-mean` /
`--doc-data` (a prepared directory's documents)."""

from __future__ import annotations

import json

import numpy as np
import torch

from nanotitan.config.config import load_config
from nanotitan.config.hardware import get_hardware
from nanotitan.model.docs import doc_starts
from nanotitan.plan import docs as docs_plan
from nanotitan.plan.cost import PlanOptions, predict
from nanotitan.plan.shape import Layout, ModelShape

H100 = get_hardware("h100")


def _cfg(S: int, *extra: str):
    return load_config(None, ["--model.d_model", "512", "--model.n_layers", "2", "--model.n_heads", "8",
                              "--model.ffn_dim", "512", "--model.num_experts", "8", "--model.top_k", "2",
                              "--train.seq_len", str(S), "--model.max_seq_len", str(S), "--train.dtype", "bf16",
                              "--model.attn_mask", "doc", *extra])


def test_span_is_the_documents_causal_area():
    """One document filling the window spans S; documents of length d span d (sum d^2 / S); short geometric
    documents of mean L about 2L; without documents the planner keeps S."""
    S = 4096
    assert docs_plan.span(torch.zeros(1, S, dtype=torch.long)) == S
    x = torch.zeros(1, S, dtype=torch.long)
    x[0, 255::256] = 1
    assert abs(docs_plan.span(doc_starts(x, 1)) - 256) < 1e-9
    got = docs_plan.span(docs_plan.synthetic_starts(S, 64))
    assert 0.85 * 128 <= got <= 1.15 * 128, got
    assert docs_plan.attention_span(S, 4, "zigzag") == S


def test_zigzag_is_skewed_by_long_documents_and_the_balanced_split_is_not():
    starts = docs_plan.synthetic_starts(16384, 4096)
    assert docs_plan.cp_skew(starts, 1, "zigzag") == 1.0
    zigzag, balanced = docs_plan.cp_skew(starts, 4, "zigzag"), docs_plan.cp_skew(starts, 4, "docs")
    assert zigzag > 1.3 and balanced < 1.05, (zigzag, balanced)
    short = docs_plan.synthetic_starts(16384, 64)  # short documents: the balanced split still evens them out
    assert docs_plan.cp_skew(short, 4, "docs") < 1.05


def test_document_masked_attention_costs_less_and_the_balanced_split_steps_faster():
    """The attention FLOPs fall with the documents' span; under CP4 with long documents the balanced split's step is
    shorter than zigzag's (the slowest rank's attention), and at CP1 the split changes nothing."""
    S = 32768
    lay, lay4 = Layout(1, 1, 1, "1f1b", 1, 1), Layout(1, 1, 1, "1f1b", 1, 1, cp=4)
    causal = predict(_cfg(S), lay, H100)
    docs = predict(_cfg(S), lay, H100, PlanOptions(doc_len_mean=512))
    assert docs.step_time_s < 0.5 * causal.step_time_s
    opts = PlanOptions(doc_len_mean=8192)
    zz = predict(_cfg(S), lay4, H100, opts)
    bal = predict(_cfg(S, "--parallel.cp_split", "docs"), lay4, H100, opts)
    assert bal.step_time_s < 0.95 * zz.step_time_s, (bal.step_time_s, zz.step_time_s)
    shape = ModelShape.from_config(_cfg(S))
    f_causal = shape.attn_part(0)["f_dense"]
    f_docs = ModelShape.from_config(_cfg(S), attn_span=512.0).attn_part(0)["f_dense"]
    assert f_docs < f_causal


def test_a_prepared_directory_gives_its_documents(tmp_path):
    """--doc-data: windows of train.bin cut at its EOT; the mean length is its tokens over its EOTs."""
    tokens = np.full(64 * 1024, 5, dtype=np.uint16)
    tokens[511::512] = 2  # documents of 512 tokens, EOT = 2
    (tmp_path / "train.bin").write_bytes(tokens.tobytes())
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16", "eot_id": 2}))
    assert docs_plan.mean_length(str(tmp_path)) == 512
    starts = docs_plan.data_starts(str(tmp_path), 4096)
    assert starts.shape == (docs_plan.WINDOWS, 4096)
    assert 448 <= docs_plan.span(starts) <= 512
    assert docs_plan.attention_span(4096, 1, "zigzag", data_dir=str(tmp_path)) < 4096 / 4


def test_what_if_reports_the_documents_and_both_splits():
    """--what-if with --doc-len-mean: the work the mask leaves, and at the best layout's CP the slowest rank's share
    and the step under zigzag and under the balanced split (one window a microbatch: more windows even zigzag out,
    as the runtime lays a microbatch out as a whole)."""
    from nanotitan.plan.fit.interval import FITTED
    from nanotitan.plan.whatif import format_what_if, what_if

    r = what_if(_cfg(32768), 4, H100, PlanOptions(cp=4, doc_len_mean=8192, micro_batch=1), FITTED, top=1, dry_run=False)
    d = r["documents"]
    assert d["cp"] == 4 and d["mean_length"] == 8192 and d["micro_batch"] == 1 and 0 < d["work_vs_causal"] < 1
    assert d["zigzag"]["skew"] > 1.3 > 1.05 > d["docs"]["skew"]
    assert d["docs"]["step_time_s"] < d["zigzag"]["step_time_s"]
    many = docs_plan.cp_skew(docs_plan.synthetic_starts(32768, 8192, 32), 4, "zigzag", 8)
    assert 1.0 < many < d["zigzag"]["skew"]
    text = format_what_if(r)
    assert "CP4 over documents" in text and "--parallel.cp_split docs" in text
