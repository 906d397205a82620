"""`nanotitan verify --hf DIR [--hf-export]`: a transformers checkpoint imports with every tensor where it belongs and
logits equal to transformers', and exports back bit for bit; an import that skips an expert (its rows left at their
random init, as in Megatron #5844) is named by that expert's tensor. Cost: ~5 s in-process."""

import pytest
import torch

from nanotitan import cli
from nanotitan.interop import hf
from tests.helpers.hf import _randomise

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    config = transformers.MixtralConfig(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=24, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=32, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomise(model.parameters(), seed=0)
    out = tmp_path_factory.mktemp("mixtral")
    model.save_pretrained(out)
    return out


def test_an_import_and_its_export_are_exact(mixtral, capsys):
    assert cli.main(["verify", "--hf", str(mixtral), "--hf-export"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].endswith("(mixtral) imported and exported") and out[-1].startswith("verify: equal ("), out


def test_an_expert_the_import_skips_is_named(mixtral, capsys, monkeypatch, tmp_path):
    load = hf._load_experts

    def skip_expert_1(r, family, layer, which, p, e0, name):
        kept = p[1].clone()
        load(r, family, layer, which, p, e0, name)
        if layer == 1:
            p[1].copy_(kept)  # expert 1 of layer 1 keeps its init
    monkeypatch.setattr(hf, "_load_experts", skip_expert_1)
    assert cli.main(["verify", "--hf", str(mixtral), "--json", str(tmp_path / "hf.json")]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("verify: first divergence: import model.layers.1.block_sparse_moe.experts.1.w1.weight"), last
