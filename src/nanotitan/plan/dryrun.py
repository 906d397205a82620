"""`nanotitan plan --dry-run --ranks N`: what every rank of an N-rank job would hold, from the real code, on one CPU.

torchtitan's `COMM_MODE=fake_backend` checks that a configuration builds without the cluster; this also reports
what each rank would hold. For each distinct rank, in this one process, with no per-rank process and no allocation:

    1. the launch's checks: `config.validate` at world N (a group that does not divide, too few layers) and the layer
       split of every pipeline stage (a stage with no layer) fail in one line, before anything is built
    2. torch's fake process group at the rank's global rank and world N, and `ParallelDims.build_groups`: every
       group of the job, constructed as a launch constructs them
    3. under a FakeTensorMode (tensors with shapes and dtypes, no data): the real `parallelize` (shard, EP
       dispatcher, broadcasts, gradient sync), the trainer's optimizer (optim/build.py) with what its first step
       creates (its state, Muon's owner plan: the optimizer's `prepare`), then one training step through the real
       step code (`forward_backward`, `finish_grads`, `clip_grads`, the optimizer step, `after_update`) of ONE
       microbatch, the final one (so the DP sync runs), under a byte meter (`TensorBytesMeter`)

A rank reports `param_bytes`, `grad_bytes`, `optim_bytes` (its live tensors after the step, as summary.json
measures them: `memory.live_tensor_bytes`) and `peak_bytes`: the most tensor bytes it holds at once in a step of M
microbatches = the one-microbatch step's peak + (in_flight - 1) x the bytes one microbatch keeps from its forward to
its backward, in_flight being what the schedule holds at once (`parallel.pp.facts.in_flight`: M under GPipe, PP - s
under 1F1B). The interleaved and zb1 schedules run their real M microbatches instead (chunk-microbatches, and deferred
weight gradients that keep part of a microbatch, do not compose that simply).

Which ranks are distinct: a rank's bytes depend on its pipeline stage and, at zero 3, on its place in its FSDP
groups: FSDP2 pads every rank's parameter and gradient shard to the same size, but AdamW's state follows the
unpadded chunk, which is short or empty on the last ranks of a group when a dimension does not divide (a router's 4
rows over 8 ranks). Never on its ep_rank (config requires ep | num_experts, and routing here is balanced), nor its
dp_rank otherwise (zero 1/2 pad every bucket to equal slices). One rank per (stage, zero-3 chunk sizes) is built;
the others get its row.

Fake tensors have no values, so the two data-dependent steps of routing are answered as perfectly balanced, the
planner's assumption: `bincount` returns `minlength` bins and reading counts to the host gives every expert
T*K/E of a microbatch's T*K assignments. Real imbalance adds to the busiest rank's activations: the planner's
`expert_imbalance` term (docs/planner.md), which the comparison turns off (expert_skew 0) to match.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ..config.config import Config, ConfigError, validate
from ..config.hardware import Hardware
from ..observe.memory import live_tensor_bytes, storage_key
from ..observe.metrics import fmt_bytes
from ..model.spec import build_chunk_specs, chunk_layer_counts
from ..model.transformer import num_moe_layers
from ..parallel.pp import facts as pp_facts
from ..parallel import step
from ..parallel.dims import ParallelDims
from ..optim.build import build_optimizer
from ..parallel.parallelize import parallelize
from .fit.measure import TensorBytesMeter

CPU = torch.device("cpu")
FIELDS = ("param_bytes", "grad_bytes", "optim_bytes", "peak_bytes")


@dataclass
class RankBytes:
    """What one distinct rank holds, and the ranks that hold the same."""
    rank: int  # the rank that was built
    coords: tuple[int, int, int]
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    peak_bytes: int  # most tensor bytes at once in a step of M microbatches
    step_peak_bytes: int  # ... in the one-microbatch step that was run
    microbatch_bytes: int  # kept by one microbatch from its forward to its backward
    in_flight: int  # microbatches the schedule holds at once on this stage
    same: list[int] = field(default_factory=list)  # every rank with these bytes (this one included)


def layout_errors(cfg: Config, world: int) -> None:
    """The launch's own checks at world N, in one line each: validate (groups that do not divide, too few layers
    for the stages) and every stage's layer split (no stage without a layer)."""
    validate(cfg, world_size=world)
    counts = chunk_layer_counts(cfg)
    empty = [c for c, n in enumerate(counts) if n <= 0]
    if empty:
        raise ConfigError(f"parallel.pp_layers={counts}: pipeline chunk {empty[0]} would own no layer "
                          f"(--parallel.pp_layers, or fewer stages: --parallel.pp)")
    for s in range(cfg.parallel.pp):  # the specs a rank of each stage would build (ep_rank 0: all divide alike)
        build_chunk_specs(cfg, s, 0)


class _BalancedRouting(TorchDispatchMode):
    """Answers the two data-dependent steps of MoE routing on fake tensors, as perfectly balanced routing would:
    `bincount(ids, minlength=n)` has n bins, and reading an integer tensor to the host (`.tolist()` of the
    counts per expert, or of the [send, recv] counts per EP peer) gives element i the N/E assignments of expert
    i mod E (the remainder to the first experts), N the assignments of the last bincount (T*K; fewer in an MTP
    depth's block). Floats read to the host are 0, booleans True; a real tensor read is its value (FSDP2's offsets,
    fsdp.py, computed outside the fake mode)."""

    def __init__(self, tokens: int, top_k: int, num_experts: int):
        super().__init__()
        self.per_expert = divmod(tokens * top_k, num_experts)
        self.E = num_experts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.bincount.default:
            # the layer's own assignments: an MTP depth's block routes the S - k positions it runs on
            self.per_expert = divmod(args[0].numel(), self.E)
            minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
            return torch.zeros(minlength, dtype=torch.long, device=args[0].device)
        if func is torch.ops.aten._local_scalar_dense.default and _is_fake(args[0]):  # a real one reads its value
            t = args[0]
            if t.dtype.is_floating_point:
                return 0.0
            if t.dtype == torch.bool:
                return True
            base, rem = self.per_expert
            return base + int(t.storage_offset() % self.E < rem)  # each element read is a 0-d view at its offset
        return func(*args, **kwargs)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


@contextlib.contextmanager
def _fake_tensors():
    """A FakeTensorMode, with torch's DeviceMesh built outside it: the mesh keeps its rank table as a real tensor
    and reads it on the host (FSDP2 at zero 3 builds meshes of our groups)."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    real = DeviceMesh.from_group

    @functools.wraps(real)
    def from_group(*args, **kwargs):
        with unset_fake_temporarily():
            return real(*args, **kwargs)

    DeviceMesh.from_group = staticmethod(from_group)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield
    finally:
        DeviceMesh.from_group = staticmethod(real)


def _held(shard, optimizer) -> list[torch.Tensor]:
    """Every tensor the rank holds between steps: parameters, buffers, gradients, optimizer params and state."""
    out = []
    for t in [*shard.model.parameters(), *shard.model.buffers()]:
        out.append(t)
        if isinstance(t, torch.nn.Parameter) and t.grad is not None:
            out.append(t.grad)
    for g in optimizer.param_groups:
        for q in g["params"]:
            out += [q] + ([q.grad] if q.grad is not None else [])
            out += [v for v in optimizer.state[q].values() if torch.is_tensor(v)]
    return [t.to_local() if hasattr(t, "to_local") else t for t in out]  # FSDP2's DTensors: this rank's shard


def _zero3_grads(model: torch.nn.Module) -> None:
    """The gradient shards a zero-3 rank holds from its first step on (FSDP2 makes them at the first reduce-scatter,
    FSDPSync.zero_grad zeroes them in place): zeros over a padded storage like the parameter shard's, as FSDP2's
    reduce-scatter output is padded to equal shards."""
    from torch.distributed.tensor import DTensor

    for q in model.parameters():
        if isinstance(q, DTensor) and q.grad is None:
            local = q.to_local()
            padded = torch.zeros(local.untyped_storage().nbytes() // local.element_size(), dtype=local.dtype)
            g = padded.as_strided(local.shape, local.stride(), local.storage_offset())
            q.grad = DTensor.from_local(g, q.device_mesh, q.placements, run_check=False, shape=q.shape,
                                        stride=q.stride())


def _kept(meter: TensorBytesMeter, module: torch.nn.Module) -> int:
    """Bytes allocated since the step began and alive now, less the parameters the module gathered (zero 3
    all-gathers them at the first forward and keeps them through the step)."""
    gathered = {storage_key(q.untyped_storage()) for q in module.parameters()}
    return meter.current - sum(meter.live.get(k, 0) for k in gathered)


def _bytes(tensors: list[torch.Tensor]) -> int:
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[storage_key(s)] = s.nbytes()
    return sum(seen.values())


def measure_rank(cfg: Config, rank: int, world: int) -> RankBytes:
    """Build global rank `rank` of the job on fake tensors and a fake process group; run its one-microbatch step."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # data_ptr() of a fake tensor is 0 (dp.py compares them to see whether a .grad is still its bucket's view: here
    # always), and torch warns at every call
    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")

    p, t = cfg.parallel, cfg.train
    dims = ParallelDims(p.dp, p.pp, p.ep, rank, tp=p.tp, cp=p.cp)
    # gpipe and 1f1b hold whole microbatches from forward to backward: one is run and the rest composed; interleaved
    # (chunk-microbatches, M a multiple of PP) and zb1 (a deferred W keeps part of one) run their whole step
    whole = p.pp > 1 and p.schedule in ("interleaved", "zb1")
    M = p.microbatches if whole else 1
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        dims.build_groups(timeout_s=p.timeout_s)
        S = t.seq_len // p.cp  # a CP rank's data loader reads its own chunks (parallel/cp.py: seq_runs_of)
        routing = _BalancedRouting(t.micro_batch * S // p.tp, cfg.model.top_k, cfg.model.num_experts)
        with _fake_tensors(), routing:
            shard = parallelize(cfg, dims, CPU)
            optimizer = build_optimizer(shard, cfg)
            optimizer.prepare()  # what a running job holds from its first step on: the state, Muon's owner plan
            _zero3_grads(shard.model)  # and zero 3's gradient shards
            held = _held(shard, optimizer)
            xs = [torch.zeros(t.micro_batch, S, dtype=torch.long) for _ in range(M)]
            ys = [torch.zeros(t.micro_batch, S, dtype=torch.long) for _ in range(M)]
            meter = TensorBytesMeter(held)
            # What the microbatch keeps from its forward to its backward: the meter's count when its backward is
            # about to start (the sync's prepare() is called then), less the parameters gathered (zero 3 keeps them
            # through the step, not per microbatch) and the output gradient just received (a transient: its wire
            # buffer, and under bf16 its fp32 widening). Not at the forward's end: autocast's cache of bf16 weight
            # copies lives until its region closes.
            wire = step.compute_dtype(t.dtype).itemsize
            grad_buf = 0 if dims.is_pp_last_stage else (t.micro_batch * S * cfg.model.d_model
                                                        * (wire + (4 if wire != 4 else 0)))
            before_backward, prepare, start = [], shard.sync.prepare, [0]
            # zero 3 "full" keeps the unsharded gradients of every microbatch until the final backward
            # reduce-scatters them: a microbatch before the final one is run first (its backward does not sync),
            # so the final one runs beside them, as microbatches 2..M of a real step do
            warmup = not whole and p.microbatches > 1 and p.zero == 3 and p.zero_accumulate == "full"
            syncs = iter([False] if warmup else [])
            shard.sync.prepare = lambda sync: (before_backward.append(_kept(meter, shard.model) - start[0]
                                                                      - grad_buf),
                                               prepare(next(syncs, sync)))[1]
            run = functools.partial(step.forward_backward, shard, schedule=p.schedule, device=CPU, dtype=t.dtype,
                                    aux_weight=1.0 / max(1, num_moe_layers(cfg.model)))
            with meter:
                if warmup:
                    run(xs[:1], ys[:1])
                    start[0] = _kept(meter, shard.model)  # the accumulated gradients: not the microbatch's own
                run(xs[-1:] if warmup else xs, ys[-1:] if warmup else ys)
                step.finish_grads(shard)
                step.clip_grads(shard, t.grad_clip)
                optimizer.step()
                step.after_update(shard)
            state = live_tensor_bytes(shard.model, optimizer)
            base = _bytes(held)
            shard.close()
    finally:
        dist.destroy_process_group()
    kept = before_backward[-1] if before_backward and not whole else 0
    in_flight = 1 if whole or p.pp == 1 else pp_facts.in_flight(p.schedule, p.pp, dims.pp_rank, p.microbatches)
    step_peak = base + meter.peak
    return RankBytes(rank, dims.coords(), state["param_bytes"], state["grad_bytes"], state["optim_bytes"],
                     step_peak + (in_flight - 1) * kept, step_peak, kept, in_flight)


def _zero3_classes(cfg: Config, world: int, stage: int) -> list[list[int]]:
    """The ranks of `stage` grouped by the chunk sizes FSDP2 would give them (torch.chunk of each sharded
    dimension over the group); one group when every dimension divides. Sizes come from the model the stage builds."""
    from ..model.transformer import Transformer, is_expert_param

    p = cfg.parallel
    ranks = [r for r in range(world) if ParallelDims(p.dp, p.pp, p.ep, r, tp=p.tp, cp=p.cp).pp_rank == stage]
    with torch.device("meta"):
        chunks = [Transformer(cfg.model, s, seed=0) for s in build_chunk_specs(cfg, stage, 0)]
    named = [(n, q) for c in chunks for n, q in c.named_parameters()]

    @functools.lru_cache(maxsize=None)
    def sizes(n: int, size: int, pos: int) -> int:  # torch.chunk: ceil(n/size) each, the last ones short or empty
        parts = torch.empty(n, device="meta").chunk(size)
        return parts[pos].numel() if pos < len(parts) else 0

    def key(r: int) -> tuple:
        d = ParallelDims(p.dp, p.pp, p.ep, r, tp=p.tp, cp=p.cp)
        ne, ex = d.group_ranks("non_expert_dp"), d.group_ranks("expert_dp")
        out = []
        for name, q in named:
            if is_expert_param(name) and len(ex) > 1:  # fsdp.py: experts shard dim 0, or dim 1 when it does not divide
                dim = 0 if q.shape[0] % len(ex) == 0 else 1
                out.append(sizes(q.shape[dim], len(ex), ex.index(r)))
            elif not is_expert_param(name):
                out.append(sizes(q.shape[0], len(ne), ne.index(r)))
        return tuple(out)

    classes: dict[tuple, list[int]] = {}
    for r in ranks:
        classes.setdefault(key(r), []).append(r)
    return list(classes.values())


@dataclass
class DryRun:
    cfg: Config
    world: int
    classes: list[RankBytes]
    seconds: float

    def rows(self) -> list[dict]:
        """One row per rank, in rank order: summary.json's field names."""
        out = []
        for c in self.classes:
            for r in c.same:
                p = self.cfg.parallel
                out.append({"rank": r, "coords": list(ParallelDims(p.dp, p.pp, p.ep, r, tp=p.tp, cp=p.cp).coords()),
                            **{k: getattr(c, k) for k in FIELDS}})
        return sorted(out, key=lambda row: row["rank"])

    def first_over(self, limit: float, reserved: float) -> dict | None:
        """The first rank whose peak plus the runtime's reserve exceeds `limit` bytes (None: every rank fits)."""
        return next((r for r in self.rows() if r["peak_bytes"] + reserved > limit), None)


def launch_config(cfg: Config, world: int, hardware: Hardware | None = None) -> Config:
    """The config a launch at `world` ranks runs (a resolved one comes back as is). The planner's one import
    back up the floors: a dry run builds what a launch would, so it resolves as the launch does. `hardware`: the
    profile `pp_layers auto` balances the stages on (default: this host's device kind, as a launch here would)."""
    from ..resolve import resolve

    return resolve(cfg, world=world, hardware=hardware)


def dry_run(cfg: Config, world: int, log=None) -> DryRun:
    """Every distinct rank of `cfg` at `world` ranks (module docstring). Layout errors raise ConfigError first."""
    t0 = time.perf_counter()
    cfg = launch_config(cfg, world)
    layout_errors(cfg, world)
    p = cfg.parallel
    classes = []
    for stage in range(p.pp):
        if p.zero == 3:
            groups = _zero3_classes(cfg, world, stage)
        else:
            groups = [[r for r in range(world) if ParallelDims(p.dp, p.pp, p.ep, r, tp=p.tp, cp=p.cp).pp_rank == stage]]
        for same in groups:
            rb = measure_rank(cfg, same[0], world)
            rb.same = same
            classes.append(rb)
            if log:
                log(f"  stage {stage}: rank {same[0]} (+{len(same) - 1} alike) params {fmt_bytes(rb.param_bytes)}, "
                    f"peak {fmt_bytes(rb.peak_bytes)} [{time.perf_counter() - t0:.0f} s]")
    return DryRun(cfg, world, classes, time.perf_counter() - t0)


def compare_with_planner(run: DryRun, hw: Hardware, opts=None) -> list[dict]:
    """Per distinct rank: the code's bytes against the planner's prediction for its stage (`predict`'s
    mem_parts_by_stage; its peak without the profile's reserve, which is not a tensor), and the relative gaps.
    The dry run routes perfectly balanced, so the planner is told so (expert_skew 0: no busiest-rank excess)."""
    import dataclasses

    from .cost import PlanOptions, predict
    from .shape import Layout

    p, t = run.cfg.parallel, run.cfg.train
    layout = Layout(p.dp, p.pp, p.ep, p.schedule, p.microbatches, t.micro_batch, p.zero, tp=p.tp, cp=p.cp)
    pred = predict(run.cfg, layout, hw, dataclasses.replace(opts or PlanOptions(), expert_skew=0.0))
    out = []
    for c in run.classes:
        s = c.coords[1]
        parts = pred.mem_parts_by_stage[s]
        planned = {"param_bytes": parts["params"], "grad_bytes": parts["grads"], "optim_bytes": parts["optimizer"],
                   "peak_bytes": pred.mem_by_stage[s] - parts["reserved"]}
        out.append({"rank": c.rank, "stage": s, "ranks": len(c.same),
                    **{k: getattr(c, k) for k in FIELDS}, **{f"planned_{k}": v for k, v in planned.items()},
                    **{f"gap_{k}": getattr(c, k) / v - 1 if v else 0.0 for k, v in planned.items()}})
    return out


def format_comparison(rows: list[dict]) -> str:
    """The comparison as a markdown table, in GiB (MiB for a small model)."""
    unit, scale = ("GiB", 2**30) if max(r["peak_bytes"] for r in rows) >= 2**30 else ("MiB", 2**20)
    lines = [f"| stage | rank (ranks alike) | params {unit}: code / planner | grads | optimizer | peak (tensors) | "
             "largest gap |", "|---:|---|---|---|---|---|---:|"]
    for r in rows:
        cells = [f"{r[k] / scale:.2f} / {r['planned_' + k] / scale:.2f}" for k in FIELDS]
        worst = max((r[f"gap_{k}"] for k in FIELDS), key=abs)
        lines.append(f"| {r['stage']} | {r['rank']} ({r['ranks']}) | " + " | ".join(cells)
                     + f" | {100 * worst:+.1f}% |")
    return "\n".join(lines)
