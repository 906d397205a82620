"""SFT records as conversations (data/chat.py): `messages` rendered with the tokenizer's chat template exactly as
transformers renders it, the assistant turns (and the template's end of turn) learned, the rest masked; the template
kept with the prepared data for generation; bad conversations and templates refused in one line."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

from nanotitan.config.config import DataConfig
from nanotitan.data import chat
from nanotitan.data.prepare import load_meta, prepare_data
from nanotitan.data.sources import DataError

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
          " + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TALK = [{"role": "system", "content": "Answer in fruit."},
        {"role": "user", "content": "apple and pear?"}, {"role": "assistant", "content": "pear then apple."},
        {"role": "user", "content": "moon and kite?"}, {"role": "assistant", "content": "kite then moon."}]


def _tokenizer(d, template=CHATML):
    """A byte-level BPE with ChatML's special tokens and EOT, and a tokenizer_config.json holding `template`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = "apple pear moon kite then and answer in fruit system user assistant".split()
    tok.train_from_iterator(words * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|im_end|>"}))
    return d / "tokenizer.json"


def _records(path, n=40, extra=()):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": TALK[:3] if i % 2 else TALK}) + "\n")
        f.write(json.dumps({"prompt": "Q: egg?\nA:", "response": " egg."}) + "\n")  # both forms in one file
        for r in extra:
            f.write(json.dumps(r) + "\n")
    return path


def test_the_template_renders_as_transformers_renders_it(tmp_path):
    from transformers import PreTrainedTokenizerFast

    path = _tokenizer(tmp_path / "tok")
    ours = chat.load(str(path))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path), chat_template=CHATML)
    for gen in (False, True):
        assert ours.render(TALK[:2], add_generation_prompt=gen) == hf.apply_chat_template(
            TALK[:2], tokenize=False, add_generation_prompt=gen)
    spans = ours.spans(TALK, "x")
    assert "".join(t for t, _ in spans) == hf.apply_chat_template(TALK, tokenize=False)
    assert [t for t, learned in spans if learned] == ["pear then apple.<|im_end|>\n", "kite then moon.<|im_end|>\n"]


def test_prepare_learns_the_assistant_turns_only(tmp_path):
    path = _tokenizer(tmp_path / "tok")
    src = _records(tmp_path / "talk.jsonl")
    cfg = DataConfig(source=str(src), tokenizer=str(path), cache_dir=str(tmp_path / "cache"), format="sft")
    out = prepare_data(cfg, log=lambda s: None)
    meta, tok = load_meta(out), Tokenizer.from_file(str(out / "tokenizer.json"))
    tokens = np.concatenate([np.fromfile(out / f"{s}.bin", dtype=meta["dtype"]) for s in ("train", "val")])
    mask = np.concatenate([np.fromfile(out / f"{s}.mask", dtype=np.uint8) for s in ("train", "val")])
    eot = meta["eot_id"]
    learned = tok.decode(tokens[mask == 1].tolist(), skip_special_tokens=False)
    assert "then" in learned and "user" not in learned and "?" not in learned and "fruit" not in learned
    assert learned.count("<|im_end|>") == learned.count("then")  # each answer learns its end of turn
    assert mask[tokens == eot].all()  # every example ends on an assistant turn (or a response): its EOT learned
    assert chat.load(str(out / "tokenizer.json")).text == CHATML  # kept for generation
    # another template is other data: another prepared dir
    path2 = _tokenizer(tmp_path / "tok2", CHATML.replace("\\n", " "))
    cfg2 = DataConfig(source=str(src), tokenizer=str(path2), cache_dir=str(tmp_path / "cache"), format="sft")
    assert prepare_data(cfg2, log=lambda s: None) != out


@pytest.mark.parametrize("record, template, words", [
    ({"messages": [{"role": "user", "content": "hi"}]}, CHATML, "no assistant turn"),
    ({"messages": [{"role": "user"}]}, CHATML, "'messages' must be a list"),
    ({"messages": TALK}, "{{ messages[-1]['content'] }}", "does not render this conversation turn by turn"),
    ({"messages": TALK}, None, "has none"),
])
def test_bad_conversations_and_templates_are_refused_in_one_line(tmp_path, record, template, words):
    path = _tokenizer(tmp_path / "tok", template or CHATML)
    if template is None:
        (path.parent / "tokenizer_config.json").unlink()
    src = tmp_path / "talk.jsonl"
    src.write_text(json.dumps({"prompt": "a", "response": " b"}) + "\n" + json.dumps(record) + "\n")
    cfg = DataConfig(source=str(src), tokenizer=str(path), cache_dir=str(tmp_path / "cache"), format="sft")
    with pytest.raises(DataError, match=words) as err:
        prepare_data(cfg, log=lambda s: None)
    assert "\n" not in str(err.value) and "talk.jsonl:2" in str(err.value)


def test_generation_renders_the_prompt_as_a_user_turn(tmp_path):
    """`generate --format sft` on data prepared with a template: the prompt is the user turn plus the generation
    prompt, as training saw the assistant's turns open; the answer stops at EOT."""
    import torch

    from nanotitan.generate import sample

    path = _tokenizer(tmp_path / "tok")
    tok, template = Tokenizer.from_file(str(path)), chat.load(str(path))
    answer = tok.encode("kite then moon.<|im_end|>\n", add_special_tokens=False).ids
    answer.append(tok.token_to_id("<|endoftext|>"))
    seen = []

    class Model:
        def generate(self, ids, n, pick):
            seen.append(ids[0].tolist())
            return torch.tensor([ids[0].tolist() + answer])

    out = sample(Model(), tok, "moon and kite?", 8, fmt="sft", template=template)
    prompt = "<|im_start|>user\nmoon and kite?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(seen[0], skip_special_tokens=False) == prompt
    assert out == "kite then moon.\n"
