"""The one step from the config as written to the config a job runs: every "auto" and derived value made
concrete, once, above model/ and parallel/ (docs/design.md §2).

    init.from_hf             model.* from DIR's config.json, data.tokenizer = DIR/tokenizer.json (config/hf_config.py)
    model.vocab_size 0       data.vocab_size (the size of the BPE the data step trains)
    parallel.auto            dp, pp, ep, schedule, microbatches, train.micro_batch and global_batch, zero: the
                             planner's layout for the world size, at the same global batch (plan/search.py)
    train.device auto        cuda when CUDA is visible, else cpu
    train.threads 0          this host's cores / the ranks it runs (at least 1)
    parallel.virtual_stages  the model chunks each pipeline rank runs: 1 unless interleaved with pp > 1
                             (parallel/pp/facts.py)
    parallel.pp_layers auto  layers per chunk, balanced by the planner's costs on the device kind's profile
    parallel.zero_accumulate, zero3_reshard auto   sync.zero_memory_choices, the rule the planner prices too
    parallel.emulate_node_size 0, emulate_dilation 0   the profile's devices per node; this CPU's GEMM peak /
                             the profile's peak (parallel/comm/emulate.py builds its links from these values)

`nanotitan train` resolves before it starts any rank (the launcher for the world it starts; under torchrun each
rank for WORLD_SIZE, so an elastic restart on another world re-plans); a Trainer handed a config as loaded
resolves it itself. The launcher (or an elastic node's agent) also measures the CPU GEMM peak once for its
ranks (`cpu_peak_for_ranks`). Below this module nothing chooses a value, asks the planner, or reads a
transformers config.json for the model's shape: model/spec.py takes the counts, parallel/ the layout, device,
threads, zero choices and emulation as written here, and a saved config.toml is already the resolved one.
What a rank still asks for itself: its CUDA device (pick_device), the MFU peak (observe/metrics.py: a GPU's
datasheet by name, a CPU's from the launcher's variable, measured and cached only by a process that runs alone),
and init.from_hf's weights (interop/hf.py, which names the tensors by the family its config.json gives).
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import torch

from .config.config import Config, ConfigError, validate
from .config.hardware import Hardware, cpu_peak_env, cpu_peak_flops, get_hardware
from .config.hf_config import resolve_model
from .parallel.pp import facts as pp_facts
from .parallel.comm.emulate import emulated_peak_flops
from .parallel.dp.sync import zero_memory_choices
from .plan.cost import PlanOptions, balanced_layer_counts
from .plan.search import best_layout


def resolve(cfg: Config, world: int | None = None, hardware: Hardware | None = None,
            log: Callable[[str], None] | None = None) -> Config:
    """The config a job runs, as a copy with every value concrete (module docstring), validated and marked
    `resolved`; a config that already is comes back as it is, so a job resolves once.

    world: the ranks the job runs on, also checked against dp*pp*ep*tp*cp; None: parallel.auto plans for WORLD_SIZE
    under torchrun, else parallel.world, else dp*pp*ep*tp*cp. hardware: the profile the pp_layers=auto split is
    balanced on (default: the built-in one of the device kind, device_hardware). log: where the planner's
    choice is reported."""
    if cfg.resolved:
        return cfg
    c = resolve_model(cfg)
    p, t = c.parallel, c.train
    if p.auto:
        _plan_layout(c, world or int(os.environ.get("WORLD_SIZE") or 0) or p.world or c.world_size, log)
    t.device = concrete_device(t.device)
    t.threads = t.threads or max(1, (os.cpu_count() or 1) // ranks_on_host(c))
    validate(c, world_size=world)  # sees the concrete device: cuda-only refusals apply to auto as well
    if p.pp_layers == "auto":
        p.pp_layers = auto_layer_counts(c, hardware)
    # After validate, which refuses a virtual_stages the schedule would ignore rather than dropping it here.
    p.virtual_stages = pp_facts.virtual_stages(p.schedule, p.pp, p.virtual_stages)
    p.zero_accumulate, p.zero3_reshard = zero_memory_choices(p.zero, p.pp, p.schedule, p.zero_accumulate,
                                                             p.zero3_reshard)
    resolve_emulation(c)
    c.resolved = True
    return c


def concrete_device(device: str) -> str:
    """train.device as "cpu" or "cuda": auto is cuda when CUDA is visible. (A cuda asked for on a host without
    it fails where the rank takes its device, parallelize.pick_device: `plan --dry-run` resolves GPU configs
    on CPU hosts.)"""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def ranks_on_host(cfg: Config, env=os.environ) -> int:
    """The ranks that share this host's cores: LOCAL_WORLD_SIZE in a rank (torchrun, an elastic agent, spawn),
    else what this launcher starts here: an elastic node's nproc_per_node, a multi-node srun task's share, or
    the whole world."""
    if env.get("LOCAL_WORLD_SIZE"):
        return int(env["LOCAL_WORLD_SIZE"])
    if cfg.elastic.endpoint:
        return cfg.elastic.nproc_per_node
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1) if "SLURM_STEP_ID" in env else 1
    return max(1, cfg.world_size // nodes)


def emulation_profile(cfg: Config) -> Hardware:
    """The hardware profile parallel.emulate names, or a ConfigError naming the field."""
    try:
        return get_hardware(cfg.parallel.emulate)
    except ValueError as e:
        why = str(e).replace("(--hardware NAME|FILE)", "(--parallel.emulate NAME|FILE)")
        raise ConfigError(f"parallel.emulate={cfg.parallel.emulate!r}: {why}") from None


def resolve_emulation(cfg: Config, cpu_peak: float | None = None) -> Config:
    """parallel.emulate's node size and dilation made concrete in `cfg` (in place; returned for chaining): the
    profile's devices_per_node, and this CPU's GEMM peak on train.threads threads (`cpu_peak`, else measured:
    bounded, cached, or the launcher's figure, hardware.cpu_peak_flops) / the profile's peak, both in
    train.dtype. Nothing when parallel.emulate is off; a profile that does not exist fails in one line."""
    p, t = cfg.parallel, cfg.train
    if not p.emulate:
        return cfg
    hw = emulation_profile(cfg)
    p.emulate_node_size = p.emulate_node_size or hw.devices_per_node
    if not p.emulate_dilation:
        peak = cpu_peak if cpu_peak is not None else cpu_peak_flops(t.threads or 1, t.dtype)
        p.emulate_dilation = peak / emulated_peak_flops(hw, t.dtype)
    return cfg


def cpu_peak_for_ranks(cfg: Config) -> None:
    """CPU training, once per launch (the launcher, or an elastic node's agent, with the resolved config): a bf16
    run on a CPU without native bf16 is told so in one line, and the GEMM peak that bounds MFU is measured here
    (bounded, cached) and handed to the ranks in `cpu_peak_env`; ranks sharing the cores would otherwise measure
    each other. One process measures its own (cached) peak."""
    from .observe.metrics import bf16_advice

    t = cfg.train
    if t.device == "cuda":
        return
    if t.dtype == "bf16" and (line := bf16_advice(t.threads)):
        print(line, file=sys.stderr, flush=True)
    if (cfg.world_size > 1 or cfg.elastic.endpoint) and not t.peak_flops:
        os.environ[cpu_peak_env(t.dtype)] = str(cpu_peak_flops(t.threads, t.dtype))  # before ranks start


def _plan_layout(c: Config, world: int, log: Callable[[str], None] | None) -> None:
    """parallel.auto: the planner's layout for `world` ranks at the config's global batch, written into c."""
    p, t = c.parallel, c.train
    B = t.global_batch or c.layout_batch
    # m stays as configured: the balance loss is per microbatch, so only the same (B, m) trains the same model.
    # parallel.zero > 0 is kept as asked; 0 lets the planner shard DP state when memory binds.
    best = best_layout(c, world, None, PlanOptions(global_batch=B, micro_batch=t.micro_batch, zero=p.zero or None))
    dp, pp, ep, schedule, M, m, zero = best.as_tuple()
    p.dp, p.pp, p.ep, p.schedule, p.microbatches, p.zero, p.auto = dp, pp, ep, schedule, M, zero, False
    p.tp, p.cp = best.tp, best.cp  # the search covers DP x PP x EP x TP x CP (plan/tp.py, plan/cp.py)
    t.micro_batch, t.global_batch = m, B
    if log:
        log(f"planner: world {world}, global batch {B}: dp={dp} pp={pp} ep={ep} tp={p.tp} cp={p.cp} {schedule} M={M} "
            f"m={m} zero={zero}")


def auto_layer_counts(cfg: Config, hardware: Hardware | None = None) -> list[float]:
    """parallel.pp_layers=auto's answer: the layers of each of the pp * virtual-stages chunks, balanced by the
    planner's cost of each half-block on `hardware` (default: device_hardware(cfg)); plan/cost.py."""
    p = cfg.parallel
    n_chunks = p.pp * pp_facts.virtual_stages(p.schedule, p.pp, p.virtual_stages)
    return balanced_layer_counts(cfg, n_chunks, hardware or device_hardware(cfg))


def planned_flags(c: Config) -> list[str]:
    """The keys parallel.auto decides, as CLI overrides: ranks started with them run that layout instead of
    planning again."""
    p, t = c.parallel, c.train
    return ["--parallel.dp", str(p.dp), "--parallel.pp", str(p.pp), "--parallel.ep", str(p.ep),
            "--parallel.schedule", p.schedule, "--parallel.microbatches", str(p.microbatches),
            "--train.micro_batch", str(t.micro_batch), "--train.global_batch", str(t.global_batch),
            "--parallel.zero", str(p.zero), "--parallel.tp", str(p.tp), "--parallel.cp", str(p.cp),
            "--parallel.auto", "false"]


def device_hardware(cfg: Config) -> Hardware:
    """The built-in profile of the device kind a job runs on: an H100 when train.device is cuda (or auto with
    CUDA visible), else the CPU/gloo one."""
    return get_hardware("h100" if concrete_device(cfg.train.device) == "cuda" else "cpu")
