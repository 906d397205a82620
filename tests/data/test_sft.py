"""data.format=sft (data/sft.py): prompt/response records -> tokens and a loss mask, verified on open; windows of
whole examples whose targets are the responses only; bad records refused in one line."""

import json

import numpy as np
import pytest
import torch

from nanotitan.config.config import DataConfig
from nanotitan.data.mix import open_file
from nanotitan.data.prepare import load_meta, load_tokenizer, prepare_data
from nanotitan.data.sft import MASKED
from nanotitan.data.sources import DataError
from nanotitan.model.tokens import MASKED as MODEL_MASKED
from tests.helpers.data import write_sft


def _cfg(tmp_path, source) -> DataConfig:
    return DataConfig(source=str(source), vocab_size=300, cache_dir=str(tmp_path / "cache"), format="sft")


def test_prepare_stores_a_loss_mask_on_the_responses(tmp_path):
    src = write_sft(tmp_path / "sft.jsonl")
    out = prepare_data(_cfg(tmp_path, src), log=lambda s: None)
    meta, tok = load_meta(out), load_tokenizer(out)
    assert meta["data_format"] == "sft" and MASKED == MODEL_MASKED
    tokens = np.fromfile(out / "train.bin", dtype=meta["dtype"]).astype(np.int64)
    mask = np.fromfile(out / "train.mask", dtype=np.uint8)
    assert tokens.shape == mask.shape and set(np.unique(mask)) == {0, 1}
    # each example: its prompt masked, its response and its EOT learned
    ends = np.flatnonzero(tokens == meta["eot_id"])
    first = tokens[:ends[0] + 1]
    text = tok.decode(first[mask[:ends[0] + 1] == 0].tolist())
    assert text.startswith("Q:") and text.endswith("A:")
    assert mask[ends].all()
    assert meta["response_tokens"] == int(mask.sum()) + int(np.fromfile(out / "val.mask", np.uint8).sum())
    # the mask is verified on open like the tokens: a damaged one is refused in one line
    damaged = mask.copy()
    damaged[3] = 7
    damaged.tofile(out / "train.mask")
    import os
    os.environ.pop("NANOTITAN_DATA_VERIFIED", None)
    with pytest.raises(DataError, match="train.mask") as err:
        prepare_data(_cfg(tmp_path, src), log=lambda s: None)
    assert "\n" not in str(err.value)


def test_windows_pack_whole_examples_and_target_responses_only(tmp_path):
    src = write_sft(tmp_path / "sft.jsonl", n=80, long_every=9)
    out = prepare_data(_cfg(tmp_path, src), log=lambda s: None)
    meta = load_meta(out)
    batches = open_file(out, "train", 32, seed=3)
    assert batches.truncated > 0  # the long examples: cut at a window's end, counted
    x, y = batches.global_batch(0, 16)
    eot = meta["eot_id"]
    tokens = np.fromfile(out / "train.bin", dtype=meta["dtype"]).astype(np.int64)
    mask = np.fromfile(out / "train.mask", dtype=np.uint8)
    W = 33
    for row, off in enumerate(batches.offsets(0, 16).tolist()):
        whole = tokens[off:off + W]
        eots = np.flatnonzero(whole == eot)
        end = eots[-1] + 1 if len(eots) else len(whole)  # whole examples only; one longer than W is cut at W
        want = np.concatenate([whole[:end], np.full(W - end, eot)])
        assert x[row].tolist() == want[:-1].tolist()
        learn = mask[off + 1:off + W].astype(bool) & (np.arange(1, W) < end)
        assert ((y[row] < MASKED).numpy() == learn).all() and learn.any()
        # every target keeps its token (MTP reads them as inputs); the masked ones marked by + MASKED
        assert (y[row].numpy() % MASKED == want[1:]).all()


@pytest.mark.parametrize("record, words", [({"prompt": "a"}, "'prompt' and 'response'"),
                                           ({"prompt": "a", "response": 3}, "'prompt' and 'response'"),
                                           ({"prompt": "a", "response": ""}, "response is empty")])
def test_bad_records_are_refused_in_one_line(tmp_path, record, words):
    src = write_sft(tmp_path / "sft.jsonl", n=5)
    with open(src, "a") as f:
        f.write(json.dumps(record) + "\n")
    with pytest.raises(DataError, match=words) as err:
        prepare_data(_cfg(tmp_path, src), log=lambda s: None)
    assert "\n" not in str(err.value) and "sft.jsonl:6" in str(err.value)
