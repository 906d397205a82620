"""`nanotitan generate` against transformers as the oracle: greedy decoding with our KV cache gives transformers'
tokens, token for token, on a checkpoint `nanotitan export` wrote (GQA, Qwen3's per-head q/k norms, DeepSeek-V3's MLA
with YaRN); our temperature, top-k and top-p filters are transformers' logits warpers; bad flags and a non-empty
export folder are refused in one line. Cost: ~25 s on a busy 2-core machine, most of it importing transformers."""

import pytest
import torch

from nanotitan import cli
from nanotitan.config.config import ConfigError
from nanotitan.generate import Sampling, filter_logits, generate_from_run, load_full_model, picker
from nanotitan.model.transformer import Transformer
from nanotitan.state import checkpoint as ckpt
from tests.helpers.hf import DS_OPTIONS, _randomise, tiny_config

V = 300
# our options -> the family the export picks. OLMoE's whole-projection q/k norm is held to the full forward in
# tests/model/test_kv_cache.py (whose every logit test_hf.py holds to transformers): one model load less here.
FAMILIES = {
    "mixtral": ["--model.n_kv_heads", "2"],
    "qwen3_moe": ["--model.qk_norm", "head", "--model.head_dim", "12", "--model.n_kv_heads", "2"],
    "deepseek_v3": [*DS_OPTIONS, "--model.bias_update_rate", "0"],
}


@pytest.fixture(scope="module")
def tokenizer(corpus_dir, tmp_path_factory):
    from nanotitan.data.tokenizer import train_bpe

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe([p.read_text() for p in sorted(corpus_dir.glob("*.txt"))[:5]], V).save(str(path))
    return path


def _run(family, tokenizer, root):
    """A run dir holding one checkpoint of a random model of `family`, and its export (`nanotitan export`)."""
    run, out = root / family / "run", root / family / "hf"
    cfg = tiny_config(V, 8 if family == "deepseek_v3" else 4, 64, *FAMILIES[family], "--data.tokenizer",
                      str(tokenizer), "--run.dir", str(run))
    model = Transformer(cfg.model, seed=3)
    _randomise(model.parameters(), seed=5)
    ckpt.save_checkpoint(run, 1, model, None, None, cfg)
    assert cli.main(["export", "--run.dir", str(run), "--out", str(out)]) == 0
    return cfg, run, out


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_equals_transformers_on_the_export(family, tokenizer, tmp_path, capsys):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    cfg, run, out = _run(family, tokenizer, tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(out).eval()
    ref.generation_config.eos_token_id = None  # ours does not stop at the end-of-text token: compare every token
    tok = Tokenizer.from_file(str(tokenizer))
    prompt = "the king and the queen"
    ids = torch.tensor([tok.encode(prompt).ids])
    with torch.no_grad():
        theirs = ref.generate(ids, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids))
    ours = load_full_model(run)[1].generate(ids, 12, picker(Sampling(greedy=True)))
    assert torch.equal(ours, theirs), (ours, theirs)
    if family != "mixtral":
        return
    capsys.readouterr()  # the command prints those tokens' text
    assert cli.main(["generate", "--run.dir", str(run), "--prompt", prompt, "--greedy", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == tok.decode(theirs[0].tolist())


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 50, 1.0), (1.3, 0, 0.9), (0.5, 20, 0.6),
                                                     (1.0, 1, 0.3), (2.0, 300, 0.05)])
def test_filters_are_transformers_logits_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(top_k)) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
                                  + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
    theirs = warpers(None, logits.clone())
    ours = filter_logits(logits, Sampling(temperature, top_k, top_p))
    assert torch.equal(ours, theirs)
    assert (ours > -float("inf")).sum(-1).min() >= 1


def test_bad_flags_and_a_full_export_folder_are_refused_in_one_line(tokenizer, tmp_path, capsys):
    _, run, out = _run("mixtral", tokenizer, tmp_path)
    for flags, line in [(["--top-p", "0"], "--top-p 0.0 must be in (0, 1] (1 keeps every token)"),
                        (["--top-p", "1.5"], "--top-p 1.5 must be in (0, 1] (1 keeps every token)"),
                        (["--temperature", "0"], "--temperature 0.0 must be > 0 (or --greedy for the likeliest token)"),
                        (["--top-k", "-1"], "--top-k -1 must be >= 0 (0 keeps every token)"),
                        (["--max-new-tokens", "-2"], "--max-new-tokens -2 must be >= 0")]:
        assert cli.main(["generate", "--run.dir", str(run), *flags]) == 2
        assert capsys.readouterr().err == f"nanotitan: config error: {line}\n"
    with pytest.raises(ConfigError, match="top-p"):
        generate_from_run(str(run), "x", 3, sampling=Sampling(top_p=2.0))
    assert cli.main(["export", "--run.dir", str(run), "--out", str(out)]) == 2  # written by _run: not empty
    assert capsys.readouterr().err == (f"nanotitan: config error: --out {str(out)!r} is not empty: export into a new "
                                       "or empty directory, or add --force to write over it\n")
    assert cli.main(["export", "--run.dir", str(run), "--out", str(out), "--force"]) == 0


def test_sft_format_prints_the_answer_alone_up_to_its_eot():
    """--format sft: the continuation after the prompt's tokens, cut at the first EOT (data/sft.py's examples end
    there); text keeps the prompt and everything generated."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from nanotitan.generate import sample

    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "q": 1, "a": 2, "b": 3, "[UNK]": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()

    class Scripted:  # generates a, b, EOT, a after any prompt
        def generate(self, idx, n, pick):
            return torch.cat([idx, torch.tensor([[2, 3, 0, 2]])], 1)[:, :idx.shape[1] + n]

    assert sample(Scripted(), tok, "q", 4, Sampling(greedy=True), "sft") == "a b"
    assert sample(Scripted(), tok, "q", 2, Sampling(greedy=True), "sft") == "a b"  # no EOT yet: all of it
    assert sample(Scripted(), tok, "q", 4, Sampling(greedy=True)).split() == ["q", "a", "b", "<|endoftext|>", "a"]
