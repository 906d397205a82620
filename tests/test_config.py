"""Config errors are one line naming the field and the fix; overrides and TOML round-trip."""

import subprocess
import sys

import pytest

from nanotitan.config import ConfigError, load_config, to_toml

BAD = [
    (["--model.n_heads", "3"], "model.n_heads=3 must divide model.d_model"),
    (["--model.top_k", "9"], "model.top_k=9 must be <= model.num_experts"),
    (["--model.nope", "1"], "unknown config key model.nope"),
    (["--modle.d_model", "1"], "unknown config section [modle]"),
    (["--model.d_model", "abc"], "model.d_model must be an integer"),
    (["--train.lr", "fast"], "train.lr must be a number"),
    (["--parallel.schedule", "zb"], "parallel.schedule='zb' is not one of"),
    (["--parallel.ep", "3"], "parallel.ep=3 must divide model.num_experts"),
    (["--parallel.pp", "9"], "parallel.pp=9 stages need at least as many layers"),
    (["--parallel.pp", "2", "--parallel.pp_layers", "1,1"], "parallel.pp_layers=[1, 1] must list 2"),
    (["--parallel.dp_impl", "torch_ddp", "--parallel.ep", "2"], "dp_impl=torch_ddp supports pure DP only"),
    (["--train.resume", "/nonexistent/ckpt"], "no such checkpoint"),
    (["--data.vocab_size", "100"], "data.vocab_size=100 must be >= 260"),
    (["--run.tensorboard", "maybe"], "run.tensorboard must be true or false"),
    (["--train.micro_batch", "0"], "train.micro_batch=0 must be >= 1"),
]


@pytest.mark.parametrize("args,msg", BAD)
def test_bad_config_one_clear_line(args, msg):
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert msg in str(e.value)
    assert "\n" not in str(e.value)


def test_world_size_mismatch():
    from nanotitan.config import validate

    cfg = load_config(None, ["--parallel.dp", "2", "--parallel.ep", "2"])
    with pytest.raises(ConfigError, match="world size 3 != parallel.dp\\*pp\\*ep"):
        validate(cfg, world_size=3)


def test_toml_and_overrides_round_trip(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[model]\nd_model = 64\nn_heads = 2\n[parallel]\npp_layers = [3, 1]\npp = 2\n')
    cfg = load_config(p, ["--model.n_layers", "4", "--train.lr=1e-3", "--run.tensorboard", "false"])
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.train.lr, cfg.run.tensorboard) == (64, 4, 1e-3, False)
    assert cfg.parallel.pp_layers == [3, 1]
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))
    assert load_config(again) == cfg


def test_cli_rejects_bad_config_before_anything_runs():
    r = subprocess.run([sys.executable, "-m", "nanotitan.cli", "train", "--model.top_k", "7"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "nanotitan: config error: model.top_k=7 must be <= model.num_experts=4 (--model.top_k)"]
