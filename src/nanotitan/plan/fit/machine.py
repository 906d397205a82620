"""The planner's calibration of the machine at hand, cached per machine kind (docs/calibration.md "This machine").

The CPU profile the planner prices this host with (`hardware.cpu_profile`) borrows its host costs from the machine
`cpu-gloo` was fitted on; another CPU runs our Python, gloo and time-shared ranks at other speeds (a Zen 4 measured
every emulated layout slower than predicted, the DP-heavy ones by 16%). A calibration measures this machine:

1. `bench layouts` at small world sizes (FIT_WORLDS) under an emulated network (`bench layouts`' own runs, so the
   steps are the kind the planner is scored on), this CPU's 1-thread GEMM rate (`cached_cpu_gemm_flops`);
2. the time model's free constants (FIT_FIELDS) fitted to those steps (`calibrate.fit_constants`: every row
   predicted as `bench layouts` predicts it, its emulated links dilated, groups crossing its emulated nodes, link
   time as waiting), the per-rank reserve to their peak RSS;
3. the composition of whole steps (`interval.fit_composition`: the mean log residual, applied as a bias, and the
   spread beyond the terms' sigmas) from the same steps, the residuals' variance taken over n - 1 - k for the k
   constants fitted on them;
4. cached per machine kind (`hardware.save_calibration`), where `hardware.cpu_profile`, and so every plan of this
   host and every emulated `bench layouts` prediction, finds it without being asked, and `sigmas_for` gives the
   what-if its intervals.

`validate` scores it on layouts the fit never saw (HOLDOUT_WORLDS: other world sizes, so other grids): how many
measured steps fall inside the 80% interval, and the median |error| of the bias-corrected prediction.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ...config.config import ConfigError
from ...config.hardware import (CALIBRATED_FIELDS, Hardware, cache_root, cached_calibration,
                                cached_cpu_gemm_flops, cpu_profile, get_hardware, host_cores, host_memory_bytes,
                                machine_kind)
from ...parallel.comm.emulate import LinkModel
from ..cost import PlanOptions, Prediction, predict
from ..memory import EXPERT_SKEW
from ..shape import layout_config
from ..skew import skew_of_ratio
from .calibrate import FIT_TIME_FIELDS, fit_constants, layout_of
from .interval import FITTED, Sigmas, step_interval, terms_sd

FIT_FIELDS = dict(FIT_TIME_FIELDS)  # compute efficiency, the host's cost per all-to-all, per P2P call, per step
FIT_WORLDS = (2, 4, 8)  # the calibration's world sizes: every layout of 2, 4 and 8 ranks at m = 2 (17)
HOLDOUT_WORLDS = (8,)  # the check's: each layout of 8 ranks predicted by a fit to all the others
# The network the calibration emulates unless the command names one: 4 nodes of 2 over 100 Gb/s (docs/emulate.md)
EMULATE = ["--parallel.emulate", "configs/emulate/h100-100g.json", "--parallel.emulate_node_size", "2"]
STEPS, WINDOW, MICRO_BATCH = 14, (4, 14), 2
COVERAGE_TARGET, ERROR_TARGET = 0.75, 0.06


@dataclass
class Step:
    """One measured layout of a `bench layouts` file: its row and the emulated network it ran on (None: none)."""
    row: dict
    links: LinkModel | None
    source: str

    @property
    def grid(self) -> tuple[int, int, int]:
        return int(self.row["dp"]), int(self.row["pp"]), int(self.row["ep"])


def read_steps(paths: list[str | Path]) -> list[Step]:
    """The rows of `bench layouts` JSON files, each with the network its file says it emulated."""
    out = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        em = data.get("emulate")
        links = LinkModel(get_hardware(em["profile"]), int(em["node_size"]), float(em["dilation"])) if em else None
        out += [Step(r, links, Path(path).name) for r in data["rows"]]
    return out


def predict_step(step: Step, cfg, hw: Hardware) -> Prediction:
    """The planner's prediction of a measured step, as `bench layouts` makes it: `hw` for the host, the emulated
    links dilated, groups crossing the emulated nodes, link time as waiting, and the routing skew the run recorded
    (`ep_recv_max_mean`) where it has one."""
    lay = layout_of(step.row, cfg)
    ratio = step.row.get("ep_recv_max_mean")
    skew = skew_of_ratio(ratio, lay.ep, cfg.model.num_experts) if ratio and lay.ep > 1 else EXPERT_SKEW
    opts = PlanOptions(expert_skew=skew)
    if step.links is not None:
        hw = step.links.dilated(hw)
        opts = dataclasses.replace(opts, link_node_size=step.links.node_size, links_idle=True)
    return predict(layout_config(cfg, lay), lay, hw, opts)


def base_profile() -> Hardware:
    """This host's CPU profile before any calibration, at this CPU's own measured 1-thread fp32 GEMM rate."""
    hw = cpu_profile(host_cores(), host_memory_bytes(), calibrated=False)
    rate = cached_cpu_gemm_flops(1, "fp32")
    return dataclasses.replace(hw, gemm_flops_by_threads={1: rate}, peak_flops_fp32=rate)


def fit(steps: list[Step], cfg, base: Hardware | None = None, fields: dict[str, float] | None = None
        ) -> tuple[Hardware, Sigmas]:
    """(the profile fitted to `steps`, its interval sigmas): the time constants, the reserve, the composition."""
    fields = FIT_FIELDS if fields is None else fields
    if len(steps) < len(fields) + 3:
        raise ConfigError(f"a machine calibration fits {len(fields)} constants and needs at least {len(fields) + 3} "
                          f"measured layouts, here {len(steps)} (more --fit-ranks)")
    base = base or base_profile()
    meas = [float(s.row["step_time_s"]) for s in steps]
    hw = fit_constants(base, fields, meas, lambda h, i: predict_step(steps[i], cfg, h).step_time_s)
    preds = [predict_step(s, cfg, hw) for s in steps]
    extra = []  # measured peak RSS less the predicted tensors: what a process holds besides them
    for s, p in zip(steps, preds):
        lay = layout_of(s.row, cfg)
        for g, x in enumerate(s.row.get("peak_mem_per_rank") or []):
            extra.append(float(x) - (p.mem_by_stage[(g // lay.ep) % lay.pp] - hw.mem_reserved_bytes))
    if extra:
        hw = dataclasses.replace(hw, mem_reserved_bytes=statistics.median(extra))
    res = [math.log(y / p.step_time_s) for y, p in zip(meas, preds)]
    sds = [terms_sd(p, FITTED) for p in preds]
    n, k = len(res), len(fields)
    bias = sum(res) / n
    var = sum((r - bias) ** 2 for r in res) / (n - 1 - k) - sum(t * t for t in sds) / n
    sig = dataclasses.replace(FITTED, step_bias=bias, step_sigma=math.sqrt(max(var, 0.0)),
                              source=f"this machine kind's calibration: composition over {n} measured steps of "
                                     f"{len({s.grid for s in steps})} layouts; term sigmas as FITTED")
    return hw, sig


def score(steps: list[Step], cfg, hw: Hardware, sig: Sigmas) -> list[dict]:
    """Each measured step against the calibrated prediction and its 80% interval."""
    out = []
    for s in steps:
        p = predict_step(s, cfg, hw)
        lo, hi = step_interval(p, sig)
        mid, meas = p.step_time_s * math.exp(sig.step_bias), float(s.row["step_time_s"])
        out.append(dict(layout=p.layout.short(), world=s.row.get("world"), source=s.source, pred=p.step_time_s,
                        mid=mid, lo=lo, hi=hi, meas=meas, err=mid / meas - 1, raw_err=p.step_time_s / meas - 1,
                        inside=lo <= meas <= hi))
    return out


def leave_one_out(steps: list[Step], cfg, worlds: tuple[int, ...], base: Hardware | None = None) -> list[dict]:
    """Each measured layout of `worlds` predicted by a calibration fitted to every other step (its constants and its
    composition): scored on layouts the fit never saw."""
    base = base or base_profile()
    out = []
    for i, s in enumerate(steps):
        if s.row.get("world") not in worlds:
            continue
        hw, sig = fit(steps[:i] + steps[i + 1:], cfg, base)
        out += score([s], cfg, hw, sig)
    return out


def summary(scored: list[dict]) -> dict:
    n = len(scored)
    inside = sum(r["inside"] for r in scored)
    med = statistics.median(abs(r["err"]) for r in scored) if scored else float("nan")
    raw = statistics.median(abs(r["raw_err"]) for r in scored) if scored else float("nan")
    return dict(n=n, inside=inside, coverage=inside / n if n else float("nan"), median_abs_err=med,
                median_abs_err_raw=raw, meets=bool(n) and inside / n >= COVERAGE_TARGET and med <= ERROR_TARGET)


def format_score(scored: list[dict], title: str) -> str:
    lines = [f"## {title}", "", "| layout | N | predicted ms | bias-corrected ms | 80% interval ms | measured ms | "
             "error | inside |", "|---|---:|---:|---:|---|---:|---:|---|"]
    for r in scored:
        lines.append(f"| {r['layout']} | {r['world']} | {1e3 * r['pred']:.0f} | {1e3 * r['mid']:.0f} | "
                     f"{1e3 * r['lo']:.0f}-{1e3 * r['hi']:.0f} | {1e3 * r['meas']:.0f} | {100 * r['err']:+.1f}% | "
                     f"{'yes' if r['inside'] else 'NO'} |")
    s = summary(scored)
    lines.append(f"\n{s['inside']} of {s['n']} inside the 80% interval ({100 * s['coverage']:.0f}%); median |error| "
                 f"{100 * s['median_abs_err']:.1f}% bias-corrected, {100 * s['median_abs_err_raw']:.1f}% of the model "
                 f"alone (targets: >= {100 * COVERAGE_TARGET:.0f}% inside, <= {100 * ERROR_TARGET:.0f}%)")
    return "\n".join(lines)


def entry(hw: Hardware, sig: Sigmas, steps: list[Step], config: str) -> dict:
    """What the cache keeps for this machine kind."""
    date = time.strftime("%Y-%m-%d %H:%M")
    fitted = ", ".join(f"{k} {getattr(hw, k):.3g}" for k in FIT_FIELDS)
    return dict(profile={**{k: getattr(hw, k) for k in CALIBRATED_FIELDS},
                         "gemm_flops_by_threads": {str(t): v for t, v in hw.gemm_flops_by_threads.items()}},
                sigmas=dataclasses.asdict(sig), layouts=len(steps), config=config, date=date,
                source=f"{date}, {len(steps)} layouts of {config} ({fitted}, reserve "
                       f"{hw.mem_reserved_bytes / 2**20:.0f} MiB, "
                       f"GEMM {hw.peak_flops_fp32 / 1e9:.0f} GFLOP/s per core)")


def sigmas_for(hw: Hardware) -> Sigmas:
    """The interval sigmas of a prediction on `hw`: this machine kind's calibration's where `hw` is this host's
    calibrated CPU profile (emulated links included), else FITTED."""
    cal = cached_calibration() if hw.cores_per_node else None
    if cal and cal.get("sigmas") and all(getattr(hw, k) == cal["profile"].get(k) for k in FIT_FIELDS):
        return Sigmas(**cal["sigmas"])  # hw carries this calibration's constants
    return FITTED


def measure(config: str, worlds: tuple[int, ...], out: Path, tag: str, overrides: list[str],
            steps: int = STEPS, window: tuple[int, int] = WINDOW) -> Path:
    """`nanotitan bench layouts` at `worlds` (every layout of each, m = MICRO_BATCH) into `out`; its JSON's path.
    A network emulated unless `overrides` names one: EMULATE."""
    emulate = [] if any(a.startswith("--parallel.emulate") for a in overrides) else EMULATE
    cmd = [sys.executable, "-m", "nanotitan.cli", "bench", "layouts", "--ranks", *map(str, worlds), "--steps",
           str(steps), "--window", *map(str, window), "--micro-batch", str(MICRO_BATCH), "--config", config,
           "--out", str(out), "--tag", tag, "--no-calibrate", *emulate, *overrides]
    print(f"[calibrate] {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True)
    return out / f"layouts_{tag}.json"


def runs_dir() -> Path:
    """Where a calibration's measurements go: under the cache, by machine kind and time."""
    kind = "".join(c if c.isalnum() else "_" for c in machine_kind())[:80]
    return cache_root() / "hardware" / "calibration_runs" / kind / time.strftime("%Y%m%d-%H%M%S")
