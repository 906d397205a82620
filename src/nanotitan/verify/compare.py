"""A verify run's judge: one process's tensors and figures against a layout's, in execution order.

Every tensor is compared as a whole, by its relative error ||layout - reference|| / ||reference|| over every box any
rank holds of it (replicas each count: a replica that drifted is caught as a wrong slice is), and its boxes must
cover it (an expert left behind, a slice missing: "covered N of M"). The rows come in the order the step ran them:
    step 1    lr; each module's forward output (the reference's call order); the loss terms; each parameter's
              gradient (backward order: the reverse of the parameters' order); the grad norm and the skip verdict;
              every parameter, buffer and optimizer state after the update; QK-clip's max logit
    step k>1  lr, loss terms, grad norm, skip verdict, max logit
The first row over its tolerance is the first divergence; the first step whose loss is over its bar is named apart.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

# Relative tolerances by class (docs/verify.md "Tolerances"). fp32: a sum reassociated over ranks moves a result by
# ~1e-7 relative per operation; forward outputs, gradients, loss terms and norms are held to docs/design.md's 1e-5 (the
# fuzzer's fp32 cases: at most 6.7e-7). One AdamW step moves a coordinate whose gradient is ~0 by up to lr whatever
# its sign: the update is held to 1e-4 (measured: at most 3.1e-5). A planted one-element error in any collective lands
# 28-13000x above the bar of the first tensor it reaches (docs/experiments/verify_fuzz.md).
FP32 = {"forward": 1e-5, "loss": 1e-5, "norm": 1e-5, "backward": 1e-5, "update": 1e-4, "exact": 0.0}
# bf16 (train.dtype=bf16): every layout rounds its GEMMs' sums differently, so a token's top-k or capacity choice can
# flip between layouts: the loss is held to the documented bound u/sqrt(T) (`bf16`), the other figures (balance
# loss, grad norm, max logit) to 2^-5, the tensors only against gross errors (a missing, doubled or sqrt(2)-scaled
# contribution moves them by >= 0.4; a flipped token moves a dense tensor by ~1/sqrt(the tokens)). What depends on
# which tokens reach each expert ("routed": an expert's gradient, weights and optimizer state, a few tokens each; the
# aux-free router bias, +-rate by the sign of mean load - load) is not held: one flip can move it by O(1).
BF16 = {"forward": 0.25, "loss": 2.0**-8, "norm": 2.0**-5, "backward": 0.35, "update": 0.35, "routed": math.inf,
        "exact": 0.0}


def fp8(tokens: int) -> dict:
    """FP8 (train.fp8): a cast reads the same bits in every layout while its input is the same. Step 1's are (the
    same weights and data), so step 1 is held to fp32's bars: a scale reduced over the wrong ranks moves whole FP8
    steps and is caught there. After it each layout's weights differ in their last bits, and a cast turns a
    last-bit difference at a rounding boundary into a whole FP8 step (a block's power-of-2 scale doubling re-rounds
    every element of it): the later steps' figures are held to bf16's bars ("later"; measured: a fuzz draw, DP4 PP2
    at mxfp8, whose step-2 grad norm moved 4.6e-5 with its loss within 3.4e-7)."""
    return {**FP32, "later": bf16(tokens)}


def routed(key: str) -> bool:
    """A tensor set per expert by the tokens that reach it: an expert's (gradient, weights, state), the router bias."""
    return ".experts." in key or key.endswith(".router_bias")


def bf16(tokens: int) -> dict[str, float]:
    """BF16 with the loss bound of a step of `tokens` tokens: u / sqrt(T), u = 2^-8 (docs/precision.md)."""
    return {**BF16, "loss": 2.0**-8 / math.sqrt(tokens)}


@dataclass
class Row:
    """One compared tensor or figure."""
    name: str  # "layers.0.attn", "grad layers.0.attn.q_proj.weight", "optim layers.0.moe.experts.W_gate.3.exp_avg"
    phase: str  # forward, loss, norm (the per-step figures' classes), backward, update, exact (lr, skip verdict)
    step: int
    rel: float
    tol: float
    axes: list[str] = field(default_factory=list)  # the layout's axes that shard or reduce it
    note: str = ""  # why it fails besides its error: missing, not covered

    @property
    def ok(self) -> bool:
        return not self.note and self.rel <= self.tol


def whole(size, boxes) -> torch.Tensor:
    """The reference's tensor from its boxes (one process: one box each)."""
    t = torch.zeros(size)
    for off, b in boxes:
        t[_region(off, b)] = b
    return t


def _region(off, b) -> tuple:
    return tuple(slice(o, o + n) for o, n in zip(off, b.shape))


def rel_error(ref: torch.Tensor, boxes: list) -> tuple[float, str]:
    """(||boxes - ref|| / ||ref|| over every box, '' or what the boxes leave uncovered)."""
    covered = torch.zeros(ref.shape, dtype=torch.bool)
    diff = norm = 0.0
    for off, b in boxes:
        if tuple(b.shape) and any(o + n > s for o, n, s in zip(off, b.shape, ref.shape)):
            return math.inf, f"a box at {tuple(off)} of {tuple(b.shape)} lies outside {tuple(ref.shape)}"
        r = ref[_region(off, b)]
        diff += float((b.double() - r.double()).pow(2).sum())
        norm += float(r.double().pow(2).sum())
        covered[_region(off, b)] = True
    n = int(covered.sum())
    if n < covered.numel():
        return math.inf, f"the ranks hold {n} of its {covered.numel()} elements"
    if diff == 0.0:
        return 0.0, ""
    return (math.sqrt(diff / norm) if norm > 0 else math.inf), ""


def scalar_rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return math.inf
    return abs(a - b) / abs(b) if b else math.inf


def merged(ranks: list[dict]) -> dict[str, tuple]:
    """{key: (whole size, every rank's boxes)}."""
    out: dict[str, tuple] = {}
    for r in ranks:
        for key, (size, boxes) in r["tensors"].items():
            if key in out and tuple(out[key][0]) != tuple(size):
                out[key] = (size, out[key][1] + [((0,) * len(size), torch.full((1,), math.nan))])  # shapes disagree
            else:
                out.setdefault(key, (size, []))[1].extend(boxes)
    return out


class Layout:
    """How the layout lays each kind of tensor over its axes: `axes(key)` for a report row."""

    def __init__(self, sizes: dict[str, int], sliced: set[str]):
        self.on = {a for a, n in sizes.items() if n > 1}
        self.sliced = sliced  # the parameters a TP rank holds a slice or a partial gradient of

    def pick(self, *axes: str) -> list[str]:
        return [a for a in axes if a in self.on]

    def axes(self, key: str) -> list[str]:
        kind, _, name = key.partition(".")
        if kind == "act":  # rows by data rank, positions by sequence and SP shard, layers by stage
            return self.pick("dp", "ep", "cp", "tp", "pp")
        if ".experts." in name:  # experts over ep x cp x tp, each summed over dp (ZeRO's pieces too)
            return self.pick("dp", "ep", "cp", "tp", "pp")
        split = any(name.startswith(p) for p in self.sliced)  # a TP slice, or TP ranks' partial sums
        return self.pick("dp", "ep", "cp", *(["tp"] if split else []), "pp")  # summed over dp x ep x cp


def compare(ref: dict, ranks: list[dict], tol: dict[str, float], layout: Layout) -> list[Row]:
    """Every row (module docstring), in execution order. `ref`: the one-process rank's result; `ranks`: the layout's."""
    got = merged(ranks)
    want = ref["tensors"]
    rows: list[Row] = []

    def tensor(key: str, name: str, phase: str) -> None:
        size, boxes = want[key]
        bar = tol["routed"] if routed(key) and "routed" in tol else tol[phase]
        if key not in got:
            rows.append(Row(name, phase, 1, math.inf, bar, layout.axes(key), "no rank holds it"))
            return
        rel, note = rel_error(whole(size, boxes), got[key][1]) if tuple(got[key][0]) == tuple(size) else \
            (math.inf, f"shape {tuple(got[key][0])} vs {tuple(size)}")
        rows.append(Row(name, phase, 1, rel, bar, layout.axes(key), note))

    steps, theirs = ref["steps"], ranks[0]["steps"]
    for i, mine in enumerate(steps):
        other = theirs[i] if i < len(theirs) else None
        def figure(what: str, phase: str, i=i, mine=mine, other=other) -> None:
            rel = math.inf if other is None else scalar_rel(other[what], mine[what])
            bar = tol.get("later", tol)[phase] if i else tol[phase]
            rows.append(Row(f"step {i + 1} {what}", phase, i + 1, rel, bar, [],
                            "" if other is not None else "the layout stopped before it"))
        figure("lr", "exact")
        if i == 0:
            for name in ref["order"]:
                tensor(f"act.{name}", name, "forward")
        for what in ("ce", "mtp", "loss"):
            figure(what, "loss")
        figure("aux", "norm")  # the balance loss reads routing counts: a bf16 flip moves it by 1/assignments
        if i == 0:
            for key in reversed([k for k in want if k.startswith("grad.")]):
                tensor(key, f"grad {key[5:]}", "backward")
        figure("grad_norm", "norm")
        figure("skipped", "exact")
        if i == 0:
            for key in [k for k in want if k.startswith(("model.", "optim."))]:
                tensor(key, key.replace(".", " ", 1), "update")
        figure("qk_max", "norm")
    extra = sorted(set(got) - set(want))
    rows += [Row(k, "update", 1, math.inf, 0.0, layout.axes(k), "the reference has no such tensor") for k in extra]
    return rows


def first_loss_step(rows: list[Row]) -> int | None:
    """The first step whose loss (any term) is over its bar."""
    bad = [r.step for r in rows if r.name.split()[-1] in ("ce", "aux", "mtp", "loss") and not r.ok]
    return min(bad) if bad else None


def verdict(rows: list[Row]) -> str:
    """The report's last line."""
    first = next((r for r in rows if not r.ok), None)
    if first is None:
        worst = max((r.rel for r in rows if math.isfinite(r.tol)), default=0.0)  # of the rows held to a bar
        return f"verify: equal ({len(rows)} tensors, worst {worst:.2g})"
    why = f"; {first.note}" if first.note else ""
    return f"verify: first divergence: {first.name} (rel {first.rel:.2g} > tol {first.tol:.2g}{why})"


def as_json(rows: list[Row]) -> list[dict]:
    return [{**asdict(r), "ok": r.ok, "rel": r.rel if math.isfinite(r.rel) else None} for r in rows]
