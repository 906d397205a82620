"""`nanotitan verify --fuzz N --seed S`: N configurations drawn from the whole composition space, each verified
against one process as `nanotitan verify` does (check.py), reported as a table (docs/verify.md "The fuzzer").

The space: a layout of dp/pp/ep/tp/cp over 2-8 ranks; the model family (the default MoE, DeepSeek-V3-shaped with MLA,
MTP, group routing and a dense first layer, Qwen3-shaped with QK-norm and GQA); the MoE's options (dropless or
capacity, the aux-free bias, group routing, shared experts, balanced placement with replicas, grouped GEMMs, EP's
overlaps); zero 0-3, the DP flavour, the schedule, SP, CP's attention, activation checkpointing, fp32 or bf16;
AdamW or Muon with QK-clip; FP8 (rowwise, tensorwise, mxfp8). Every case is small (the tests' tiny model, B = 16
sequences of 16 tokens, 2 steps). Draws come in groups of GROUP layouts of one model draw, so the one-process
reference runs once a group. The same seed draws the same cases, whatever `--chunk` runs of them a log already holds.

A draw the config refuses is a refusal: its ConfigError's line, matched to the refusal table (REFUSALS: one row
per forbidden combination, why, and whether it is planned; docs/verify.md prints it).
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ..config.config import ConfigError, load_config
from .check import AXES, verify

GROUP = 4  # layouts drawn per model draw (they share its one-process reference)
B, m, S = 16, 2, 16  # sequences per step, per microbatch; tokens per sequence

# The tests' tiny model (configs/debug.toml's shape) with 8 experts, so that they fold over up to 8 EP x CP x TP ranks.
BASE = ("--model.d_model", "32", "--model.n_heads", "4", "--model.ffn_dim", "48", "--model.n_layers", "4",
        "--model.num_experts", "8", "--model.top_k", "2", "--model.aux_coef", "0.05", "--data.vocab_size", "300",
        "--train.seq_len", str(S), "--train.micro_batch", str(m), "--train.steps", "10", "--train.lr", "3e-3",
        "--train.warmup_steps", "2", "--train.grad_clip", "0.5", "--train.threads", "1")

FAMILIES = {
    "default": (),
    # DeepSeek-V3's shapes in small (tests/helpers/equivalence.py DEEPSEEK): MLA with a q latent, sigmoid group-limited
    # routing with the sequence-wise balance loss and the aux-free bias, a dense first layer, a shared expert, MTP
    "deepseek": ("--model.kv_lora_rank", "16", "--model.q_lora_rank", "12", "--model.qk_nope_head_dim", "8",
                 "--model.qk_rope_head_dim", "4", "--model.v_head_dim", "6", "--model.router_score", "sigmoid",
                 "--model.n_group", "4", "--model.topk_group", "2", "--model.aux_scope", "sequence",
                 "--model.first_k_dense", "1", "--model.shared_experts", "1", "--model.mtp_layers", "1",
                 "--model.routed_scale", "2.5", "--model.bias_update_rate", "1e-3"),
    # Qwen3-MoE's attention: per-head q/k norms, 2 KV heads (split over TP2, replicated over TP4)
    "qknorm_gqa": ("--model.n_kv_heads", "2", "--model.qk_norm", "head"),
}

# (what, [bundles of flags]): per case and row, the option's default (no flag) half the time, else one bundle
MODEL_DRAWS = [
    ("capacity", [("--model.capacity_factor", "1.0"), ("--model.capacity_factor", "1.5")]),
    ("aux-free bias", [("--model.bias_update_rate", "1e-3")]),
    ("group routing", [("--model.n_group", "2", "--model.topk_group", "1")]),
    ("shared experts", [("--model.shared_experts", "1"),
                        ("--model.shared_experts", "1", "--model.shared_ffn_dim", "16", "--model.shared_expert_gate",
                         "true")]),
    ("router", [("--model.z_loss_coef", "1e-3"), ("--model.router_score", "sigmoid")]),
    # QK-clip's TAU below the tiny model's max logits (~0.05 at init): it clips from the first step
    ("optimizer", [("--train.optimizer", "muon"), ("--train.optimizer", "muon", "--train.qk_clip", "0.03"),
                   ("--train.qk_clip", "0.03")]),
    ("dtype", [("--train.dtype", "bf16")]),
    # (fp8_comm beside rowwise: a third bundle would move the fixed seed's draws)
    ("fp8", [("--train.fp8", "rowwise", "--parallel.fp8_comm", "true"), ("--train.fp8", "tensorwise")]),
    ("documents", [("--model.attn_mask", "doc"), ("--model.attn_mask", "doc", "--model.doc_positions", "global")]),
]
LAYOUT_DRAWS = [
    ("zero", [("--parallel.zero", "1"), ("--parallel.zero", "2"), ("--parallel.zero", "3")]),
    ("schedule", [("--parallel.schedule", "gpipe"), ("--parallel.schedule", "zb1"),
                  ("--parallel.schedule", "interleaved", "--parallel.virtual_stages", "2")]),
    ("checkpointing", [("--train.activation_checkpointing", "true")]),
    ("placement", [("--parallel.expert_placement", "balanced", "--parallel.rebalance_every", "1"),
                   ("--parallel.expert_placement", "balanced", "--parallel.rebalance_every", "1",
                    "--parallel.expert_replicas", "2")]),
    ("sequence parallel", [("--parallel.sp", "false")]),
    # the document-balanced split needs the model's documents: beside a causal model (a refusal) only MISFIT_P
    ("cp attention", [("--parallel.cp_impl", "a2a"), ("--parallel.cp_split", "docs"),
                      ("--parallel.cp_split", "docs", "--parallel.cp_impl", "a2a")]),
    ("ep overlap", [("--parallel.ep_overlap", "true"), ("--parallel.ep_overlap_microbatches", "true")]),
    ("dp flavour", [("--parallel.dp_impl", "torch_ddp"), ("--parallel.bucket_mb", "1e-4")]),
    ("experts impl", [("--model.experts_impl", "grouped")]),
    # static EP dispatch (its grouped experts with it); capacity 1 overflows on a skewed router: the step's replay
    ("ep dispatch", [("--parallel.ep_dispatch", "static", "--model.experts_impl", "grouped"),
                     ("--parallel.ep_dispatch", "static", "--model.experts_impl", "grouped",
                      "--parallel.ep_capacity", "1")]),
    # CUDA graphs (with the compiled blocks they replay): the fuzzer's CPU ranks can only see the refusal
    ("cuda graphs", [("--train.cuda_graphs", "true", "--train.compile", "true", "--train.device", "cpu")]),
]
DEFAULT_P = 0.5  # how often each row keeps its default
# Where an option means something, by its first flag: off the layouts it fits, it is drawn only MISFIT_P of the
# time (so that the config's refusals of it stay in the counts, without spending most cases on them).
FITS = {"--parallel.zero": lambda l: l["dp"] * l["ep"] > 1,
        "--parallel.schedule": lambda l: l["pp"] > 1,
        "--parallel.expert_placement": lambda l: l["ep"] * l["cp"] * l["tp"] > 1,
        "--parallel.sp": lambda l: l["tp"] > 1,
        "--parallel.cp_impl": lambda l: l["cp"] > 1,
        "--parallel.cp_split": lambda l: l["cp"] > 1 and l["docs"],  # the documents' split: the model's documents
        "--parallel.ep_overlap": lambda l: l["ep"] > 1,
        "--parallel.ep_dispatch": lambda l: l["ep"] * l["cp"] * l["tp"] > 1,
        "--parallel.ep_overlap_microbatches": lambda l: l["ep"] > 1 and l["tp"] * l["cp"] == 1,
        "--parallel.dp_impl": lambda l: l["dp"] == l["dp"] * l["pp"] * l["ep"] * l["tp"] * l["cp"],
        "--train.cuda_graphs": lambda l: False}  # a CPU rank has no CUDA stream: drawn MISFIT_P of the time
MISFIT_P = 0.1
# train.fp8 mxfp8, drawn per case from its own stream (the seed's other draws stay where they were): its blocks of 32
# need the experts' width a multiple of 32 (ffn_dim 64) and, at S = 16, no TP or CP (heads of 16 a TP rank, CP
# chunks of 4 tokens: refused); the default family's widths only (deepseek's latents, qwen3's 2 KV heads are 16).
MX_FLAGS = ("--train.fp8", "mxfp8", "--parallel.fp8_comm", "false", "--model.ffn_dim", "64")
MX_P = 0.25


def _mx(seed: int, index: int, family: str, layout: dict) -> list[str]:
    rng = random.Random(f"mxfp8:{seed}:{index}")
    fits = family == "default" and layout["tp"] * layout["cp"] == 1
    return list(MX_FLAGS) if rng.random() < (MX_P if fits else MX_P * MISFIT_P) else []


def _pick(rng: random.Random, rows: list, layout: dict | None = None) -> list[str]:
    out = []
    for _, bundles in rows:
        if rng.random() < DEFAULT_P:
            continue
        fit = [b for b in bundles if layout is None or FITS.get(b[0], lambda l: True)(layout)]
        if rng.random() < MISFIT_P:
            out += rng.choice(bundles)
        elif fit:
            out += rng.choice(fit)
    return out


# The refusal table: one row per forbidden combination (docs/verify.md "Refusals"): (key, the ConfigError's pattern,
# why it is refused, its plan: "by design" (nothing to lift), "open" (liftable, no work planned yet), "planned" (work
# filed)). A refusal that matches no row is "other" (a row to add, or a draw to fix).
REFUSALS = [
    ("ddp-not-pure-dp", r"torch_ddp supports pure DP only|dp_impl=torch_ddp.*not with parallel\.(tp|cp)|"
     r"dp_impl=torch_ddp \(use bucketed\): not with parallel\.tp",
     "torch DDP averages over its own group, which is docs/design.md's average only for pure DP: it is a baseline",
     "by design"),
    ("zero-with-ddp", r"parallel\.zero=\d shards our own DP; torch DDP replicates",
     "ZeRO shards our own reducer's buckets; DDP is the replicated baseline", "by design"),
    ("zero-nothing-to-shard", r"shards over dp\*ep ranks, here 1", "ZeRO needs dp*ep > 1 ranks to shard over",
     "by design"),
    ("zero3-schedule", r"zero=3 \(FSDP2\) runs with the gpipe and 1f1b",
     "FSDP2 reduce-scatters a block when its input gradient is done (before zb1's deferred W) and gathers on the root "
     "forward, which interleaved chunks never call", "open"),
    ("interleaved-microbatches", r"interleaved needs parallel\.microbatches",
     "Megatron's interleaved schedule runs the microbatches in groups of pp", "by design"),
    ("interleaved-chunks", r"chunks need at least as many layers", "every virtual stage needs a layer", "by design"),
    ("lanes-need-ep", r"ep_overlap_microbatches hides EP all-to-alls", "two lanes overlap EP's all-to-alls: none at "
     "ep=1", "by design"),
    ("lanes-need-microbatches", r"ep_overlap_microbatches runs one microbatch's forward beside",
     "a forward beside another microbatch's backward needs two microbatches", "by design"),
    ("lanes-zero3", r"ep_overlap_microbatches runs with zero 0-2", "FSDP2's hooks are not safe in two threads", "open"),
    ("lanes-tp-cp", r"ep_overlap_microbatches: two lanes would interleave the (TP|CP) collectives",
     "the two lanes would interleave TP's (CP's) collectives on one group", "open"),
    ("ep-overlap-one-expert", r"ep_overlap pipelines groups of an EP rank's experts",
     "EP overlap pipelines groups of a rank's experts: one expert per rank makes one group", "by design"),
    ("qk-clip-qk-norm", r"qk_clip=.* needs model\.qk_norm none",
     "a normalised q or k ignores its weights' scale: clipping them changes nothing", "by design"),
    ("qk-clip-cp", r"train\.qk_clip, whose per-head max logit needs every key",
     "QK-clip's per-head max logit needs every key, and CP's ring sees blocks", "open"),
    ("placement-one-rank", r"expert_placement=balanced places experts over the EP ranks",
     "placement moves experts between the ranks a layer's experts fold over (EP x CP x TP): one rank has nowhere "
     "to move them", "by design"),
    ("replicas-over-ranks", r"expert_replicas=\d exceeds the \d EP ranks",
     "an expert cannot have more copies than the ranks its layer's experts fold over", "by design"),
    ("a2a-heads", r"cp_impl=a2a splits heads", "Ulysses splits each TP rank's heads over CP", "by design"),
    ("cp-split-docs", r"parallel\.cp_split=docs balances documents",
     "the document-balanced split reads the documents' starts: a causal window has none", "by design"),
    ("fp8-width", r"gives an FP8 GEMM dimension \d+( per TP rank \(of \d+\))?, not a multiple of (16|32)",
     "the GPU's FP8 GEMMs take dimensions in multiples of 16 (the deepseek model's q latent is 12), MXFP8's of its "
     "32-element blocks", "by design"),
    ("mxfp8-token-blocks", r"train\.fp8=mxfp8 (takes the weight gradients' blocks|with parallel\.(cp|tp|cp_split))",
     "the weight gradients' 32-token blocks must be whole on a rank: each CP chunk or TP run of a sequence (and a "
     "microbatch's tokens) a multiple of 32", "by design"),
    ("mxfp8-comm", r"parallel\.fp8_comm sends per-row FP8 operands, not MXFP8's blocks",
     "the EP dispatch's FP8 payload is per-row e4m3, not MXFP8's blocks", "open"),
    ("fp8-replicated-kv", r"train\.fp8=\w+ with parallel\.tp=\d not dividing model\.n_kv_heads",
     "KV projections replicated over TP take partial output gradients, which FP8 would round before their sum",
     "by design"),
    ("fp8-mla-ring", r"train\.fp8=\w+ with MLA under parallel\.cp_impl=ring",
     "the ring expands each step's latent with its own kv_b_proj call: a scale per step, not per sequence", "open"),
    ("fp8-comm-off", r"parallel\.fp8_comm=true sends FP8 operands",
     "FP8 payloads need FP8 operands: train.fp8 off makes none", "by design"),
    ("fp8-static-dispatch", r"train\.fp8=\w+ with parallel\.ep_dispatch=static",
     "the FP8 experts run the per-expert loop, sized by host counts", "open"),
    ("fp8-comm-zero3-compile", r"parallel\.fp8_comm=true at parallel\.zero=3 gathers",
     "zero 3's FP8 all-gather hands the blocks a weight subclass (model/fp8_weight.py) that compile is not tested "
     "with", "open"),
    ("fp8-ep-overlap", r"train\.fp8=\w+ with parallel\.ep_overlap",
     "the overlapped experts' chunks run their own GEMMs, in high precision", "open"),
    ("kv-heads-tp", r"parallel\.tp=\d and model\.n_kv_heads", "KV heads are split, or replicated when fewer than the "
     "TP ranks: one must divide the other", "by design"),
    ("tp-divides", r"parallel\.tp=\d must divide", "TP splits heads, hidden units, vocabulary and sequence",
     "by design"),
    ("experts-fold", r"must be divisible by parallel\.ep\*(cp\*)?tp", "the experts fold over EP x CP x TP",
     "by design"),
    ("static-nothing", r"ep_dispatch=static keeps every split size on the device, and parallel\.ep\*cp\*tp=1",
     "static dispatch shapes the EP all-to-alls: there are none", "by design"),
    ("static-host-sizes", r"ep_dispatch=static keeps every split size on the device, and (model\.experts_impl|"
     r"parallel\.ep_overlap)", "the loop experts and EP overlap's groups read sizes to the host", "open"),
    ("cuda-graphs-cpu", r"train\.cuda_graphs=true records CUDA graphs, and train\.device=cpu",
     "a CUDA graph is a CUDA stream's recording: the fuzzer's ranks are CPU ones", "by design"),
    ("bf16-reduce", r"reduce_dtype=bf16 is implemented by the bucketed Reducer", "only our Reducer reduces in bf16",
     "open"),
]


@dataclass
class Case:
    index: int
    group: int  # cases of one group share their model draw (and so their one-process reference)
    family: str
    flags: list[str]  # the drawn flags, on top of BASE and before the user's


def layouts() -> list[dict[str, int]]:
    """Every dp/pp/ep/tp/cp of 1, 2 or 4 over 2..8 ranks (pp <= 4 layers, ep*cp*tp <= 8 experts)."""
    sizes = (1, 2, 4)
    out = []
    for dp in sizes:
        for pp in sizes:
            for ep in sizes:
                for tp in sizes:
                    for cp in sizes:
                        world = dp * pp * ep * tp * cp
                        if 2 <= world <= 8:
                            out.append({"dp": dp, "pp": pp, "ep": ep, "tp": tp, "cp": cp})
    return out


def draw(n: int, seed: int) -> list[Case]:
    """The first n cases of `seed` (case i is the same whatever n)."""
    rng = random.Random(seed)
    every = layouts()
    cases: list[Case] = []
    while len(cases) < n:
        group = len(cases) // GROUP
        family = rng.choice(sorted(FAMILIES))
        model = [*FAMILIES[family], *_pick(rng, MODEL_DRAWS)]
        if _refused(model):  # refused on one process already: one case (its refusal), not a group of them
            cases.append(Case(len(cases), group, family, model))
            continue
        for _ in range(GROUP):
            lay = {**rng.choice(every), "docs": "--model.attn_mask" in model}  # a draw's flag: the doc mask
            flags = [f for a in AXES for f in (f"--parallel.{a}", str(lay[a]))]
            flags += ["--parallel.microbatches", str(B // (lay["dp"] * lay["ep"] * m))]
            flags += _pick(rng, LAYOUT_DRAWS, lay)
            flags += _mx(seed, len(cases), family, lay)
            cases.append(Case(len(cases), group, family, model + flags))
    return cases[:n]


def _refused(model: list[str]) -> bool:
    try:
        load_config(None, [*BASE, *model])
    except ConfigError:
        return True
    return False


def refusal(line: str) -> str:
    """The refusal table's key for a ConfigError's line ("other" when no row matches)."""
    return next((key for key, pattern, _, _ in REFUSALS if re.search(pattern, line)), "other")


def run_case(case: Case, path: str | None, overrides: list[str], steps: int, references: dict) -> dict:
    """One case's log entry: {index, flags, result (passed, diverged, failed, refused), line, reason, seconds}."""
    t0 = time.perf_counter()
    entry = {"index": case.index, "family": case.family, "flags": case.flags}
    try:
        cfg = load_config(path, [*BASE, *case.flags, *overrides])
        outcome = verify(cfg, None, steps, start_method="forkserver", references=references)
    except ConfigError as e:
        return {**entry, "result": "refused", "line": str(e), "reason": refusal(str(e)),
                "seconds": round(time.perf_counter() - t0, 1)}
    result = "passed" if outcome.code == 0 else "failed" if outcome.failed else "diverged"
    first = outcome.first
    worst: dict[str, float] = {}  # per phase, over the rows held to a bar
    for r in outcome.rows:
        if math.isfinite(r.tol) and math.isfinite(r.rel):
            worst[r.phase] = max(worst.get(r.phase, 0.0), r.rel)
    return {**entry, "result": result, "line": outcome.line, "first": first.name if first else None,
            "loss_step": outcome.loss_step, "worst": worst, "seconds": round(time.perf_counter() - t0, 1)}


def read_log(path: str | None, seed: int) -> dict[int, dict]:
    """The cases a log (JSON lines) already holds for this seed, by index."""
    if not path or not Path(path).exists():
        return {}
    done = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            if entry.get("seed") == seed:
                done[entry["index"]] = entry
    return done


def table(entries: list[dict]) -> list[str]:
    """The report: one line per case, then the counts (refusals by reason)."""
    lines = []
    for e in entries:
        what = e.get("first") or e["line"] if e["result"] != "passed" else ""
        if e["result"] == "refused":
            what = f"[{e['reason']}] {e['line']}"
        flags = " ".join(f"{a.removeprefix('--')}={b}" for a, b in zip(e["flags"][::2], e["flags"][1::2]))
        lines.append(f"{e['index']:>4}  {e['result']:<8}  {e['family']}: {flags}")
        if what:
            lines.append(f"        {what}")
    counts = {r: sum(e["result"] == r for e in entries) for r in ("passed", "diverged", "failed", "refused")}
    lines.append("fuzz: " + ", ".join(f"{n} {r}" for r, n in counts.items()) + f" of {len(entries)} cases")
    reasons: dict[str, int] = {}
    for e in entries:
        if e["result"] == "refused":
            reasons[e["reason"]] = reasons.get(e["reason"], 0) + 1
    if reasons:
        lines.append("refused: " + ", ".join(f"{k} {n}" for k, n in sorted(reasons.items(), key=lambda kv: -kv[1])))
    return lines


def fuzz(n: int, seed: int, path: str | None, overrides: list[str], log: str | None = None, steps: int = 2,
         chunk: int = 0, say=print) -> list[dict]:
    """Verify the first n cases of `seed`: those `log` lacks (at most `chunk` of them, 0: all), appended to it as
    they finish. Returns every case's entry, in order (those still to run left out)."""
    done = read_log(log, seed)
    references: dict = {}  # the one-process runs of the current group's model draw
    ran, group = 0, -1
    for case in draw(n, seed):
        if case.index in done:
            continue
        if chunk and ran >= chunk:
            break
        if case.group != group:  # a new model draw: the last one's reference is not needed again
            references.clear()
            group = case.group
        entry = {"seed": seed, **run_case(case, path, overrides, steps, references)}
        ran += 1
        done[case.index] = entry
        say(f"{case.index:>4}  {entry['result']:<8}  {entry['seconds']:>5.1f}s  {entry.get('first') or ''}")
        if log:
            with open(log, "a") as f:
                f.write(json.dumps(entry) + "\n")
    return [done[i] for i in sorted(done) if i < n]


def fuzz_main(path: str | None, overrides: list[str], n: int, seed: int, log: str | None, steps: int,
              chunk: int) -> int:
    entries = fuzz(n, seed, path, overrides, log, steps, chunk)
    print("\n".join(table(entries)))
    return 1 if any(e["result"] in ("diverged", "failed") for e in entries) else 0
