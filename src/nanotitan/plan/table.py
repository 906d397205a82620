"""What `nanotitan plan` prints: one row per layout, sorted as its header says, the recommendation and why, and
every change the recommendation makes to the config's batch with its consequence (docs/planner.md "Reading the
table").

A layout here is (dp, pp, ep, tp, cp, M, m): what decides which ranks hold what and which data each reads. The
search also tries every pipeline schedule and zero level of a layout; they change neither the model nor the
layout's shape, so they are folded into its row: the row shows the variant the recommendation rule picks (the
lowest zero level within ZERO_SLACK of the layout's fastest fitting variant), and says how far the others are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config.config import Config
from ..config.hardware import GiB
from .cost import PlanOptions, Prediction
from .search import ZERO_SLACK
from .shape import Layout

SORTED_BY = "fitting layouts first, then tokens/s (fastest first), then memory"


@dataclass
class Row:
    """One layout: the variant shown, the layout's other (schedule, zero) variants, whether it is the
    recommendation, and its place in the table (1 = first)."""
    pred: Prediction
    others: list[Prediction] = field(default_factory=list)
    recommended: bool = False
    rank: int = 0

    @property
    def layout(self) -> Layout:
        return self.pred.layout


def layout_key(lay: Layout) -> tuple:
    """What makes two predictions the same layout: everything but the schedule and the zero level."""
    return lay.dp, lay.pp, lay.ep, lay.tp, lay.cp, lay.microbatches, lay.micro_batch


def _pick(variants: list[Prediction]) -> Prediction:
    """The variant a layout's row shows: where some fit, the lowest zero level within ZERO_SLACK of the fastest
    fitting one (the recommendation's rule, search.plan), fastest first on a tie; where none fits, the one
    needing the least memory (how close the layout comes)."""
    fit = [p for p in variants if p.fits]
    if not fit:
        return min(variants, key=lambda p: p.peak_mem)
    top = max(p.tokens_per_sec for p in fit)
    near = [p for p in fit if p.tokens_per_sec >= (1 - ZERO_SLACK) * top]
    return min(near, key=lambda p: (p.layout.zero, -p.tokens_per_sec))


def layout_rows(preds: list[Prediction]) -> list[Row]:
    """`search.plan`'s predictions (the recommendation first) as one row per layout, sorted by SORTED_BY; the
    recommended layout's row shows the recommended variant."""
    groups: dict[tuple, list[Prediction]] = {}
    for p in preds:
        groups.setdefault(layout_key(p.layout), []).append(p)
    best = preds[0] if preds and preds[0].fits else None
    rows = []
    for variants in groups.values():
        shown = best if best is not None and best in variants else _pick(variants)
        rows.append(Row(shown, [p for p in variants if p is not shown], recommended=shown is best))
    rows.sort(key=lambda r: (not r.pred.fits, -r.pred.tokens_per_sec, r.pred.peak_mem))
    for i, r in enumerate(rows, 1):
        r.rank = i
    return rows


def _others(row: Row) -> str:
    """The row's other (schedule, zero) variants in a few characters: how many, their tokens/s against the
    shown one's, and how many of them do not fit."""
    if not row.others:
        return "-"
    fit = [p.tokens_per_sec / row.pred.tokens_per_sec - 1 for p in row.others if p.fits]
    oom = len(row.others) - len(fit)
    spread = f": {100 * min(fit):+.0f} to {100 * max(fit):+.0f}%" if fit else ""
    return f"{len(row.others)}{spread}" + (f", {oom} over memory" if oom else "")


def format_table(rows: list[Row], top: int, cfg: Config | None = None) -> str:
    """The first `top` rows, and the recommended one wherever it falls, as markdown with a line saying how they are
    sorted. `cfg`: the config planned, whose micro_batch a row that differs is marked against."""
    beyond = [r for r in rows[top:] if r.recommended]  # shown after a gap, at its own rank
    m0 = cfg.train.micro_batch if cfg is not None else None
    lines = [f"{len(rows)} layouts, sorted: {SORTED_BY}. * = recommended. One row per layout (dp pp ep tp cp M m); "
             f"its schedule and zero level are the recommendation rule's pick among its variants (the lowest zero "
             f"level within {100 * ZERO_SLACK:.0f}% of the fastest that fits); 'others': how many more variants were "
             f"planned, their tokens/s against the row's. An m marked '(config N)' trains a different model.", "",
             "| # | dp | pp | ep | tp | cp | M | m | schedule | zero | tokens/s | step (ms) | mem/rank (GiB) | fits | "
             "dominant cost | others |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---|---|"]
    for r in rows[:top] + beyond:
        if beyond and r is beyond[0] and r.rank > top + 1:
            lines.append("| … |" + " |" * 15)
        L, p = r.layout, r.pred
        m = f"{L.micro_batch}" + (f" (config {m0})" if m0 is not None and L.micro_batch != m0 else "")
        cells = [f"{r.rank}{'*' if r.recommended else ''}", *(str(v) for v in (L.dp, L.pp, L.ep, L.tp, L.cp)),
                 str(L.microbatches), m, L.schedule if L.pp > 1 else "-", str(L.zero), f"{p.tokens_per_sec:,.0f}",
                 f"{1e3 * p.step_time_s:,.1f}", f"{p.peak_mem / GiB:.2f}", "yes" if p.fits else "NO", p.dominant,
                 _others(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def reason(rows: list[Row]) -> str:
    """One line: why the recommended row is the recommendation, naming only rows of the table by their number."""
    rec = next((r for r in rows if r.recommended), None)
    if rec is None:
        return "nothing fits memory; the table is ranked by speed anyway"
    best = rec.pred
    line = (f"fastest layout that fits: {best.tokens_per_sec:,.0f} tok/s, {best.peak_mem / GiB:.2f} of "
            f"{best.mem_limit / GiB:.1f} GiB per rank, dominant cost {best.dominant}")
    if rec.rank > 1:  # a faster row was passed over: fewer CP ranks or a lower zero level within ZERO_SLACK
        first = rows[0].pred
        line = (f"{100 * (first.tokens_per_sec / best.tokens_per_sec - 1):.1f}% slower than row 1 "
                f"({first.layout.short()}), within the {100 * ZERO_SLACK:.0f}% by which fewer CP ranks or a lower "
                f"zero level are preferred; {best.tokens_per_sec:,.0f} tok/s, {best.peak_mem / GiB:.2f} of "
                f"{best.mem_limit / GiB:.1f} GiB per rank, dominant cost {best.dominant}")
    else:
        nxt = next((r for r in rows[1:] if r.pred.fits), None)
        if nxt is not None:
            d = 100 * (1 - nxt.pred.tokens_per_sec / best.tokens_per_sec)
            line += f"; the next, row {nxt.rank} ({nxt.layout.short()}), is {d:.1f}% slower ({nxt.pred.dominant})"
    faster = [r for r in rows if not r.pred.fits and r.pred.tokens_per_sec > best.tokens_per_sec]
    if faster:  # rows over memory sort after the fitting ones: say where
        f = faster[0]
        line += (f"; row {f.rank} ({f.layout.short()}) would be faster but needs {f.pred.peak_mem / GiB:.1f} GiB at "
                 f"its smallest")
    if best.layout.zero:
        lower = [p for p in rec.others if p.layout.zero < best.layout.zero and p.fits]
        if lower:
            q = max(lower, key=lambda p: p.tokens_per_sec)
            line += (f"; zero {best.layout.zero} is {100 * (best.tokens_per_sec / q.tokens_per_sec - 1):.0f}% "
                     f"faster than this layout at zero {q.layout.zero}")
        elif any(p.layout.zero < best.layout.zero for p in rec.others):
            line += f"; zero {best.layout.zero} is what lets this layout fit"
    return line


def batch_changes(cfg: Config, layout: Layout, opts: PlanOptions) -> list[str]:
    """Each way the layout's batch differs from the config's, with its consequence: a different global batch or
    micro-batch size m trains a different model (the step's data; the MoE balance loss and capacity are per
    microbatch of m sequences); a different M at the same m and global batch trains the same one."""
    out = []
    B0, B = cfg.layout_batch, opts.global_batch or cfg.layout_batch
    if B != B0:
        out.append(f"global batch {B0} -> {B} sequences (--global-batch): a DIFFERENT MODEL from the config's "
                   f"(another batch per step); set --train.global_batch {B} to train it")
    m0, M0 = cfg.train.micro_batch, cfg.parallel.microbatches
    if layout.micro_batch != m0:
        out.append(f"train.micro_batch {m0} -> {layout.micro_batch}: a DIFFERENT MODEL from the config's (the MoE "
                   f"balance loss and expert capacity are per microbatch of m sequences); --micro-batch {m0} plans "
                   f"only layouts that keep it")
    if layout.microbatches != M0:
        why = ("the same model: m and the global batch dp*ep*M*m are kept, only how the batch is split over ranks "
               "and microbatches changes" if layout.micro_batch == m0 and B == B0 else
               f"what dp*ep*M*m = {B} leaves at dp*ep = {layout.dp * layout.ep} and m = {layout.micro_batch}")
        out.append(f"parallel.microbatches {M0} -> {layout.microbatches}: {why}")
    return out


def no_layout(world: int, batch: int, micro_batch: int) -> str:
    """The line for a search that found no layout: the batch it tried to split, and the flags that change it."""
    m = f" of m = {micro_batch} (--micro-batch; 'any' tries every m)" if micro_batch else ""
    return (f"no valid layout of {world} ranks for this config at global batch {batch} sequences{m}; set "
            f"--global-batch to one that dp*ep*M*m can hold")
