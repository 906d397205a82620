"""resolve.py: the config as written becomes the config a job runs, once, above model/ and parallel/.

Contracts: load_config and validate leave "auto" and derived values as written (validate mutates nothing);
resolve() returns a concrete copy (model.vocab_size, pp_layers counts, virtual stages, the planner's layout)
and hands a resolved config back untouched; shard specs read the counts and never ask the planner; the auto
split depends on the hardware resolve passes, not on whether CUDA is visible inside the cost model.
"""

import pytest
import torch

from nanotitan import resolve as R
from nanotitan.config.config import Config, ConfigError, ParallelConfig, load_config, to_dict, to_toml, validate
from nanotitan.config.hardware import get_hardware
from nanotitan.model.spec import build_chunk_specs, chunk_layer_counts
from nanotitan.plan.cost import balanced_layer_counts

# A head as heavy as several layers (vocab 16384, d 32): pp_layers auto gives the last stage fewer layers.
HEAVY = ["--parallel.pp", "2", "--parallel.pp_layers", "auto", "--model.n_layers", "8", "--model.d_model", "32",
         "--model.n_heads", "4", "--model.ffn_dim", "64", "--data.vocab_size", "16384", "--train.device", "cpu"]


def test_validate_mutates_nothing_and_load_config_keeps_what_was_written():
    cfg = load_config(None, HEAVY)
    before = to_dict(cfg)
    validate(cfg)
    assert to_dict(cfg) == before
    assert cfg.model.vocab_size == 0 and cfg.parallel.pp_layers == "auto" and not cfg.resolved


def test_resolve_returns_a_concrete_copy_once():
    cfg = load_config(None, HEAVY)
    r = R.resolve(cfg)
    assert r is not cfg and r.resolved and not cfg.resolved and cfg.parallel.pp_layers == "auto"
    assert r.model.vocab_size == 16384
    counts = r.parallel.pp_layers
    assert sum(counts) == 8 and counts[1] < counts[0], counts
    assert r.explicit == cfg.explicit  # which keys the user set travels with the copy
    assert R.resolve(r) is r and R.resolve_model(r) is r  # a job's config is resolved once


def test_specs_read_the_counts_and_never_ask_the_planner(monkeypatch):
    r = R.resolve(load_config(None, HEAVY))

    def planner(*args, **kwargs):
        raise AssertionError("a shard spec asked the planner: pp_layers is resolved once, in resolve.py")

    monkeypatch.setattr(R, "balanced_layer_counts", planner)
    specs = [build_chunk_specs(r, pp_rank)[0] for pp_rank in range(2)]
    assert specs[0].layer_start == 0 and specs[1].layer_end == 8 and chunk_layer_counts(r) == r.parallel.pp_layers
    with pytest.raises(AssertionError, match="resolve the config"):
        chunk_layer_counts(load_config(None, HEAVY))  # an unresolved "auto" is refused, not balanced here


def test_auto_split_depends_on_the_hardware_passed_not_on_visible_cuda(monkeypatch):
    """resolve picks the device kind's profile (train.device, or auto: CUDA visible or not) and the cost model
    balances on the profile it is given: with CUDA visible, a CPU profile passed in still gives the CPU split."""
    cfg = load_config(None, HEAVY + ["--train.device", "auto"])
    shape = R.resolve_model(cfg)
    cpu, h100 = (balanced_layer_counts(shape, 2, get_hardware(n)) for n in ("cpu", "h100"))
    assert cpu != h100  # the head weighs differently on each, so the profile shows in the split
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert R.resolve(cfg).parallel.pp_layers == h100
    assert R.resolve(cfg, hardware=get_hardware("cpu")).parallel.pp_layers == cpu
    assert R.resolve(load_config(None, HEAVY)).parallel.pp_layers == cpu  # train.device=cpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert R.resolve(cfg).parallel.pp_layers == cpu


def test_virtual_stages_resolve_to_the_chunks_a_rank_runs():
    one = Config(parallel=ParallelConfig(pp=1, schedule="interleaved", virtual_stages=2))
    assert R.resolve(one).parallel.virtual_stages == 1  # no pipeline: one chunk, whatever V says
    two = Config(parallel=ParallelConfig(pp=2, schedule="interleaved", virtual_stages=2, microbatches=2))
    assert R.resolve(two).parallel.virtual_stages == 2 and len(build_chunk_specs(R.resolve(two), 0)) == 2
    with pytest.raises(ConfigError, match="needs --parallel.schedule interleaved"):  # refused, not dropped
        R.resolve(Config(parallel=ParallelConfig(pp=2, virtual_stages=2)))


def test_parallel_auto_plans_once_and_its_flags_reproduce_the_layout(monkeypatch):
    args = ["--parallel.auto", "true", "--train.global_batch", "8", "--train.micro_batch", "2",
            "--model.n_layers", "2", "--model.d_model", "32", "--model.n_heads", "4", "--model.ffn_dim", "64"]
    lines = []
    r = R.resolve(load_config(None, args), world=2, log=lines.append)
    p = r.parallel
    assert p.dp * p.pp * p.ep * p.tp == 2 and not p.auto and r.train.global_batch == r.layout_batch == 8
    assert r.train.micro_batch == 2 and lines and lines[0].startswith("planner: world 2, global batch 8")

    def planner(*args, **kwargs):
        raise AssertionError("a rank planned again")

    monkeypatch.setattr(R, "best_layout", planner)
    again = R.resolve(load_config(None, args + R.planned_flags(r)), world=2)  # what the launched ranks run
    assert again.parallel == r.parallel and again.train == r.train
    with pytest.raises(ConfigError, match="world size 3 != parallel.dp"):
        R.resolve(load_config(None, args + R.planned_flags(r)), world=3)


def test_device_threads_and_zero_choices_become_concrete_once(monkeypatch):
    """resolve writes what every layer below reads: the device (auto -> cpu or cuda), threads (cores / the ranks on
    this host), and zero_accumulate / zero3_reshard by sync.zero_memory_choices, the planner's rule."""
    from nanotitan.parallel.dp.sync import zero_memory_choices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(R.os, "cpu_count", lambda: 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for zero, pp, schedule in ((0, 1, "1f1b"), (2, 1, "1f1b"), (3, 1, "1f1b"), (3, 2, "1f1b"), (2, 2, "interleaved")):
        args = ["--parallel.dp", "2", "--parallel.zero", str(zero), "--parallel.pp", str(pp), "--parallel.schedule",
                schedule, "--parallel.microbatches", "2", "--train.device", "auto"]
        r = R.resolve(load_config(None, args))
        assert (r.train.device, r.train.threads) == ("cpu", 8 // (2 * pp))  # the launcher starts dp*pp ranks here
        assert (r.parallel.zero_accumulate, r.parallel.zero3_reshard) == zero_memory_choices(zero, pp, schedule)
        assert "auto" not in (r.parallel.zero_accumulate, r.parallel.zero3_reshard)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # in a rank: its host's share, whatever the world
    assert R.resolve(load_config(None, ["--parallel.dp", "2"])).train.threads == 2
    assert R.resolve(load_config(None, ["--train.threads", "5"])).train.threads == 5  # as asked
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert R.resolve(load_config(None, [])).train.device == "cuda"
    assert R.resolve(load_config(None, ["--train.device", "cpu"])).train.device == "cpu"


def test_ranks_on_host_for_each_launcher():
    cfg = load_config(None, ["--parallel.dp", "4"])
    assert R.ranks_on_host(cfg, {}) == 4  # one host starts them all
    assert R.ranks_on_host(cfg, {"LOCAL_WORLD_SIZE": "2"}) == 2  # a rank under torchrun
    assert R.ranks_on_host(cfg, {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2"}) == 2
    cfg.elastic.endpoint, cfg.elastic.nproc_per_node = "localhost:29500", 3
    assert R.ranks_on_host(cfg, {}) == 3  # an elastic node's agent


def test_emulation_is_settled_in_resolve_and_the_rank_only_reads_it(monkeypatch):
    """parallel.emulate's node size (the profile's devices_per_node) and dilation (this CPU's peak / the profile's,
    in train.dtype) are concrete after resolve; building the rank's LinkModel measures nothing."""
    from nanotitan.parallel.comm import emulate

    h800 = get_hardware("h800")
    monkeypatch.setattr(R, "cpu_peak_flops", lambda threads, dtype: h800.peak_flops(dtype) / 500)
    r = R.resolve(load_config(None, ["--parallel.emulate", "h800", "--train.device", "cpu"]))
    assert (r.parallel.emulate_node_size, r.parallel.emulate_dilation) == (h800.devices_per_node, pytest.approx(2e-3))
    bf16 = R.resolve(load_config(None, ["--parallel.emulate", "h800", "--train.dtype", "bf16"]))
    assert bf16.parallel.emulate_dilation == pytest.approx(2e-3)  # each dtype against its own peak
    monkeypatch.setattr(R, "cpu_peak_flops", lambda *a: pytest.fail("measured twice"))
    links = emulate.link_model(r, rank=9)
    assert (links.node_size, links.dilation, links.node(9)) == (8, r.parallel.emulate_dilation, 1)
    with pytest.raises(ConfigError, match="parallel.emulate='nope'"):
        R.resolve(load_config(None, ["--parallel.emulate", "nope"]))
    with pytest.raises(AssertionError, match="resolve"):
        emulate.link_model(load_config(None, ["--parallel.emulate", "h800"]))  # unresolved: refused, not measured


def test_a_saved_config_toml_resolves_to_itself(tmp_path):
    """RUN_DIR/config.toml is the resolved config: loaded back (a resume, `generate`) it is already concrete, and
    resolving it again changes nothing."""
    r = R.resolve(load_config(None, HEAVY + ["--parallel.zero", "2", "--parallel.dp", "2"]))
    path = tmp_path / "config.toml"
    path.write_text(to_toml(r))
    again = load_config(path)
    assert to_dict(again) == to_dict(r)
    assert to_dict(R.resolve(again)) == to_dict(r)


def test_cpu_peak_is_measured_once_per_launch_for_the_ranks(monkeypatch):
    calls = []
    monkeypatch.setattr(R, "cpu_peak_flops", lambda threads, dtype: calls.append((threads, dtype)) or 1e11)
    monkeypatch.delenv("NANOTITAN_CPU_PEAK_FLOPS", raising=False)
    r = R.resolve(load_config(None, ["--parallel.dp", "2", "--train.threads", "3", "--train.device", "cpu"]))
    R.cpu_peak_for_ranks(r)
    assert calls == [(3, "fp32")] and R.os.environ["NANOTITAN_CPU_PEAK_FLOPS"] == "100000000000.0"
    monkeypatch.delenv("NANOTITAN_CPU_PEAK_FLOPS")
    R.cpu_peak_for_ranks(R.resolve(load_config(None, ["--train.device", "cpu"])))  # one process: its own
    R.cpu_peak_for_ranks(R.resolve(load_config(None, ["--parallel.dp", "2", "--train.peak_flops", "1e12"])))
    assert calls == [(3, "fp32")] and "NANOTITAN_CPU_PEAK_FLOPS" not in R.os.environ
