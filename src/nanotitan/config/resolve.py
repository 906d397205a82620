"""The one step from the config as written to the config a job runs: every "auto" and derived value made
concrete, once, above model/ and parallel/ (DESIGN §2).

    init.from_hf             model.* from DIR's config.json, data.tokenizer = DIR/tokenizer.json (hf_config.py)
    model.vocab_size 0       data.vocab_size (the size of the BPE the data step trains)
    parallel.auto            dp, pp, ep, schedule, microbatches, train.micro_batch and global_batch, zero: the
                             planner's layout for the world size, at the same global batch (plan/search.py)
    parallel.virtual_stages  the model chunks each pipeline rank runs: 1 unless interleaved with pp > 1 (pp.py)
    parallel.pp_layers auto  layers per chunk, balanced by the planner's costs on the device kind's profile

`nanotitan train` resolves before it starts any rank (the launcher for the world it starts; under torchrun each
rank for WORLD_SIZE, so an elastic restart on another world re-plans); a Trainer handed a config as loaded
resolves it itself. Below this module nothing asks the planner, the hardware or a transformers directory:
model/spec.py takes the counts, parallel/ the layout, and a saved config.toml is already the resolved one.
"""

from __future__ import annotations

import copy
import os
from typing import Callable

import torch

from .config import Config, validate
from .hardware import Hardware, get_hardware
from .hf_config import apply_init_config
from ..parallel import pp as pp_schedules
from ..plan.cost import PlanOptions, balanced_layer_counts
from ..plan.search import recommend


def resolve_model(cfg: Config) -> Config:
    """A copy of cfg whose model and data keys are concrete (init.from_hf's model and tokenizer,
    model.vocab_size); the layout stays as written. What `nanotitan plan`, `bench layouts` and `data prepare`
    need; resolve() starts with it."""
    if cfg.resolved:
        return cfg
    c = copy.deepcopy(cfg)
    if c.init.from_hf:
        apply_init_config(c)
    if c.model.vocab_size == 0:
        c.model.vocab_size = c.data.vocab_size
    if c.init.from_hf:
        validate(c)  # load_config could not: the model keys were init.from_hf's, unknown until now
    return c


def resolve(cfg: Config, world: int | None = None, hardware: Hardware | None = None,
            log: Callable[[str], None] | None = None) -> Config:
    """The config a job runs, as a copy with every value concrete (module docstring), validated and marked
    `resolved`; a config that already is comes back as it is, so a job resolves once.

    world: the ranks the job runs on, also checked against dp*pp*ep; None: parallel.auto plans for WORLD_SIZE
    under torchrun, else parallel.world, else dp*pp*ep. hardware: the profile the pp_layers=auto split is
    balanced on (default: the built-in one of the device kind, device_hardware). log: where the planner's
    choice is reported."""
    if cfg.resolved:
        return cfg
    c = resolve_model(cfg)
    p = c.parallel
    if p.auto:
        _plan_layout(c, world or int(os.environ.get("WORLD_SIZE") or 0) or p.world or c.world_size, log)
    validate(c, world_size=world)
    if p.pp_layers == "auto":
        p.pp_layers = auto_layer_counts(c, hardware)
    # After validate, which refuses a virtual_stages the schedule would ignore rather than dropping it here.
    p.virtual_stages = pp_schedules.virtual_stages(p.schedule, p.pp, p.virtual_stages)
    c.resolved = True
    return c


def _plan_layout(c: Config, world: int, log: Callable[[str], None] | None) -> None:
    """parallel.auto: the planner's layout for `world` ranks at the config's global batch, written into c."""
    p, t = c.parallel, c.train
    B = t.global_batch or c.layout_batch
    # m stays as configured: the balance loss is per microbatch, so only the same (B, m) trains the same model.
    # parallel.zero > 0 is kept as asked; 0 lets the planner shard DP state when memory binds.
    dp, pp, ep, schedule, M, m, zero = recommend(c, world, None, PlanOptions(
        global_batch=B, micro_batch=t.micro_batch, zero=p.zero or None))
    p.dp, p.pp, p.ep, p.schedule, p.microbatches, p.zero, p.auto = dp, pp, ep, schedule, M, zero, False
    t.micro_batch, t.global_batch = m, B
    if log:
        log(f"planner: world {world}, global batch {B}: dp={dp} pp={pp} ep={ep} {schedule} M={M} m={m} zero={zero}")


def auto_layer_counts(cfg: Config, hardware: Hardware | None = None) -> list[float]:
    """parallel.pp_layers=auto's answer: the layers of each of the pp * virtual-stages chunks, balanced by the
    planner's cost of each half-block on `hardware` (default: device_hardware(cfg)); plan/cost.py."""
    p = cfg.parallel
    n_chunks = p.pp * pp_schedules.virtual_stages(p.schedule, p.pp, p.virtual_stages)
    return balanced_layer_counts(cfg, n_chunks, hardware or device_hardware(cfg))


def planned_flags(c: Config) -> list[str]:
    """The keys parallel.auto decides, as CLI overrides: ranks started with them run that layout instead of
    planning again."""
    p, t = c.parallel, c.train
    return ["--parallel.dp", str(p.dp), "--parallel.pp", str(p.pp), "--parallel.ep", str(p.ep),
            "--parallel.schedule", p.schedule, "--parallel.microbatches", str(p.microbatches),
            "--train.micro_batch", str(t.micro_batch), "--train.global_batch", str(t.global_batch),
            "--parallel.zero", str(p.zero), "--parallel.auto", "false"]


def device_hardware(cfg: Config) -> Hardware:
    """The built-in profile of the device kind a job runs on: an H100 when train.device is cuda (or auto with
    CUDA visible), else the CPU/gloo one."""
    gpu = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    return get_hardware("h100" if gpu else "cpu")
