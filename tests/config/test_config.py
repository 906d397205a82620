"""Config errors are one line naming the field and the fix; overrides and TOML round-trip."""

import os
import subprocess
import sys
import typing
from dataclasses import fields
from pathlib import Path

import pytest

from nanotitan.config.config import Config, ConfigError, load_config, to_dict, to_toml

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
    from nanotitan.config.config import validate

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


# --- issue 12: every numeric key range-checked, one exact line naming the field and the flag -------------
EXACT = [
    (["--train.eval_batches", "0"], "train.eval_batches=0 with train.eval_every=100: eval needs >= 1 batch "
                                    "(--train.eval_batches 4, or --train.eval_every 0 to disable eval)"),
    (["--train.threads", "-1"], "train.threads=-1 must be >= 0 (--train.threads)"),
    (["--train.beta1", "1.5"], "train.beta1=1.5 must be in [0, 1) (--train.beta1)"),
    (["--train.beta2", "1"], "train.beta2=1.0 must be in [0, 1) (--train.beta2)"),
    (["--train.lr", "inf"], "train.lr=inf must be a finite number (--train.lr)"),
    (["--train.lr", "0"], "train.lr=0.0 must be > 0 (--train.lr)"),
    (["--train.ckpt_every", "-5"], "train.ckpt_every=-5 must be >= 0 (--train.ckpt_every)"),
    (["--train.keep_last", "-1"], "train.keep_last=-1 must be >= 0 (--train.keep_last)"),
    (["--train.max_restarts", "-1"], "train.max_restarts=-1 must be >= 0 (--train.max_restarts)"),
    (["--train.weight_decay", "-0.1"], "train.weight_decay=-0.1 must be >= 0 (--train.weight_decay)"),
    (["--train.peak_flops", "-1"], "train.peak_flops=-1.0 must be >= 0 (--train.peak_flops)"),
    (["--train.sample_tokens", "-1"], "train.sample_tokens=-1 must be >= 0 (--train.sample_tokens)"),
    (["--train.seed", "-1"], "train.seed=-1 must be >= 0 (--train.seed)"),
    (["--train.min_lr_ratio", "2"], "train.min_lr_ratio=2.0 must be in [0, 1] (--train.min_lr_ratio)"),
    (["--model.norm_eps", "0"], "model.norm_eps=0.0 must be > 0 (--model.norm_eps)"),
    (["--model.init_std", "-0.02"], "model.init_std=-0.02 must be > 0 (--model.init_std)"),
    (["--model.rope_theta", "0"], "model.rope_theta=0.0 must be > 0 (--model.rope_theta)"),
    (["--model.max_seq_len", "0"], "model.max_seq_len=0 must be >= 1 (--model.max_seq_len)"),
    (["--model.vocab_size", "300"], "model.vocab_size=300 < data.vocab_size=2048, the trained BPE's size "
                                    "(--model.vocab_size 0 takes the data's)"),
    (["--data.val_fraction", "0.5"], "data.val_fraction=0.5 must be in (0, 0.5) (--data.val_fraction)"),
    (["--data.val_fraction", "nan"], "data.val_fraction=nan must be a finite number (--data.val_fraction)"),
    (["--data.shuffle_buffer", "0"], "data.shuffle_buffer=0 must be >= 1 (--data.shuffle_buffer)"),
    (["--data.max_docs", "-1"], "data.max_docs=-1 must be >= 0 (--data.max_docs)"),
    (["--data.source", " "], "data.source must not be empty (--data.source)"),
    (["--data.text_field", ""], "data.text_field must not be empty (--data.text_field)"),
    (["--parallel.timeout_s", "-inf"], "parallel.timeout_s=-inf must be a finite number (--parallel.timeout_s)"),
    (["--parallel.timeout_s", "1e12"], "parallel.timeout_s=1000000000000.0 must be in (0, 1e9] seconds "
                                       "(--parallel.timeout_s)"),
    (["--parallel.bucket_mb", "0"], "parallel.bucket_mb=0.0 must be > 0 (--parallel.bucket_mb)"),
    (["--run.dir", ""], "run.dir must not be empty (--run.dir)"),
    # RoPE's cos/sin cache has max_seq_len rows: a longer sequence used to pass here and crash in forward.
    (["--train.seq_len", "2048"], "train.seq_len=2048 exceeds model.max_seq_len=1024, the size of the rope "
                                  "position table (--model.max_seq_len 2048)"),
    (["--model.pos_emb", "learned", "--train.seq_len", "2048"],
     "train.seq_len=2048 exceeds model.max_seq_len=1024, the size of the learned position table "
     "(--model.max_seq_len 2048)"),
]


@pytest.mark.parametrize("args,msg", EXACT)
def test_every_range_error_is_one_exact_line(args, msg):
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert str(e.value) == msg


def _numeric_keys(typ):
    cfg = Config()
    for sec in fields(Config):
        for key, t in typing.get_type_hints(type(getattr(cfg, sec.name))).items():
            if t is typ:
                yield f"{sec.name}.{key}"


@pytest.mark.parametrize("name", list(_numeric_keys(int)))
def test_every_int_key_rejects_minus_one_naming_itself(name):
    """No integer setting means anything at -1; a key added without a range check fails here."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"--{name}", "-1"])
    assert str(e.value).startswith(f"{name}=-1 ") and f"(--{name}" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", list(_numeric_keys(float)))
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_key_must_be_finite(name, value):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"--{name}", value])
    assert str(e.value) == f"{name}={float(value)} must be a finite number (--{name})"


def test_rope_sequence_up_to_max_seq_len_runs_and_one_more_is_refused():
    """validate's limit is the model's: seq_len == max_seq_len runs forward, max_seq_len + 1 is refused."""
    import torch

    from nanotitan.model.transformer import Transformer
    from nanotitan.resolve import resolve

    args = ["--model.d_model", "32", "--model.n_layers", "1", "--model.n_heads", "2", "--model.ffn_dim", "32",
            "--model.num_experts", "2", "--data.vocab_size", "300", "--model.max_seq_len", "16"]
    cfg = resolve(load_config(None, args + ["--train.seq_len", "16"]))  # model.vocab_size 0 -> the data's 300
    logits, _ = Transformer(cfg.model).forward(torch.zeros(1, 16, dtype=torch.long))
    assert logits.shape == (1, 16, 300)
    with pytest.raises(ConfigError, match=r"^train.seq_len=17 exceeds model.max_seq_len=16, the size of the rope"):
        load_config(None, args + ["--train.seq_len", "17"])


# --- TOML: typed values, errors name the file and the key -----------------------------------------------
TOML_BAD = [
    ('[train]\nlr = "0.001"\n', "{p}: train.lr must be a number, got '0.001' (drop the quotes: lr = 0.001)"),
    ('[train]\nsteps = 10.0\n', "{p}: train.steps must be an integer, got 10.0"),
    ('[train]\nsteps = true\n', "{p}: train.steps must be an integer, got True"),
    ('[train]\nsteps = "ten"\n', "{p}: train.steps must be an integer, got 'ten'"),
    ('[run]\ntensorboard = "false"\n', "{p}: run.tensorboard must be true or false, got 'false'"),
    ('[parallel]\npp = 2\npp_layers = "2,2"\n', "{p}: parallel.pp_layers must be a list, got '2,2'"),
    ('[parallel]\npp = 2\npp_layers = [2, "2"]\n',
     "{p}: parallel.pp_layers must be a number, got '2' (drop the quotes: pp_layers = 2)"),
    ('[data]\nsource = 5\n', "{p}: data.source must be a string, got 5"),
    ('[model]\npos_emb = "alibi"\n', "{p}: model.pos_emb='alibi' is not one of ['rope', 'learned']"),
    ('lr = 0.1\n', "{p}: top-level key 'lr' must be a [section] table"),
    # range errors of values set in the file name the file, then the flag that would override it
    ('[train]\nlr = inf\n', "{p}: train.lr=inf must be a finite number (--train.lr)"),
    ('[train]\nbeta1 = 1.5\n', "{p}: train.beta1=1.5 must be in [0, 1) (--train.beta1)"),
    ('[train]\nseq_len = 4096\n', "{p}: train.seq_len=4096 exceeds model.max_seq_len=1024, the size of the rope "
                                  "position table (--model.max_seq_len 4096)"),
]


@pytest.mark.parametrize("body,msg", TOML_BAD)
def test_toml_errors_name_the_file_and_key(tmp_path, body, msg):
    p = tmp_path / "x.toml"
    p.write_text(body)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value) == msg.format(p=p)


def test_toml_unknown_keys_bad_syntax_and_bytes_name_the_file(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text("[model]\nnope = 1\n")
    with pytest.raises(ConfigError, match=rf"^{p}: unknown config key model.nope \(valid keys in \[model\]: "):
        load_config(p)
    p.write_text("[train\n")
    with pytest.raises(ConfigError, match=rf"^config file {p} is not valid TOML: .*line 1"):
        load_config(p)
    p.write_bytes(b"[train]\nlr = 0.1 # caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"^config file {p} is not UTF-8 text \(invalid continuation byte"):
        load_config(p)
    with pytest.raises(ConfigError, match=rf"^config file {tmp_path} is not a file \(--config PATH\)$"):
        load_config(tmp_path)


def test_cli_strings_are_parsed_and_their_errors_name_the_flag_not_the_file(tmp_path):
    p = tmp_path / "x.toml"
    p.write_text("[train]\nbeta1 = 1.5\nlr = 1\n")  # an integer where a float belongs is fine in TOML
    assert load_config(p, ["--train.beta1", "0.8"]).train.lr == 1.0
    with pytest.raises(ConfigError) as e:
        load_config(p, ["--train.beta1", "2"])  # the bad value is the flag's, so no file is named
    assert str(e.value) == "train.beta1=2.0 must be in [0, 1) (--train.beta1)"


def test_cli_one_line_before_anything_runs(tmp_path):
    """The launcher prints one line and exits 2: a TOML type error, and a run dir under a file, the latter
    before data prep (whose missing source would be the error otherwise) and before any rank starts."""
    p = tmp_path / "x.toml"
    p.write_text('[train]\nlr = "0.001"\n')
    blocker = tmp_path / "somefile"
    blocker.write_text("")
    cases = [(["--config", str(p)], f"{p}: train.lr must be a number, got '0.001' (drop the quotes: lr = 0.001)"),
             (["--parallel.dp", "2", "--data.source", str(tmp_path / "none/*.txt"), "--run.dir", f"{blocker}/x"],
              f"run.dir='{blocker}/x' cannot be created: {blocker} is a file, not a directory (--run.dir DIR)")]
    for args, msg in cases:
        r = subprocess.run([sys.executable, "-m", "nanotitan.cli", "train", *args],
                           capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stderr.splitlines(), r.stdout) == (2, [f"nanotitan: config error: {msg}"], "")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["somefile", "x.toml"]


LANES = ["--parallel.ep_overlap_microbatches", "true"]


@pytest.mark.parametrize("args,msg", [
    (LANES + ["--parallel.microbatches", "4"], "parallel.ep_overlap_microbatches hides EP all-to-alls, and "
     "parallel.ep=1 has none (--parallel.ep 2, or --parallel.ep_overlap_microbatches false)"),
    (LANES + ["--parallel.ep", "2"], "parallel.ep_overlap_microbatches runs one microbatch's forward beside another's "
     "backward: parallel.microbatches=1 must be >= 2 (--parallel.microbatches 4, or "
     "--parallel.ep_overlap_microbatches false)"),
    (LANES + ["--parallel.ep", "2", "--parallel.dp", "2", "--parallel.microbatches", "2", "--parallel.zero", "3"],
     "parallel.ep_overlap_microbatches runs with zero 0-2: FSDP2's hooks (zero 3) are not safe in two threads at "
     "once (--parallel.zero 2, or --parallel.ep_overlap_microbatches false)"),
    (LANES + ["--parallel.ep", "2", "--parallel.microbatches", "2", "--train.device", "cuda"],
     "parallel.ep_overlap_microbatches runs on CPU (gloo) only: on CUDA each lane needs its own stream, not built "
     "yet (docs/ep.md) (--train.device cpu, or --parallel.ep_overlap_microbatches false)"),
])
def test_ep_overlap_microbatches_refuses_what_it_does_not_run(args, msg):
    """The two-lane mode is refused, in one line naming the field and the fix, where it is not built."""
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert str(e.value) == msg


def test_ep_overlap_microbatches_is_off_by_default_and_accepted_at_pp1():
    assert Config().parallel.ep_overlap_microbatches is False
    cfg = load_config(None, LANES + ["--parallel.ep", "2", "--parallel.microbatches", "4", "--parallel.dp", "2",
                                     "--parallel.zero", "2", "--parallel.ep_overlap", "true"])
    assert cfg.parallel.ep_overlap_microbatches
    for schedule in ("1f1b", "zb1"):  # and under a pipeline, with the schedules that have a steady phase
        cfg = load_config(None, LANES + ["--parallel.ep", "2", "--parallel.pp", "2", "--parallel.microbatches", "4",
                                         "--parallel.schedule", schedule])
        assert cfg.parallel.ep_overlap_microbatches


STATIC = ["--parallel.ep_dispatch", "static", "--parallel.ep", "2", "--model.experts_impl", "grouped"]
WHY_STATIC = "parallel.ep_dispatch=static keeps every split size on the device, and "


@pytest.mark.parametrize("args,msg", [
    (["--parallel.ep_capacity", "0.9"], "parallel.ep_capacity=0.9 must be >= 1: each peer's buffer holds that many "
     "times its expected share, and below 1 even a balanced router overflows (--parallel.ep_capacity 1.25)"),
    (STATIC[:2], WHY_STATIC + "parallel.ep*cp*tp=1 dispatches nothing (--parallel.ep 2, or --parallel.ep_dispatch "
     "dynamic)"),
    (STATIC[:4], WHY_STATIC + "model.experts_impl=loop may run one GEMM per expert, sized by counts read to the host "
     "(--model.experts_impl grouped, or --parallel.ep_dispatch dynamic)"),
    (STATIC[:4] + ["--model.experts_impl", "auto"], WHY_STATIC + "model.experts_impl=auto may run one GEMM per "
     "expert, sized by counts read to the host (--model.experts_impl grouped, or --parallel.ep_dispatch dynamic)"),
    (STATIC + ["--parallel.ep_overlap", "true"], WHY_STATIC + "parallel.ep_overlap cuts each trip into groups by host "
     "counts (--parallel.ep_overlap false, or --parallel.ep_dispatch dynamic)"),
])
def test_static_dispatch_refuses_what_needs_host_sizes(args, msg):
    """parallel.ep_dispatch static is refused, in one line naming the field and the fix, beside an option that would
    read a split size to the host."""
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert str(e.value) == msg


@pytest.mark.parametrize("args,msg", [
    (["--train.cuda_graphs", "true", "--train.compile", "true", "--train.device", "cpu"], "train.cuda_graphs=true "
     "records CUDA graphs, and train.device=cpu has no CUDA stream (--train.cuda_graphs false, or --train.device cuda)"),
    (["--train.cuda_graphs", "true"], "train.cuda_graphs=true replays the compiled blocks' graphs (torch.compile mode "
     "reduce-overhead), and train.compile=false compiles none (--train.compile true)"),
])
def test_cuda_graphs_refused_on_cpu_and_without_compile(args, msg):
    with pytest.raises(ConfigError) as e:
        load_config(None, args)
    assert str(e.value) == msg


def test_static_dispatch_is_off_by_default_and_accepted_with_grouped_experts():
    assert (Config().parallel.ep_dispatch, Config().parallel.ep_capacity) == ("dynamic", 1.25)
    cfg = load_config(None, STATIC + ["--parallel.expert_placement", "balanced", "--parallel.expert_replicas", "2",
                                      "--parallel.ep_capacity", "1"])
    assert (cfg.parallel.ep_dispatch, cfg.parallel.ep_capacity) == ("static", 1.0)


def _unenterable(monkeypatch, locked):
    """os.stat as a user without search permission on `locked` sees it: anything below it raises EACCES. Root is
    not stopped by chmod, so the tests that run as root simulate the kernel's answer this way."""
    real = os.stat

    def stat(path, *args, **kwargs):
        if Path(path) != Path(locked) and Path(locked) in Path(path).parents:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)


def test_run_dir_under_a_directory_that_cannot_be_entered_is_one_config_line(tmp_path, monkeypatch):
    """issue 39: Path.exists raised PermissionError inside validate (a traceback); now one line names the dir."""
    locked = tmp_path / "locked"
    locked.mkdir()
    _unenterable(monkeypatch, locked)
    for run_dir in (locked / "run", locked / "a" / "b"):
        with pytest.raises(ConfigError) as e:
            load_config(None, ["--run.dir", str(run_dir)])
        assert str(e.value) == (f"run.dir={str(run_dir)!r} cannot be created: {locked} cannot be entered "
                                "(permission denied) (--run.dir DIR)")
    assert load_config(None, ["--run.dir", str(locked)]).run.dir == str(locked)  # itself: stat-able, a directory


@pytest.mark.skipif(os.geteuid() == 0, reason="root enters any directory: the monkeypatched test above covers it")
def test_run_dir_under_a_chmod_000_directory_is_one_config_line(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        with pytest.raises(ConfigError, match=f"{locked} cannot be entered \\(permission denied\\)"):
            load_config(None, ["--run.dir", str(locked / "run")])
    finally:
        locked.chmod(0o755)


def test_config_state_is_per_instance_not_a_field():
    """explicit and resolved are each instance's own (not dataclass fields, not class variables)."""
    a, b = load_config(None, ["--train.lr", "0.01"]), Config()
    assert a.explicit == frozenset({"train.lr"}) and b.explicit is None and not hasattr(Config, "explicit")
    assert "explicit" not in to_dict(a) and "resolved" not in [f.name for f in fields(Config)]
    a.resolved = True
    assert not b.resolved and not Config().resolved
