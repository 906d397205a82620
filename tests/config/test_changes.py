"""What differs between two configs (config/changes.py), the "did you mean" of an unknown key (parse.py) and whose
fault a bad value is: the config file's or the command line's (config.py load_config)."""

import pytest

from nanotitan.config.changes import UNSET, change_lines, changes_in_brief, config_changes
from nanotitan.config.config import ConfigError, load_config
from nanotitan.config.parse import did_you_mean


def test_changes_list_every_differing_key_but_the_intent_keys():
    old = {"train": {"steps": 300, "lr": 3e-3, "resume": "", "seed": 1}, "data": {"source": "a"}, "model": {"gone": 1}}
    new = {"train": {"steps": 600, "lr": 0.003, "resume": "auto", "seed": 1, "allow_data_change": True},
           "data": {"source": "b"}, "model": {}}
    changes = config_changes(old, new)
    assert changes == [("train.steps", 300, 600), ("data.source", "a", "b"), ("model.gone", 1, UNSET)]
    assert change_lines(changes) == ['train.steps: 300 -> 600', 'data.source: "a" -> "b"', "model.gone: 1 -> (unset)"]
    assert config_changes(new, new) == [] and config_changes({"t": {"x": 3}}, {"t": {"x": 3.0}}) == []
    assert changes_in_brief(changes * 2, most=4).endswith("; and 2 more")
    # a key the old config lacks (a checkpoint older than the key) at its default is no change; off it, it is one
    assert config_changes({"train": {}}, {"train": {"lr_schedule": "cosine"}}) == []
    assert config_changes({"train": {}}, {"train": {"lr_schedule": "wsd"}}) == [("train.lr_schedule", UNSET, "wsd")]


@pytest.mark.parametrize("section, key, hint", [
    ("train", "lrr", "; did you mean train.lr?"),
    ("model", "lr", "; did you mean train.lr?"),  # the right key in another section
    ("parallel", "zero3_reshards", "; did you mean parallel.zero3_reshard?"),
    ("trian", "steps", "; did you mean train.steps?"),
    ("model", "nope", ""),  # nothing close: no guess
])
def test_an_unknown_key_gets_the_closest_names(section, key, hint):
    from nanotitan.config.config import Config

    assert did_you_mean(Config(), section, key) == hint
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"--{section}.{key}", "1"])
    assert hint in str(e.value) and str(e.value).count("\n") == 0


def test_a_command_line_value_is_blamed_on_the_command_line(tmp_path):
    """model.top_k from the command line against the file's model.num_experts: the command line's fault (no file
    prefix); the same value from the file is the file's."""
    toml = tmp_path / "c.toml"
    toml.write_text("[model]\nnum_experts = 4\n")
    with pytest.raises(ConfigError, match=r"^model\.top_k=8 must be <= model\.num_experts=4 \(--model\.top_k\)$"):
        load_config(str(toml), ["--model.top_k", "8"])
    toml.write_text("[model]\nnum_experts = 4\ntop_k = 8\n")
    with pytest.raises(ConfigError, match=rf"^{toml}: model\.top_k=8 must be <= model\.num_experts=4"):
        load_config(str(toml))
