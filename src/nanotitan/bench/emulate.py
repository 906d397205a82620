"""`nanotitan bench emulate`: the network emulator measured against its own link model, per layout and axis.

    nanotitan bench emulate [--ranks 8] [--topology h100-sxm:8 configs/emulate/h100-100g.json:2 ...]
                            [--config configs/bench.toml] [--micro-batch 2] [--repeats 5] [--tolerance 0.10]

For every layout `bench layouts` runs at N ranks (m fixed), every rank replays the communication of one training
step of its stage, per axis, through parallel/comm/collectives.py with the emulator on (parallel/comm/emulate.py):
    dp  the gradient buckets of its stage (`parallel.bucket_mb`): async all-reduce + wait over non-expert-DP and
        expert-DP, as the Reducer does
    ep  per MoE layer and microbatch: the count exchange and the 4 payload all-to-alls (dispatch, combine, their
        backward) of m*S*top_k rows of d_model, split evenly (balanced routing)
    pp  per microbatch: the forward batch (send the activation on, receive one) and the backward batch
The sizes come from the planner's stage summaries (plan/shape.py), the calls from the trainer's code paths.
Each distinct call runs `repeats` times, all ranks entering together (a barrier before each), and is timed from
entry to return (what the axis's wait column records); a step's figure is calls x the median. Measured vs
modelled per layout and axis (the rank with the most modelled time; worst rank error beside it) goes to a
markdown table. The replay isolates the link model: in training, skew between ranks and overlap with compute
change what a wait column shows (docs/emulate.md).

A topology is PROFILE[:RANKS_PER_NODE] (a hardware profile name or file; default: its devices_per_node).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..config.config import load_config
from ..resolve import resolve_emulation
from ..model.spec import chunk_layer_counts
from ..parallel.comm import collectives as comm, emulate
from ..parallel.dims import ParallelDims
from ..parallel.dp.reducer import bucket_bytes
from ..plan import Layout, ModelShape, layout_config, stage_summaries
from ..run.spawn import run_ranks

AXES = ("dp", "ep", "pp")


def step_traffic(cfg, lay: Layout, dims: ParallelDims) -> dict[str, list[tuple[str, int, object]]]:
    """One step's calls of this rank, per axis: (kind, calls per step, what one call sends). fp32 gradients and
    activations in train.dtype (bf16 halves what EP and PP carry)."""
    c = layout_config(cfg, lay)
    shape = ModelShape.from_config(c)
    st = stage_summaries(shape, lay, chunk_layer_counts(c))[dims.pp_rank]
    act = 2 if c.train.dtype == "bf16" else 4
    T, D, K, E, M = lay.micro_batch * shape.seq_len, shape.d_model, shape.top_k, shape.num_experts, lay.microbatches
    out = {a: [] for a in AXES}
    cap = int(bucket_bytes(c.parallel.bucket_mb))
    for kind, n, size in (("non_expert_dp", st.n_ne, lay.dp * lay.ep), ("expert_dp", st.n_ex, lay.dp)):
        nbytes = n * 4
        if size > 1 and nbytes:
            full, rest = divmod(nbytes, cap)
            out["dp"] += [(kind, full, cap)] * bool(full) + [(kind, 1, rest)] * bool(rest)
    if lay.ep > 1 and st.n_moe:
        out["ep"] += [("counts", st.n_moe * M, E * 8), ("payload", 4 * st.n_moe * M, T * K * D * act)]
    if lay.pp > 1:
        out["pp"] += [("forward", M, T * D * act), ("backward", M, T * D * act)]
    return out


def _replay(axis: str, kind: str, nbytes: int, dims: ParallelDims) -> float:
    """One call of this kind through parallel/comm/collectives.py; returns its wall seconds (entry to return)."""
    if axis == "dp":
        buf = torch.zeros(max(1, nbytes // 4))
        t0 = time.perf_counter()
        comm.all_reduce(buf, group=dims.group(kind), axis="dp", async_op=True).wait()
        return time.perf_counter() - t0
    if axis == "ep":
        P = dims.ep
        rows = max(P, nbytes // (8 if kind == "counts" else 4) // P * P)  # even split: P equal blocks
        dtype = torch.int64 if kind == "counts" else torch.float32
        inp, out = torch.zeros(rows, dtype=dtype), torch.empty(rows, dtype=dtype)
        t0 = time.perf_counter()
        comm.all_to_all_single(out, inp, group=dims.group("ep"), axis="ep")
        return time.perf_counter() - t0
    # pp: forward = send on to the next stage, receive from the previous; backward the other way round
    to, frm = (dims.next_pp_rank, dims.prev_pp_rank) if kind == "forward" else (dims.prev_pp_rank, dims.next_pp_rank)
    n = max(1, nbytes // 4)
    ops = [dist.P2POp(dist.isend, torch.zeros(n), to, dims.group("pp"))] if to is not None else []
    ops += [dist.P2POp(dist.irecv, torch.empty(n), frm, dims.group("pp"))] if frm is not None else []
    if not ops:
        return 0.0
    t0 = time.perf_counter()
    comm.batch_isend_irecv(ops, axis="pp")
    return time.perf_counter() - t0


def _worker(rank: int, world: int, cfg, layouts: list[Layout], topology: tuple[str, int], dilation: float,
            repeats: int) -> list[dict]:
    profile, node_size = topology
    cfg.parallel.emulate, cfg.parallel.emulate_node_size, cfg.parallel.emulate_dilation = profile, node_size, dilation
    links = emulate.install(emulate.link_model(resolve_emulation(cfg), rank))
    rows = []
    for lay in layouts:
        dims = ParallelDims(lay.dp, lay.pp, lay.ep, rank).build_groups(timeout_s=600)
        traffic = step_traffic(cfg, lay, dims)
        # Rounds, each opened by a world barrier: as many per axis on every rank (stages differ in their calls;
        # the members of one group share a stage, so they make the same calls in the same rounds).
        stages = [step_traffic(cfg, lay, ParallelDims(lay.dp, lay.pp, lay.ep, dims.rank_of(0, s, 0)))
                  for s in range(lay.pp)]
        row = {"layout": lay.short(), "rank": rank, "dilation": links.dilation}
        for axis in AXES:
            rounds = max(len(t[axis]) for t in stages)
            calls = traffic[axis] + [None] * (rounds - len(traffic[axis]))
            measured = modelled = 0.0
            for call in calls:
                times, model = [], 0.0
                for _ in range(repeats):
                    dist.barrier()
                    before = links.modelled_s[axis]
                    times.append(_replay(axis, call[0], call[2], dims) if call else 0.0)
                    model = links.modelled_s[axis] - before
                if call:
                    measured += call[1] * statistics.median(times)
                    modelled += call[1] * model
            row[axis] = {"measured_s": measured, "modelled_s": modelled,
                         "calls": sum(c[1] for c in traffic[axis]), "bytes": sum(c[1] * c[2] for c in traffic[axis])}
        rows.append(row)
    emulate.install(None)
    return rows


def parse_topology(text: str) -> tuple[str, int]:
    profile, _, size = text.rpartition(":") if ":" in text and text.rsplit(":", 1)[1].isdigit() else (text, "", "0")
    return profile, int(size or 0)


def summarise(rows: list[dict]) -> list[dict]:
    """Per layout and axis: the rank with the most modelled time, and the worst relative error of any rank."""
    out = []
    for name in dict.fromkeys(r["layout"] for r in rows):
        ranks = [r for r in rows if r["layout"] == name]
        for axis in AXES:
            busy = [r[axis] for r in ranks if r[axis]["modelled_s"] > 0]
            if not busy:
                continue
            top = max(busy, key=lambda a: a["modelled_s"])
            worst = max((a["measured_s"] / a["modelled_s"] - 1 for a in busy), key=abs)
            out.append({"layout": name, "axis": axis, "calls": top["calls"], "bytes": top["bytes"],
                        "modelled_s": top["modelled_s"], "measured_s": top["measured_s"],
                        "error": top["measured_s"] / top["modelled_s"] - 1, "worst_rank_error": worst})
    return out


def format_table(title: str, rows: list[dict]) -> str:
    lines = [f"### {title}", "",
             "| layout | axis | calls/step | MiB/step | modelled ms/step | measured ms/step | error | worst rank |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['axis']} | {r['calls']} | {r['bytes'] / 2**20:.2f} | "
                     f"{r['modelled_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} | {100 * r['error']:+.1f}% | "
                     f"{100 * r['worst_rank_error']:+.1f}% |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from .layouts import layouts_for

    ap = argparse.ArgumentParser(prog="nanotitan bench emulate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--topology", nargs="+", default=["h100-sxm:8", "configs/emulate/h100-100g.json:2"],
                    help="PROFILE[:RANKS_PER_NODE] each (default: one NVLink node of 8; 4 nodes of 2 over 100 Gb/s)")
    ap.add_argument("--dilation", type=float, default=0.0, help="parallel.emulate_dilation (0: automatic)")
    ap.add_argument("--config", default="configs/bench.toml")
    ap.add_argument("--micro-batch", type=int, default=2, help="m, as bench layouts")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tolerance", type=float, default=0.10, help="exit 1 when a layout/axis error exceeds it")
    ap.add_argument("--out", default="", help="also write the tables (markdown) and rows (.json beside it) there")
    ap.add_argument("--timeout", type=float, default=1800)
    args, overrides = ap.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    layouts = layouts_for(cfg, args.ranks, args.micro_batch, args.schedule)
    threads = cfg.train.threads or 1
    text, everything, worst = [], {}, 0.0
    for topo in args.topology:
        profile, size = parse_topology(topo)
        rows = run_ranks(_worker, args.ranks, args=(cfg, layouts, (profile, size), args.dilation, args.repeats),
                         timeout=args.timeout, threads=threads, pg_timeout=600)
        flat = [r for per_rank in rows for r in per_rank]
        table = summarise(flat)
        worst = max([worst] + [abs(r["error"]) for r in table])
        title = f"{profile}, {size or 'profile'} ranks per node, dilation {flat[0]['dilation']:.3g}"
        text.append(format_table(title, table))
        everything[topo] = {"rows": flat, "table": table}
        print(text[-1] + "\n", flush=True)
    verdict = f"largest |error| {100 * worst:.1f}% (tolerance {100 * args.tolerance:.0f}%)"
    print(verdict)
    if args.out:
        cmd = "nanotitan bench emulate " + " ".join(argv)
        Path(args.out).write_text(f"# Network emulator: measured vs modelled communication\n\nCommand: `{cmd}`\n\n"
                                  + "\n\n".join(text) + f"\n\n{verdict}\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(everything, indent=1))
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
