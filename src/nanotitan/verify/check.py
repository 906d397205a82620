"""`nanotitan verify`: a config trained on a layout against the same config on one process (docs/verify.md).

    configs(cfg, layout)   the two configs: the layout's (parallel.dp/pp/ep/tp/cp from --layout, the config's other
                           parallel keys, microbatches for the config's global batch B) and one process's (every
                           parallel key at its default but microbatches = B / micro_batch, and fp8_comm, part of
                           the FP8 recipe); both with no eval, no
                           checkpoint, a record every step, in a scratch run dir
    verify(cfg, layout)    both run (world.py), compared (compare.py): an `Outcome` with every row, the verdict line
                           and the exit code (0 equal, 1 diverged or the layout failed; config errors raise)
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config.config import Config, ConfigError, ParallelConfig, to_toml
from ..resolve import resolve
from .compare import FP32, Layout, Row, as_json, bf16, compare, fp8, first_loss_step, verdict
from .world import WorldFailed, run_world, start

AXES = ("dp", "pp", "ep", "tp", "cp")
FAULT_ENV = "NANOTITAN_VERIFY_FAULT"  # AXIS[:CALL[:RANK]]: a planted fault in the layout's run (parallel/comm/fault.py)


def parse_layout(text: str) -> dict[str, int]:
    """"dp=2,pp=2,ep=2" -> {"dp": 2, "pp": 2, "ep": 2}; the axes left out are 1."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        axis, _, n = part.partition("=")
        if axis not in AXES or not n.isdigit() or int(n) < 1 or axis in out:
            raise ConfigError(f"--layout {text!r}: want AXIS=N,... with AXIS one of {', '.join(AXES)} once each, "
                              "N >= 1 (--layout dp=2,pp=2,ep=2)")
        out[axis] = int(n)
    return {a: out.get(a, 1) for a in AXES}


def _for_verify(cfg: Config, run_dir: str) -> Config:
    """A copy that trains and records only: no eval, checkpoint, sample or resume, no memory meters (they cost a
    Python call per op on their steps, and verify compares numbers); a record every step."""
    c = copy.deepcopy(cfg)
    c.resolved = False  # resolved again below, with the layout's keys
    t, r = c.train, c.run
    t.eval_every, t.ckpt_every, t.ckpt_at_end, t.sample_tokens, t.resume = 0, 0, False, 0, ""
    t.ckpt_on_signal, t.max_restarts = False, 0
    r.dir, r.overwrite, r.log_every, r.peak_every, r.progress, r.tensorboard, r.wandb, r.profile_steps = \
        run_dir, True, 1, 0, False, False, False, ""
    c.parallel.check_replicas, c.parallel.auto = False, False
    return c


def configs(cfg: Config, layout: dict[str, int] | None, run_dir: str) -> tuple[Config, Config]:
    """(one process's config, the layout's), resolved (module docstring). Raises ConfigError (exit 2)."""
    m = cfg.train.micro_batch
    B = cfg.train.global_batch or cfg.layout_batch
    lay = _for_verify(cfg, f"{run_dir}/layout")
    if layout is not None:
        for axis, n in layout.items():
            setattr(lay.parallel, axis, n)
    p = lay.parallel
    if B % (p.dp * p.ep * m):
        raise ConfigError(f"the global batch B={B} is not a multiple of dp*ep*train.micro_batch = "
                          f"{p.dp}*{p.ep}*{m} (--train.micro_batch, or another --layout)")
    p.microbatches = B // (p.dp * p.ep * m)
    if lay.world_size == 1:
        raise ConfigError("the layout is one process: nothing to compare (--layout dp=2,pp=2,ep=2)")
    if cfg.train.compile:  # the recording's hooks would sit inside the compiled blocks' graphs
        raise ConfigError("train.compile: verify compares eager runs (--train.compile false; compiled blocks are held "
                          "to eager ones by tests/parallel/test_compile.py)")
    if cfg.data.loader != "indexed":  # the streaming loader splits its stream by data rank: not one process's batch
        raise ConfigError(f"data.loader={cfg.data.loader} reads another batch on every layout: verify compares the "
                          "same global batch (--data.loader indexed)")
    ref = _for_verify(cfg, f"{run_dir}/reference")
    # one process at the layout's numbers: parallel.fp8_comm is part of the FP8 recipe (it rounds the experts'
    # operands as the wire carries them, in every layout: docs/fp8.md), so the reference keeps it
    ref.parallel = ParallelConfig(microbatches=B // m, timeout_s=p.timeout_s, fp8_comm=p.fp8_comm)
    ref, lay = resolve(ref), resolve(lay)
    if lay.train.device == "cuda" and lay.world_size > torch.cuda.device_count():
        raise ConfigError(f"the layout's {lay.world_size} ranks need as many GPUs, {torch.cuda.device_count()} are "
                          "visible (--train.device cpu: local gloo ranks)")
    return ref, lay


@dataclass
class Outcome:
    """A verify run's result."""
    rows: list[Row]
    line: str  # the verdict: "verify: equal (...)" or "verify: first divergence: ..."
    code: int  # 0 equal, 1 diverged (or the layout failed)
    layout: dict[str, int]
    steps: int
    dtype: str
    loss_step: int | None = None  # the first step whose loss diverges
    failed: str = ""  # the layout's (or the reference's) failure line, when a run did not finish
    detail: str = ""  # and the failing rank's traceback
    fault: str = ""  # where a planted fault went
    seconds: dict = field(default_factory=dict)  # wall time: start, reference, layout (steps, capture), compare

    @property
    def first(self) -> Row | None:
        return next((r for r in self.rows if not r.ok), None)


def verify(cfg: Config, layout: dict[str, int] | None = None, steps: int = 3, start_method: str = "forkserver",
           fault: str | None = None, references: dict | None = None) -> Outcome:
    """Run `cfg` on one process and on `layout` (None: the config's own) for `steps` steps and compare them.
    `fault`: AXIS[:CALL[:RANK]] planted in the layout's run (default: $NANOTITAN_VERIFY_FAULT). `references`: a
    cache of one-process results by config (the fuzzer's: many layouts share one reference)."""
    fault = fault if fault is not None else os.environ.get(FAULT_ENV) or None
    run_dir = tempfile.mkdtemp(prefix="nanotitan-verify-")
    try:
        ref_cfg, lay_cfg = configs(cfg, layout, run_dir)
        steps = max(1, min(steps, cfg.train.steps))
        sizes = {a: getattr(lay_cfg.parallel, a) for a in AXES}
        dtype = lay_cfg.train.dtype
        key = _reference_key(ref_cfg, steps)
        t0 = time.perf_counter()
        start(start_method)  # the ranks' server imports torch and the trainer once: timed apart
        seconds = {"start": time.perf_counter() - t0}
        t0 = time.perf_counter()
        try:
            ref = references[key] if references is not None and key in references else \
                run_world(ref_cfg, steps, start_method=start_method)[0]
        except WorldFailed as e:
            return Outcome([], f"verify: the one-process reference failed: {e.line}", 1, sizes, steps, dtype,
                           failed=e.line, detail=e.detail)
        if references is not None:
            references[key] = ref
        seconds["reference"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            ranks = run_world(lay_cfg, steps, fault, start_method=start_method)
        except WorldFailed as e:
            return Outcome([], f"verify: the layout failed: {e.line}", 1, sizes, steps, dtype, failed=e.line,
                           detail=e.detail, seconds=seconds)
        seconds["layout"] = time.perf_counter() - t0
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    sliced = {n for r in ranks for n in r["sliced"]}
    seconds["capture"] = max(r["capture_s"] for r in ranks)  # the slowest rank's recording, inside "layout"
    seconds["steps"] = [max(r["steps"][i]["seconds"] for r in ranks) for i in range(len(ranks[0]["steps"]))]
    tokens = ref_cfg.layout_batch * ref_cfg.train.seq_len
    tol = bf16(tokens) if dtype == "bf16" else fp8(tokens) if ref_cfg.train.fp8 != "off" else FP32
    t0 = time.perf_counter()
    rows = compare(ref, ranks, tol, Layout(sizes, sliced))
    seconds["compare"] = time.perf_counter() - t0
    line = verdict(rows)
    return Outcome(rows, line, 0 if line.startswith("verify: equal") else 1, sizes, steps, dtype,
                   first_loss_step(rows), fault=next((r["fault"] for r in ranks if r["fault"]), ""), seconds=seconds)


def _reference_key(ref_cfg: Config, steps: int) -> str:
    c = copy.deepcopy(ref_cfg)
    c.run.dir = ""
    return f"{steps}\n{to_toml(c)}"


PHASES = (("forward", "forward outputs"), ("backward", "gradients"), ("update", "parameters and optimizer state"),
          ("loss", "loss per step (ce, mtp, total)"), ("norm", "balance loss, grad norm, max logit"),
          ("exact", "lr and skip verdict per step"))


def report(o: Outcome) -> list[str]:
    """The report's lines, the verdict last (docs/verify.md "Reading a report")."""
    axes = " ".join(f"{a}={n}" for a, n in o.layout.items() if n > 1)
    lines = [f"verify: one process vs {axes} ({math.prod(o.layout.values())} ranks), {o.steps} steps, {o.dtype}"]
    if o.fault:
        lines.append(f"  planted fault: {o.fault}")
    for phase, what in PHASES:
        rows = [r for r in o.rows if r.phase == phase]
        if not rows:
            continue
        held = [r for r in rows if math.isfinite(r.tol)]
        worst = max(held or rows, key=lambda r: r.rel)
        bad = sum(not r.ok for r in rows)
        mark = (f", {bad} over" if bad else "") + (f", {len(rows) - len(held)} not held" if len(held) < len(rows)
                                                   else "")
        lines.append(f"  {what:<36} {len(rows):>4} compared, worst {worst.rel:.2g} ({worst.name}), "
                     f"tol {worst.tol:.2g}{mark}")
    if (first := o.first) is not None:
        where = f" (axes {', '.join(first.axes)})" if first.axes else ""
        note = f": {first.note}" if first.note else ""
        lines.append(f"  first divergence: {first.name}, {first.phase} at step {first.step}{where}{note}")
    if o.loss_step is not None:
        lines.append(f"  the loss first diverges at step {o.loss_step}")
    if o.seconds.get("layout"):
        s = o.seconds
        total = s["start"] + s["reference"] + s["layout"] + s["compare"]
        steps = ", ".join(f"{t:.2f}" for t in s["steps"])
        lines.append(f"  took {total:.0f} s: starting {s['start']:.1f} s, one process {s['reference']:.1f} s, "
                     f"the layout {s['layout']:.1f} s (its steps {steps} s; recording {s['capture']:.2f} s of the "
                     f"first), comparing {s['compare']:.1f} s")
    lines.append(o.line)
    return lines


def write_json(path: str | Path, o: Outcome, cfg: Config | None = None) -> None:
    write_rows(path, o.rows, o.line, {
        "layout": o.layout, "steps": o.steps, "dtype": o.dtype, "first": as_json([o.first])[0] if o.first else None,
        "loss_step": o.loss_step, "failed": o.failed, "fault": o.fault, "seconds": o.seconds,
        "config": to_toml(cfg) if cfg is not None else None})


def write_rows(path: str | Path, rows: list[Row], line: str, extra: dict) -> None:
    """The whole comparison as JSON: the verdict, `extra`, every row."""
    Path(path).write_text(json.dumps({"result": "equal" if line.startswith("verify: equal") else "diverged",
                                      "line": line, **extra, "rows": as_json(rows)}, indent=1))
