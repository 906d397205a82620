"""Chat records for SFT (data.format=sft, docs/packed.md): `messages` rendered with the tokenizer's chat template.

A record `{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}` becomes
the text the template renders, cut into spans: the assistant turns' spans are learned, the rest (system, user, the
template's own markup before each answer) is not. The template is the one transformers would apply: the
`chat_template` of the `tokenizer_config.json` beside `data.tokenizer`, rendered by jinja2 in a sandbox as
transformers renders it (trim_blocks, lstrip_blocks, `raise_exception`, `tojson`, the special tokens by name).

An assistant turn's span is what rendering the conversation up to and including it adds to rendering it up to just
before it with the generation prompt: its content and the template's end of turn, which the model must learn to
produce. A template that does not render a conversation as the concatenation of its turns (one that rewrites
earlier turns once a later one exists) is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .sources import DataError

ROLES_LEARNED = ("assistant",)


class ChatTemplate:
    """The tokenizer's chat template (`load`), rendering a conversation into (text, learned) spans."""

    def __init__(self, source: str, template: str, special: dict[str, str]):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        self.source, self.text, self.special = source, template, special
        self.template = env.from_string(template)

    @property
    def digest(self) -> str:
        """The template's identity in the prepared data's key: another template, other tokens."""
        return hashlib.sha1(self.text.encode()).hexdigest()

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)

    def spans(self, messages: list[dict], where: str) -> list[tuple[str, bool]]:
        """(text, learned) spans whose concatenation is the whole conversation's rendering (module docstring)."""
        out, done = [], ""
        for i, m in enumerate(messages):
            if m["role"] not in ROLES_LEARNED:
                continue
            before, upto = self.render(messages[:i], add_generation_prompt=True), self.render(messages[:i + 1])
            if not (before.startswith(done) and upto.startswith(before)):
                raise DataError(f"{where}: the chat template of {self.source} does not render this conversation turn "
                                "by turn (an earlier turn changes once a later one follows); write the record as "
                                "prompt/response")
            out += [(before[len(done):], False), (upto[len(before):], True)]
            done = upto
        whole = self.render(messages)
        if not whole.startswith(done):
            raise DataError(f"{where}: the chat template of {self.source} renders the whole conversation differently "
                            "from its turns; write the record as prompt/response")
        out.append((whole[len(done):], False))
        return [(text, learned) for text, learned in out if text]


def load(tokenizer_path: str) -> ChatTemplate | None:
    """The chat template beside a tokenizer.json (its folder's tokenizer_config.json), None when it has none."""
    if not tokenizer_path:
        return None
    cfg_path = Path(tokenizer_path).expanduser().resolve().parent / "tokenizer_config.json"
    if not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text())
    except ValueError as e:
        raise DataError(f"{cfg_path} is not valid JSON ({e}); save it again, or move it away to read no chat "
                        "template") from None
    template = cfg.get("chat_template") if isinstance(cfg, dict) else None
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not template:
        return None
    special = {k: (v["content"] if isinstance(v, dict) else v) for k, v in cfg.items()
               if k.endswith("_token") and isinstance(v, (str, dict))}
    return ChatTemplate(str(cfg_path), template, special)


def save_beside(template: ChatTemplate | None, tokenizer_json: Path) -> None:
    """Keep the template with a prepared tokenizer.json, so that generation renders prompts as training did."""
    if template is not None:
        config = {"chat_template": template.text, **template.special}
        (tokenizer_json.parent / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")


def check_messages(messages, where: str) -> None:
    """A `messages` list of {"role": str, "content": str} with at least one assistant turn, or one line naming it."""
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages)
    if not ok:
        raise DataError(f"{where}: 'messages' must be a list of {{\"role\": ..., \"content\": ...}} strings")
    if not any(m["role"] in ROLES_LEARNED for m in messages):
        raise DataError(f"{where}: the conversation has no assistant turn to learn; add one or drop the record")
