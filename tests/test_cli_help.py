"""`nanotitan --help` and `nanotitan COMMAND --help`: every command answers, and the config commands list
every key of every section with its type, its default and a meaning (the field's comment in config.py)."""

import dataclasses
import re
import types
import typing
from typing import Literal

import pytest

from nanotitan import cli
from nanotitan.config import config, parse


def _help(argv, capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse-based commands exit after printing their help
        code = e.code
    return code, capsys.readouterr().out


def _sections():
    hints = typing.get_type_hints(config.Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(config.Config)}


@pytest.mark.parametrize("argv", [["train", "--help"],
                                  ["train", "--config", "nope.toml", "--model.d_model", "8", "-h"]])
def test_config_help_lists_every_key_with_type_default_and_meaning(argv, capsys):
    """Each field appears once as `--section.key TYPE (default) — meaning`; the default, typed back on the
    command line, gives the field's real default, and the type names the field's type or its choices."""
    code, out = _help(argv, capsys)
    assert code == 0
    lines = {m.group(1): m for m in re.finditer(r"^\s+--(\w+\.\w+) (\S+) \((.*)\)\s+— (.*)$", out, re.MULTILINE)}
    for section, cls in _sections().items():
        assert f"[{section}]" in out
        hints, defaults = typing.get_type_hints(cls), cls()
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            assert key in lines, f"--{key} missing from the help"
            _, typ_text, default_text, meaning = lines[key].groups()
            assert meaning.strip(), f"{key} has no meaning: add a trailing # comment to its field in config.py"
            typ = hints[f.name]
            if typing.get_origin(typ) is Literal:
                assert set(typ_text.strip("{}").split(",")) == set(typing.get_args(typ)), key
            elif typing.get_origin(typ) in (typing.Union, types.UnionType):  # one part per member, e.g. list[int]|{auto}
                assert len(typ_text.split("|")) == len(typing.get_args(typ)), key
            else:
                assert typ_text == getattr(typ, "__name__", None) or typ_text == str(typ).replace("typing.", ""), key
            shown = default_text[1:-1] if default_text.startswith('"') else default_text
            assert parse.coerce(shown, typ, key) == getattr(defaults, f.name), (key, default_text)
    n_fields = sum(len(dataclasses.fields(cls)) for cls in _sections().values())
    assert len(lines) == n_fields  # and nothing else looks like a key


def test_every_command_answers_help(capsys):
    code, out = _help(["--help"], capsys)
    assert code == 0
    for name in cli.COMMANDS:
        assert name in out.split("commands:")[1]
    for name in cli.COMMANDS:
        code, out = _help([name, "--help"], capsys)
        assert code == 0, name
        assert f"nanotitan {name}" in out, (name, out[:300])


def test_sub_command_help_is_its_own_and_unknown_commands_fail(capsys):
    code, out = _help(["bench", "layouts", "--help"], capsys)
    assert code == 0 and "--gpus" in out  # bench layouts' argparse, not the bench docstring
    assert cli.main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err


def test_every_meaning_is_whole_and_names_each_choice():
    """A key with choices explains each of them by name; no meaning stops mid-phrase (on an article, a conjunction
    or a relative pronoun, before an optional docs pointer)."""
    from nanotitan.config.help import section_keys

    dangling = {"a", "an", "the", "of", "whose", "which", "and", "or", "its", "by", "with", "per", "gathered"}
    for section, cls in _sections().items():
        hints = typing.get_type_hints(cls)
        for key, _, _, meaning in section_keys(section, cls):
            typ = hints[key.split(".")[1]]
            choices = [c for t in (typ, *typing.get_args(typ)) if typing.get_origin(t) is Literal
                       for c in typing.get_args(t)]
            words = set(re.findall(r"[\w-]+", meaning))
            assert all(str(c) in words for c in choices), (key, choices, meaning)
            last = re.sub(r"\s*\([^()]*\)$", "", meaning).split()[-1].lower()
            assert last not in dangling, (key, meaning)


def test_bench_help_lists_the_benches_and_data_help_only_data_keys(capsys):
    code, out = _help(["bench", "--help"], capsys)
    assert code == 0 and "BENCHES" not in out
    for name, what in cli.BENCHES.items():
        assert re.search(rf"^  {name} +{re.escape(what)}$", out, re.MULTILINE), name
    code, out = _help(["data", "prepare", "--help"], capsys)
    keys = set(re.findall(r"^\s+--(\w+)\.\w+ ", out, re.MULTILINE))
    assert code == 0 and keys == {"data"} and "[train]" not in out, keys
