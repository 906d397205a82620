"""Layout planner: predict memory and step time of every DP x PP x EP layout, rank them, pick one.

`nanotitan plan --config FILE --ranks N` enumerates every layout (dp, pp, ep, schedule, M, m) of
world N that keeps the config's global batch B = dp*ep*M*m and passes `config.validate`, predicts
per-rank memory and step time with an analytic model, and prints a ranked table with a
recommendation. `recommend()` is what `nanotitan train --parallel.auto true` calls.
`nanotitan plan --calibrate LAYOUTS_JSON --hardware PROFILE --out NEW` fits a profile's free constants to
what `nanotitan bench layouts` measured (`fit_profile`); `calibrate` reports prediction errors.
The method, every formula and its assumptions are written up in docs/planner.md.

    shape.py      the model and layout as counts: ModelShape, Layout, Precision, stage summaries
    context.py    PlanOptions and the Context: the facts of one layout on one profile that both models read
    memory.py     the memory model: a rank's peak bytes per stage, by cause
    steptime.py   the time model: step time by cause, and the balanced pipeline split
    skew.py       routing skew and group-limited routing in the time model: the busiest EP rank's share
    tp.py         tensor parallel's terms: what a TP group saves, what it sends, which TP degrees a search tries
    cp.py         context parallel's terms: what a CP group saves, what it sends on which link, which CP degrees
    fp8.py        train.fp8's terms: the FP8 GEMMs at the profile's FP8 rate with their casts, the rest in bf16
    docs.py       packed documents: the document mask's attention work, and the CP split's balance over them
    dispatch.py   parallel.ep_dispatch static's terms: the padded payload, the chance of a replay from the skew,
                  the host reads each dispatch makes
    cost.py       predict(): the two models over one Context (and the names other modules import)
    search.py     layout_candidates, enumerate_layouts, search_layouts, plan, recommend: the ranked predictions
    table.py      what `nanotitan plan` prints: one row per layout, sorted as its header says, the recommendation,
                  why, and each change it makes to the config's batch
    advice.py     `--what-if`'s advice: config changes that act on the dominant causes, each predicted
    dryrun.py     `--dry-run`: every distinct rank of a layout built by the real code on fake tensors, against the model
    whatif.py     `--what-if`: fit, best layouts with their intervals, what dominates the step and what to change
    fit/          the fitting tools, apart from the model they fit:
        calibrate.py  calibrate, fit_profile (Nelder-Mead), spearman, calibration rows
        interval.py   prediction intervals from the calibration residuals of each term
        measure.py    `--measure` (this machine's profile) and TensorBytesMeter (imports torch.distributed)
    cli.py        main(argv): `nanotitan plan`, an entry point like nanotitan/cli.py: it resolves the config
                  (resolve.py, which asks this package), so the package itself does not import it
"""

from .fit.calibrate import FIT_TIME_FIELDS, calibrate, calibration_rows, fit_profile, format_calibration, spearman
from .cost import PlanOptions, Prediction, predict
from .search import enumerate_layouts, plan, recommend
from .table import format_table, layout_rows, reason
from .shape import PRECISIONS, Layout, ModelShape, Precision, StageSummary, layout_config, stage_summaries

__all__ = ["FIT_TIME_FIELDS", "PRECISIONS", "Layout", "ModelShape", "PlanOptions", "Precision", "Prediction",
           "StageSummary", "calibrate", "calibration_rows", "enumerate_layouts", "fit_profile", "format_calibration",
           "format_table", "layout_config", "layout_rows", "plan", "predict", "reason", "recommend", "spearman",
           "stage_summaries"]
