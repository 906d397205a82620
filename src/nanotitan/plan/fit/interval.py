"""Prediction intervals (docs/planner.md §7): how far a step time or a peak may be off, from the calibration
residuals of each term of the model.

A prediction's step is a sum of terms (`Prediction.costs`: compute, bubble, overhead, the EP all-to-all, the PP
send/recv, the DP sync, the optimizer). Two kinds of term, each off by a factor exp(e), e ~ N(0, sigma):

* the host's work (compute, bubble, overhead, optimizer; on a CPU+gloo profile the collectives too, which are work
  of the same cores): one error e_host shared by all of them, its sigma the root mean square of the leave-one-out
  log residuals of the CPU calibration (`nanotitan bench layouts` rows that `fit_profile` fits, each row predicted
  by a profile fitted to the others). Shared, not independent: a machine that runs slow runs slow everywhere;
* each collective on a network (`ep_a2a:intra`, `dp_allreduce:inter`, ...: by axis and the link its worst group
  crosses), independently: the network emulator's measured against modelled time of that axis' calls
  (`nanotitan bench emulate`, docs/emulate.md), root mean square over layouts and call sizes.

The terms' sd is sqrt((w_host sigma_host)^2 + sum_k (w_k sigma_k)^2), w the terms' shares of the step. Each term is
calibrated alone, but a whole step is more than its terms: ranks wait on late peers, time-share cores, wake from
holds, run Python between calls. That composition is calibrated end to end (`fit_composition`): over measured steps
of calibration layouts, the log residual's mean (`step_bias`, applied to the prediction) and its spread beyond the
terms' (`step_sigma`, composed with them). The 80% interval is step * exp(step_bias +- 1.2816 sd), sd =
sqrt(terms' sd^2 + step_sigma^2). Peak memory: the root mean square of the calibration rows' per-rank log residuals
of the peak.

`fit_sigmas` computes them; `python scripts/experiments/plan_intervals.py` writes docs/experiments/interval_sigmas.json,
and `FITTED` carries those figures (as memory.EXPERT_SKEW carries its fit).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...config.config import Config
from ...config.hardware import Hardware, get_hardware
from ..context import PlanOptions, placement
from .calibrate import fit_profile, layout_of
from ..cost import Prediction, predict
from ..shape import Layout, layout_config

Z80 = 1.2816  # the standard normal's 90th percentile: an 80% two-sided interval
COLLECTIVES = {"ep_a2a": "ep", "pp_p2p": "pp", "dp_allreduce": "non_expert_dp"}  # cost -> group kind
AXIS = {"ep_a2a": "ep", "pp_p2p": "pp", "dp_allreduce": "dp"}  # cost -> comm axis (the emulator's rows)


@dataclass
class Sigmas:
    host: float = 0.05  # the host's work (compute, overhead, bubble, optimizer; gloo collectives on a CPU profile)
    links: dict[str, float] = field(default_factory=dict)  # "ep_a2a:inter" -> sigma of that collective's time
    mem: float = 0.05  # the peak's
    source: str = "defaults (no calibration read)"
    step_bias: float = 0.0  # composition: mean log(measured / predicted) of whole calibration steps
    step_sigma: float = 0.0  # composition: their log residuals' sd beyond what the terms' sigmas explain

    def of(self, term: str) -> float:
        """A collective's sigma; on a link no calibration measured, its axis' worst link's, else the host's."""
        if term in self.links:
            return self.links[term]
        same = [v for k, v in self.links.items() if k.split(":")[0] == term.split(":")[0]]
        return max(same, default=self.host)


def step_sd(pred: Prediction, sig: Sigmas, network: bool = True) -> float:
    """The sd of the step's log error: its terms' and the composition's (`step_sigma`). `network`: the collectives run
    on a network (a GPU profile, or an emulated one: PlanOptions.links_idle), each with its link's sigma; False: on a
    CPU profile's gloo, host work like the rest."""
    host, var = 0.0, 0.0
    for k, v in pred.costs.items():
        share = max(v, 0.0) / pred.step_time_s
        if network and k in COLLECTIVES:
            var += (share * sig.of(f"{k}:{pred.links.get(COLLECTIVES[k], 'intra')}")) ** 2
        else:
            host += share
    return math.sqrt(var + (host * sig.host) ** 2 + sig.step_sigma ** 2)


def terms_sd(pred: Prediction, sig: Sigmas, network: bool = True) -> float:
    """The sd of the step's log error from its terms alone (no composition term)."""
    return step_sd(pred, dataclasses.replace(sig, step_sigma=0.0), network)


def step_interval(pred: Prediction, sig: Sigmas, network: bool = True, z: float = Z80) -> tuple[float, float]:
    """(low, high) seconds: the 80% interval (z = Z80) of the step time, centred on the prediction corrected by the
    composition's bias."""
    sd, mid = step_sd(pred, sig, network), pred.step_time_s * math.exp(sig.step_bias)
    return mid * math.exp(-z * sd), mid * math.exp(z * sd)


def fit_composition(residuals: list[float], term_sds: list[float]) -> tuple[float, float]:
    """(step_bias, step_sigma) from whole measured steps: `residuals` log(measured / predicted), `term_sds` each
    prediction's terms' sd (`terms_sd`). The bias is their mean; the sigma what their variance (n - 1) leaves beyond
    the terms' mean variance, 0 where the terms explain it all."""
    n = len(residuals)
    if n < 2:
        return (residuals[0] if residuals else 0.0), 0.0
    bias = sum(residuals) / n
    var = sum((r - bias) ** 2 for r in residuals) / (n - 1) - sum(t * t for t in term_sds) / n
    return bias, math.sqrt(max(var, 0.0))


def mem_interval(pred: Prediction, sig: Sigmas, z: float = Z80) -> tuple[float, float]:
    """(low, high) bytes of the heaviest rank's peak."""
    return pred.peak_mem * math.exp(-z * sig.mem), pred.peak_mem * math.exp(z * sig.mem)


def rms(xs: list[float]) -> float:
    return math.sqrt(sum(x * x for x in xs) / len(xs)) if xs else 0.0


def emulator_sigmas(emulate_cal: dict) -> dict[str, float]:
    """{"ep_a2a:inter": sigma, ...}: the root mean square log error of the emulator's modelled against measured time
    of each axis' calls (`nanotitan bench emulate` JSON: per profile "NAME:node_size", rows by layout), by the link
    the layout's group of that axis crosses there."""
    sq: dict[str, list[float]] = {}
    for key, block in emulate_cal.items():
        node = int(key.rsplit(":", 1)[1])
        for row in block["rows"]:
            lay = parse_layout(row["layout"])
            for term, kind in COLLECTIVES.items():
                axis = row.get(AXIS[term])
                if not axis or not axis.get("modelled_s") or not axis.get("measured_s"):
                    continue
                link = "inter" if placement(lay, kind, node)[0] else "intra"
                sq.setdefault(f"{term}:{link}", []).append(math.log(axis["measured_s"] / axis["modelled_s"]))
    return {k: rms(v) for k, v in sq.items()}


def parse_layout(text: str) -> Layout:
    """A Layout from its `short()` text, e.g. "dp2 pp2 ep2 1f1b M2 m2 z1" (the schedule "-" at pp 1)."""
    parts = text.split()
    num = {p[:2] if p[:2] in ("dp", "pp", "ep") else p[0]: p for p in parts}
    get = lambda k: int(num[k][len(k):])  # noqa: E731
    sched = next((p for p in parts if p in ("gpipe", "1f1b", "zb1", "interleaved")), "1f1b")
    return Layout(get("dp"), get("pp"), get("ep"), sched, get("M"), get("m"), get("z") if "z" in num else 0)


def fit_sigmas(rows: list[dict], cfg: Config, profile: str | Hardware, emulate_cal: dict | None = None,
               opts: PlanOptions | None = None) -> Sigmas:
    """Sigmas from the CPU calibration rows (`calibrate.calibration_rows`), each predicted by a profile fitted to
    the others (leave one out), and from the emulator's calibration (`emulator_sigmas`) for the collectives."""
    opts = opts or PlanOptions()
    hw0 = get_hardware(profile)
    step_res, mem_res = [], []
    for i, r in enumerate(rows):
        hw = fit_profile(rows[:i] + rows[i + 1:], cfg, hw0, opts)
        lay = layout_of(r, cfg)
        p = predict(layout_config(cfg, lay), lay, hw, opts)
        step_res.append(math.log(float(r["step_time_s"]) / p.step_time_s))
        mem = r["peak_mem_bytes"]
        for g, x in enumerate(mem if isinstance(mem, (list, tuple)) else [mem]):
            pm = p.mem_by_stage[(g // lay.ep) % lay.pp] if isinstance(mem, (list, tuple)) else p.peak_mem
            mem_res.append(math.log(float(x) / pm))
    return Sigmas(host=rms(step_res), links=emulator_sigmas(emulate_cal or {}), mem=rms(mem_res),
                  source=f"leave-one-out over {len(rows)} calibration layouts"
                         + (f"; the emulator's {sum(len(b['rows']) for b in emulate_cal.values())} (layout, rank) rows"
                            if emulate_cal else ""))


def save_sigmas(sig: Sigmas, path: str | Path) -> None:
    Path(path).write_text(json.dumps(asdict(sig), indent=1, sort_keys=True) + "\n")


def load_sigmas(path: str | Path | None = None) -> Sigmas:
    """Sigmas from a `save_sigmas` JSON; FITTED without one."""
    return Sigmas(**json.loads(Path(path).read_text())) if path else FITTED


# scripts/experiments/plan_intervals.py (docs/planner.md §7): cpu-gloo's 17 calibration layouts left out one at
# a time, the emulator's calibration (docs/experiments/emulate_calibration.json), and the composition fitted on the
# 38 emulated 8-rank steps of docs/experiments/plan_intervals_*.json and skew_check_bw.json (2 Dec 2026)
FITTED = Sigmas(host=0.0595, mem=0.0095,
                links={"dp_allreduce:inter": 0.0021, "dp_allreduce:intra": 0.0079, "ep_a2a:inter": 0.0057,
                       "ep_a2a:intra": 0.0201, "pp_p2p:inter": 0.0135, "pp_p2p:intra": 0.0216},
                source="leave-one-out over 17 calibration layouts; the emulator's 128 (layout, rank) rows; "
                       "composition over 38 emulated steps of 8 layouts",
                step_bias=0.0225, step_sigma=0.0805)


def score(rows: list[dict], sig) -> list[dict]:
    """Leave one layout out: each grid's rows get the interval of `sig` with a composition term fitted to every
    other grid's rows (their log residuals and terms' sds), never to their own."""
    for r in rows:
        rest = [x for x in rows if x["grid"] != r["grid"]]
        bias, sd = fit_composition([math.log(x["meas"] / x["pred"]) for x in rest], [x["sd"] for x in rest])
        held = dataclasses.replace(sig, step_bias=bias, step_sigma=sd)
        r["lo"], r["hi"] = step_interval(r["p"], held)
        r["mid"], r["bias"], r["step_sigma"] = r["pred"] * math.exp(bias), bias, sd
        r["err"], r["inside"] = r["mid"] / r["meas"] - 1, r["lo"] <= r["meas"] <= r["hi"]
    return rows


def run_noise(pairs: list[tuple[str, str]]) -> tuple[float, list[float]]:
    """Run-to-run noise: the same layouts measured twice (two `bench layouts` files, rows matched by layout), the
    sd of one measurement's log step time, rms(log(a/b)) / sqrt(2); and the log ratios."""
    logs = []
    for a, b in pairs:
        key = lambda r: (r["dp"], r["pp"], r["ep"], r.get("M"), r.get("m"))  # noqa: E731
        old = {key(r): r["step_time_s"] for r in json.loads(Path(a).read_text())["rows"]}
        logs += [math.log(r["step_time_s"] / old[key(r)]) for r in json.loads(Path(b).read_text())["rows"]
                 if key(r) in old]
    return (math.sqrt(sum(x * x for x in logs) / len(logs) / 2) if logs else float("nan")), logs
