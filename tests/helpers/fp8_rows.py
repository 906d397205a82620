"""The FP8 equivalence rows' runs and bar (tests/equivalence/test_equivalence_fp8*.py, docs/fp8.md): the recipes'
arguments, the launches' rows (name, reference, dp, pp, ep, schedule, extra), the one-process references (the
`run_root` and `refs` fixtures, module-scoped in each file that imports them), and `matrix`, which launches a world's
rows and holds each to the bar (EXACT for the early steps, FLIP_BOUND after, PARAM_BOUND for the parameters).
The rows are split over two test files so that the slow tier's two longest launches run on two pytest workers."""

import contextlib

import pytest
import torch

from tests.helpers.equivalence import LR, STEPS, base_args, layout_args, one_process
from tests.helpers.mp import run_ranks, train_once


ROW, TENSOR = ("--train.fp8", "rowwise"), ("--train.fp8", "tensorwise")
NO_CKPT = ("--train.ckpt_at_end", "false")
Z = "--parallel.zero"
MUON = ("--train.optimizer", "muon", "--train.muon_lr", "0.01")
BALANCED = ("--parallel.expert_placement", "balanced", "--parallel.rebalance_every", "1",
            "--parallel.expert_replicas", "2")
# DeepSeek-V3's shapes in small, every FP8 GEMM dimension a multiple of 16 (q_lora_rank 16, heads of 8 + 8)
DEEPSEEK = ("--model.n_layers", "3", "--model.first_k_dense", "1", "--model.shared_experts", "1",
            "--model.kv_lora_rank", "16", "--model.q_lora_rank", "16", "--model.qk_nope_head_dim", "8",
            "--model.qk_rope_head_dim", "8", "--model.v_head_dim", "8", "--model.router_score", "sigmoid",
            "--model.bias_update_rate", "1e-3", "--model.mtp_layers", "1", "--model.mtp_coef", "0.3")
TP2, CP2 = ("--parallel.tp", "2"), ("--parallel.cp", "2", "--parallel.cp_impl", "ring")  # TP with SP (its default)
E8 = ("--model.num_experts", "8")  # TP2·EP2·CP2 folds the experts over 8 ranks
WIRE = ("--parallel.fp8_comm", "true")  # EP dispatch, zero 3 gathers in FP8; the reference makes the same operands
# mxfp8: the experts' width a multiple of its 32-element blocks; TP2 at d_model 64 (heads of 32 a rank); CP2 at
# sequences of 128 (chunks of 32 tokens: whole blocks of the weight gradients), 4 of them a step
MX = ("--train.fp8", "mxfp8", "--model.ffn_dim", "64")
MX_TP = (*MX, "--model.d_model", "64")
MX_CP = (*MX, "--train.seq_len", "128", "--train.micro_batch", "1", "--parallel.microbatches", "4")
PLANTED = ("--train.steps", "2")  # a planted row: 2 steps, the warmup's lr the 10-step reference's
CKPT = 5
RESUME_FROM = "ref_off_ckpt"  # one process, fp8 off, checkpoint at step CKPT: the resumed row's start

# The bar (docs/fp8.md, "Equivalence rows"). Every scale is one process's, so a row's first steps are one process's
# to float reassociation (measured <= 1.7e-7 over steps 1-3, 4.3e-7 at TP2·EP2·CP2 tensorwise). From then on the
# fp32 reassociation of the gradient sums (~1e-7: DP's, EP's, CP's order of adding, TP's partial sums) moves a
# weight or activation across an FP8 rounding boundary, or a rowwise power-of-2 scale across a power of 2: a flip,
# one e4m3 step (12.5%) of one element or a whole row, which Adam and Muon then carry (`nanotitan verify` on DP2:
# step 1 forward bitwise, gradients 9.7e-8, first over 1e-5 step 4's grad norm). Measured worst over 10 steps:
# 7.4e-5 AdamW rowwise, 5.7e-5 tensorwise, 9.5e-5 Muon, 1.0e-4 TP2·EP2·CP2 tensorwise (fp8-tp-cp-log-2026-12-06.md).
# The loss is a coarse witness of FP8's bits: a planted scale bug (every expert activation scaled over its whole
# call) moves step 1's loss by only 1.6e-5, so the first steps are held to 1e-6, 2x the rows' worst.
EXACT_STEPS, EXACT = 3, 1e-6
FLIP_BOUND = 3e-4
# parameters: a share of lr * steps, the most one can move (measured 2.6e-2 AdamW, 5.9e-2 tensorwise, 4.4e-2 Muon;
# 1.5e-1 tensorwise TP2·EP2·CP2, in layers.1.moe.experts.W_gate: one expert's weight, whose tensorwise scale spans
# the expert, after the loss's first flip at step 4; Adam moves a coordinate whose gradient flipped sign by ~lr)
PARAM_BOUND = 0.2

# (name, reference, dp, pp, ep, schedule, extra)
WORLD2 = [("dp2_zero1", "row", 2, 1, 1, "1f1b", (Z, "1", *ROW)), ("ep2", "row", 1, 1, 2, "1f1b", ROW),
          ("pp2_zb1", "row", 1, 2, 1, "zb1", ROW), ("tensorwise_ep2", "tensor", 1, 1, 2, "1f1b", TENSOR),
          ("mxfp8_ep2", "mx", 1, 1, 2, "1f1b", MX)]
WORLD2_SLOW = [("dp2_zero3", "row", 2, 1, 1, "1f1b", (Z, "3", *ROW)),
               ("muon_dp2_zero1", "muon", 2, 1, 1, "1f1b", (Z, "1", *ROW, *MUON)),
               ("balanced_ep2", "row", 1, 1, 2, "1f1b", (*ROW, *BALANCED)),
               ("tensorwise_dp2_zero1", "tensor", 2, 1, 1, "1f1b", (Z, "1", *TENSOR)),
               ("ep2_from_off", "row_from_off", 1, 1, 2, "1f1b", ROW),
               ("tp2", "row", 1, 1, 1, "1f1b", (*ROW, *TP2)),
               ("tensorwise_tp2", "tensor", 1, 1, 1, "1f1b", (*TENSOR, *TP2)),
               ("cp2", "row", 1, 1, 1, "1f1b", (*ROW, *CP2)),
               ("tensorwise_cp2", "tensor", 1, 1, 1, "1f1b", (*TENSOR, *CP2)),
               ("tensorwise_tp2_planted", "tensor", 1, 1, 1, "1f1b", (*TENSOR, *TP2, *PLANTED)),
               ("ep2_fp8_comm", "row_wire", 1, 1, 2, "1f1b", (*ROW, *WIRE)),
               ("tensorwise_ep2_fp8_comm", "tensor_wire", 1, 1, 2, "1f1b", (*TENSOR, *WIRE)),
               ("dp2_zero3_fp8_comm", "row_wire", 2, 1, 1, "1f1b", (Z, "3", *ROW, *WIRE)),
               ("tensorwise_dp2_zero3_fp8_comm", "tensor_wire", 2, 1, 1, "1f1b", (Z, "3", *TENSOR, *WIRE))]
WORLD2_MX = [("mxfp8_dp2_zero1", "mx", 2, 1, 1, "1f1b", (Z, "1", *MX)),
               ("mxfp8_tp2", "mx_tp", 1, 1, 1, "1f1b", (*MX_TP, *TP2)),
               ("mxfp8_cp2", "mx_cp", 1, 1, 1, "1f1b", (*MX_CP, *CP2))]
WORLD8 = [("dp2pp2ep2", "row", 2, 2, 2, "1f1b", (Z, "1", *ROW)),
          ("deepseek_dp2pp2ep2_zb1", "deepseek", 2, 2, 2, "zb1", (*ROW, *DEEPSEEK)),
          ("tp2ep2cp2", "row8", 1, 1, 2, "1f1b", (*ROW, *E8, *TP2, *CP2)),
          ("tensorwise_tp2ep2cp2", "tensor8", 1, 1, 2, "1f1b", (*TENSOR, *E8, *TP2, *CP2)),
          ("mxfp8_dp2pp2ep2", "mx", 2, 2, 2, "1f1b", (Z, "1", *MX))]
REFS = {"row": ROW, "tensor": TENSOR, "muon": (*ROW, *MUON), "deepseek": (*ROW, *DEEPSEEK), "row8": (*ROW, *E8),
        "tensor8": (*TENSOR, *E8), "row_wire": (*ROW, *WIRE), "tensor_wire": (*TENSOR, *WIRE),
        "mx": MX, "mx_tp": MX_TP, "mx_cp": MX_CP}


def _resume(run_root: str, name: str) -> list[str]:
    return ["--train.resume", f"{run_root}/{RESUME_FROM}/checkpoints/step_{CKPT}"] if name.endswith("_from_off") else []


def _cases(rank, world, cases, corpus_dir, run_root):
    out = []
    for name, _, dp, pp, ep, sched, extra in cases:
        args = (base_args(corpus_dir, f"{run_root}/{world}_{name}") + layout_args(dp, pp, ep, sched, extra)
                + list(NO_CKPT) + _resume(run_root, name))
        with _planted(name.endswith("_planted")):
            out.append(train_once(args))
    return out


@contextlib.contextmanager
def _planted(on: bool):
    """The planted bug of a `_planted` row: TP's and CP's amax reductions left out (each rank scales its slices
    over what it holds), as a layout that forgot them would."""
    from nanotitan.parallel import cp, tp

    saved = tp.max_over, cp.max_over
    if on:
        tp.max_over = cp.max_over = lambda group, axis: (lambda amax: amax)
    try:
        yield
    finally:
        tp.max_over, cp.max_over = saved


@pytest.fixture(scope="module")
def run_root(tmp_path_factory):
    return tmp_path_factory.mktemp("fp8_rows")


@pytest.fixture(scope="module")
def refs(corpus_dir, tmp_path_factory, run_root):
    """get(name): one process at a recipe and model, run when first asked; "row_from_off": the fp8-off run's
    step-CKPT checkpoint resumed at rowwise by one process (the off run first, its checkpoint the row's start)."""
    done = {}

    def get(name: str) -> dict:
        if name in done:
            return done[name]
        if name == "row_from_off":
            off = train_once(base_args(corpus_dir, f"{run_root}/{RESUME_FROM}") + layout_args(1, 1, 1, "1f1b")
                             + ["--train.ckpt_every", str(CKPT)])
            assert len(off["losses"]) == STEPS
            run = one_process(corpus_dir, tmp_path_factory, "ref_fp8_row_from_off",
                              (*ROW, *NO_CKPT, *_resume(str(run_root), "_from_off")))
            assert run["losses"] != get("row")["losses"][CKPT:], "the resumed reference trained the fresh run"
            assert run["losses"] != off["losses"][CKPT:], "fp8 rowwise trained fp8 off's steps"
        else:
            run = one_process(corpus_dir, tmp_path_factory, f"ref_fp8_{name}", (*REFS[name], *NO_CKPT))
        done[name] = {**run, "lr": 1e-2 if name == "muon" else LR}
        return done[name]
    return get


def row_errors(ranks: list[dict], ref: dict, params: bool = True) -> tuple[list[float], float]:
    """A row's relative loss error per step (rank 0's history) and its worst parameter error as a share of the
    largest movement the run allows (lr * steps), over every rank's parameters (its experts against the
    reference's slice; `params` False: losses only)."""
    per_step = [abs(a - b) / abs(b) for a, b in zip(ranks[0]["losses"], ref["losses"], strict=True)]
    worst, where = 0.0, None
    for r in ranks if params else []:
        for pname, (t, start) in r["params"].items():
            want = ref["params"][pname][0]
            want = want if start is None else want[start:start + t.shape[0]]
            part = r["parts"][pname]  # a TP slice: (dim, rank, n)
            want = want if part is None else want.chunk(part[2], dim=part[0])[part[1]]
            err = (t - want).abs().max().item()
            worst, where = (err, pname) if err > worst else (worst, where)
    print(f"  worst parameter: {where}")  # pytest -s
    return per_step, worst / (ref["lr"] * STEPS)


def replicas_equal(name: str, ranks: list[dict]) -> None:
    replicas = {}
    for r in ranks:
        _, p, _ = r["coords"]
        for pname, (t, start) in r["params"].items():
            key = (pname, p, start, r["parts"][pname])  # (experts fold over EP x CP x TP: their first index)
            assert key not in replicas or torch.equal(replicas[key], t), f"{name}: replicas of {pname} differ"
            replicas.setdefault(key, t)


def matrix(world, cases, corpus_dir, run_root, refs, timeout):
    want = {ref: refs(ref) for _, ref, *_ in cases}  # before the launch: the references run in this process
    per_rank = run_ranks(_cases, world, args=(cases, str(corpus_dir), str(run_root)), timeout=timeout,
                         pg_timeout=120)
    rows = {}
    assert len({tuple(r["losses"]) for r in want.values()}) == len(want), "two recipes or models trained the same"
    for (name, ref, *_), ranks in zip(cases, zip(*per_rank)):
        if name.endswith("_planted"):  # the bar must catch it: its early steps miss EXACT by 10x
            per_step = row_errors(list(ranks), {**want[ref], "losses": want[ref]["losses"][:2]}, params=False)[0]
            print(f"fp8 planted row {name}: loss error per step {' '.join(f'{e:.1e}' for e in per_step)}")
            assert max(per_step) > 10 * EXACT, (name, per_step)
            continue
        replicas_equal(name, list(ranks))
        rows[name] = row_errors(list(ranks), want[ref], params="balanced" not in name)  # (slots: placement's test)
        per_step, params = rows[name]
        print(f"fp8 row {name}: loss error per step {' '.join(f'{e:.1e}' for e in per_step)}; params {params:.1e}")
    for name, (per_step, params) in rows.items():
        assert max(per_step[:EXACT_STEPS]) <= EXACT, f"{name}: early loss errors {per_step[:EXACT_STEPS]} > {EXACT}"
        assert max(per_step) <= FLIP_BOUND, f"{name}: loss errors {per_step} over the flip bound {FLIP_BOUND}"
        assert params <= PARAM_BOUND, f"{name}: parameter error {params:.2e} of lr * steps > {PARAM_BOUND}"
