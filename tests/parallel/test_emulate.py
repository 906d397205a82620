"""The network emulator (parallel/comm/emulate.py): each call priced by the links it crosses, held at least that long,
and no value changed — the equivalence rows (DESIGN §4) pass with it on, bitwise equal to the same layout off."""

import time

import pytest
import torch
import torch.distributed as dist

from nanotitan.config.config import ConfigError, load_config
from nanotitan.config.hardware import BUILTIN
from nanotitan.resolve import resolve_emulation
from nanotitan.parallel.comm import collectives as comm, emulate
from nanotitan.parallel.comm.emulate import LinkModel
from tests.helpers.mp import run_ranks
from tests.helpers.equivalence import base_args, check_case, layout_args
from tests.helpers.mp import train_once

pytestmark = pytest.mark.serial  # emulated links are timed against their model: it runs alone (Makefile)

H800 = BUILTIN["h800"]  # NVLink 160 GB/s, 10 us; IB 50 GB/s, 20 us (every link figure the same for each op)


def test_link_model_prices_each_op_by_the_links_it_crosses():
    """Hand-computed: h800 links, nodes of 2 ranks, dilation 0.5 (emulated time = modelled / 0.5)."""
    m = LinkModel(H800, node_size=2, dilation=0.5, rank=0)
    # ring all-reduce of 1 MB: inside node 0 (ranks 0, 1) at 160 GB/s, across nodes (0, 2) at 50 GB/s
    assert m.collective_s("all-reduce", 10**6, [0, 1]) == pytest.approx((1e6 / 160e9 + 2e-5) / 0.5)
    assert m.collective_s("all-reduce", 10**6, [0, 2]) == pytest.approx((1e6 / 50e9 + 4e-5) / 0.5)
    assert m.collective_s("reduce-scatter", 10**6, [0, 2]) == pytest.approx((0.5e6 / 50e9 + 2e-5) / 0.5)
    # all-to-all, 1 MB to each peer: 1 MB over NVLink to rank 1, 2 MB over IB to ranks 2, 3; IB bounds it
    assert m.all_to_all_s([0, 1e6, 1e6, 1e6], [0, 1e6, 1e6, 1e6], [0, 1, 2, 3]) == pytest.approx(
        (2e6 / 50e9 + 3 * 2e-5) / 0.5)
    # ... and a rank that receives more than it sends is bound by what it receives
    assert m.all_to_all_s([0, 0, 0, 0], [0, 0, 4e6, 0], [0, 1, 2, 3]) == pytest.approx((4e6 / 50e9 + 6e-5) / 0.5)
    # P2P batch: two sends to rank 1 share its link (2 MB at 160 GB/s); a receive from rank 2 crosses IB
    assert m.p2p_s([(1, 10**6, True), (1, 10**6, True), (2, 10**6, False)]) == pytest.approx(
        max(2e6 / 160e9 + 1e-5, 1e6 / 50e9 + 2e-5) / 0.5)
    # a group of one moves nothing
    assert m.collective_s("all-reduce", 10**6, [3]) == 0.0


def test_link_model_from_config_and_its_errors(tmp_path):
    cfg = load_config(None, ["--parallel.emulate", "h800", "--parallel.emulate_node_size", "2"])
    # automatic dilation (resolve.py): this CPU's GEMM peak (given here) / the profile's peak in train.dtype
    m = emulate.link_model(resolve_emulation(cfg, cpu_peak=H800.peak_flops_fp32 / 1000), rank=3)
    assert (m.node_size, m.dilation, m.node(3)) == (2, pytest.approx(1e-3), 1)
    assert emulate.link_model(load_config(None, [])) is None  # off by default
    with pytest.raises(ConfigError, match="parallel.emulate='nope'.*--parallel.emulate"):
        resolve_emulation(load_config(None, ["--parallel.emulate", "nope"]))
    with pytest.raises(ConfigError, match="emulate on CPU"):
        load_config(None, ["--parallel.emulate", "h800", "--train.device", "cuda"])
    with pytest.raises(ConfigError, match="--parallel.emulate h100-sxm"):
        load_config(None, ["--parallel.emulate_dilation", "0.5"])  # shaping an emulation that is off


def _every_op(rank, world, dilation):
    """Each comm op with the emulator on (h800, nodes of 2): (op, seconds taken, seconds modelled, value ok)."""
    cfg = load_config(None, ["--parallel.emulate", "h800", "--parallel.emulate_node_size", "2",
                             "--parallel.emulate_dilation", str(dilation)])
    links = emulate.install(emulate.link_model(cfg, rank))
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]  # a group inside one node
    out = []

    def timed(name, axis, fn, check):
        dist.barrier()
        before = links.modelled_s[axis]
        t0 = time.perf_counter()
        value = fn()
        out.append((name, time.perf_counter() - t0, links.modelled_s[axis] - before, bool(check(value))))

    def all_reduce(group=None, async_op=False):
        t = torch.full((2**18,), float(rank))
        w = comm.all_reduce(t, group=group, axis="dp", async_op=async_op)
        if w is not None:
            w.wait()
        return t

    ranks_sum = sum(range(world))
    timed("all-reduce world", "dp", all_reduce, lambda t: torch.all(t == ranks_sum))
    timed("all-reduce node", "dp", lambda: all_reduce(pair), lambda t: torch.all(t == 4 * (rank // 2) + 1))
    timed("all-reduce async", "dp", lambda: all_reduce(async_op=True), lambda t: torch.all(t == ranks_sum))

    def reduce_scatter():
        out_t = torch.empty(2**16)
        comm.reduce_scatter(out_t, torch.ones(2**16 * world), None).wait()
        return out_t

    timed("reduce-scatter", "dp", reduce_scatter, lambda t: torch.all(t == world))

    def all_gather():
        full = torch.empty(2**16 * world)
        comm.all_gather(full, torch.full((2**16,), float(rank)), None).wait()
        return full

    everyone = torch.arange(world).repeat_interleave(2**16).float()
    timed("all-gather", "dp", all_gather, lambda t: torch.equal(t, everyone))

    def all_to_all():  # uneven: rank r sends r+1+p rows of 64 to rank p
        rows = [rank + 1 + p for p in range(world)]
        got = [r + 1 + rank for r in range(world)]
        inp = torch.full((sum(rows), 64), float(rank))
        out_t = torch.empty(sum(got), 64)
        comm.all_to_all_single(out_t, inp, got, rows, axis="ep")
        return out_t, got

    timed("all-to-all", "ep", all_to_all, lambda v: torch.equal(
        v[0][:, 0], torch.arange(world).repeat_interleave(torch.tensor(v[1])).float()))

    def p2p():  # a ring: send to the next rank, receive from the previous (rank 1 -> 2 crosses nodes)
        buf = torch.empty(2**16)
        ops = [dist.P2POp(dist.isend, torch.full((2**16,), float(rank)), (rank + 1) % world),
               dist.P2POp(dist.irecv, buf, (rank - 1) % world)]
        comm.batch_isend_irecv(ops, axis="pp")
        return buf

    timed("send/recv", "pp", p2p, lambda t: torch.all(t == (rank - 1) % world))
    waits = dict(comm.COMM.wait_s)
    emulate.install(None)
    return out, dict(links.modelled_s), waits


def test_emulated_calls_take_at_least_their_modelled_time_and_change_no_value():
    """4 ranks, nodes of 2: every op is held to its modelled time (from its start; sleeping never returns early),
    not much longer on an idle link, and every result is the one gloo computes without emulation."""
    dilation = 1e-4  # h800's 10-20 us latencies become 0.1-0.2 s: holds far above gloo's own time here
    results = run_ranks(_every_op, 4, args=(dilation,), timeout=240)
    for rank, (ops, modelled, waits) in enumerate(results):
        for name, took, model, ok in ops:
            assert ok, f"rank {rank}: {name} returned a wrong value under emulation"
            assert model > 0.05, f"rank {rank}: {name} was not emulated ({model:.3f} s modelled)"
            assert took >= model - 1e-4, f"rank {rank}: {name} took {took:.3f} s < modelled {model:.3f} s"
            assert took <= model + 0.5, f"rank {rank}: {name} took {took:.3f} s >> modelled {model:.3f} s"
        # the hold is charged to the axis's wait column
        for axis in ("dp", "ep", "pp"):
            assert waits[axis] >= modelled[axis] - 1e-3, (rank, axis, waits[axis], modelled[axis])
    # a node-local all-reduce is priced at NVLink, the world one at IB (both 1 MiB): the IB one holds longer
    by_name = {name: model for name, _, model, _ in results[0][0]}
    assert by_name["all-reduce world"] > 2 * by_name["all-reduce node"]


def _emulated_cases(rank, world, cases, corpus_dir, run_root):
    out = []
    for i, (case, emulated) in enumerate(cases):
        extra = ["--parallel.emulate", "h100-sxm", "--parallel.emulate_node_size", "2",
                 "--parallel.emulate_dilation", "0.02"] if emulated else []
        res = train_once(base_args(corpus_dir, f"{run_root}/{world}_{i}") + layout_args(*case) + extra)
        res["modelled"] = dict(emulate.ACTIVE.modelled_s) if emulated else {}
        out.append(res)
    emulate.install(None)
    return out


def test_emulated_layouts_train_the_same_model(corpus_dir, tmp_path, reference):
    """Equivalence rows with the emulator on (4 ranks in 2 emulated nodes: EP and PP groups cross them): the
    single-process reference's losses and parameters, and bitwise the same losses as the layout without it."""
    cases = [((2, 1, 2), True), ((2, 1, 2), False), ((1, 2, 2, "1f1b"), True), ((2, 2, 1, "gpipe"), True),
             ((2, 1, 2, "1f1b", ("--parallel.zero", "1")), True)]
    results = run_ranks(_emulated_cases, 4, args=(cases, str(corpus_dir), str(tmp_path)), timeout=600,
                        pg_timeout=120)
    for i, (case, emulated) in enumerate(cases):
        check_case(f"{case} emulated={emulated}", [results[r][i] for r in range(4)], reference)
    assert results[0][0]["losses"] == results[0][1]["losses"], "emulation changed a loss"
    for i, axes in ((0, ("dp", "ep")), (2, ("ep", "pp")), (3, ("dp", "pp")), (4, ("dp", "ep"))):
        for axis in axes:
            assert all(results[r][i]["modelled"].get(axis, 0) > 0 for r in range(4)), (cases[i], axis)


def _bench_runs(rank, world, runs):
    """Each (config file, argv) of `runs` trained in turn on these ranks, as its `nanotitan train` job would."""
    from nanotitan.train import Trainer

    for config, argv in runs:
        trainer = Trainer(load_config(config, argv))
        try:
            trainer.train()
        finally:
            trainer.shard.close()
    emulate.install(None)


@pytest.mark.slow
def test_emulated_topologies_flip_the_ranking_the_planner_says_they_flip(corpus_dir, tmp_path):
    """configs/bench.toml's model on 4 ranks, one NVLink node vs nodes of 2 over 100 Gb/s (docs/emulate.md), both at
    dilation 1.7e-3 (the 2-core machine's fp32 rate against an H100's): pure DP all-reduces over every link, so it
    wins on NVLink and loses across the slow network to dp1 pp2 ep2, whose EP groups stay inside a node there. The
    planner predicts the flip by ~3x each way, uncalibrated; the measured steps must flip too. Each layout's step
    is its fastest of 6 (steps 3-8): another job on the 2 cores only ever slows a step, and it once made DP4's
    median 0.81 s against its 0.2-0.3 s. The four runs are `nanotitan bench layouts`' (observe/runs.py's
    arguments and result files), one after another in one launch of 4 ranks."""
    from nanotitan.observe.runs import layout_argv, run_results, summarise
    from nanotitan.plan.fit.calibrate import emulated_predictions

    data = ["--data.source", str(corpus_dir), "--train.seed", "3"]
    topologies = (("nvlink", "h100-sxm", "8"), ("100g", "configs/emulate/h100-100g.json", "2"))
    layouts = ((4, 1, 1, 2), (1, 2, 2, 4))
    emus = {name: ["--parallel.emulate", topology, "--parallel.emulate_node_size", size,
                   "--parallel.emulate_dilation", "1.7e-3"] for name, topology, size in topologies}
    runs = {(name, lay): layout_argv(*lay[:3], "1f1b", lay[3], 2, 8, tmp_path / f"{name}_{''.join(map(str, lay[:3]))}",
                                     data + emus[name]) for name, _, _ in topologies for lay in layouts}
    run_ranks(_bench_runs, 4, args=([("configs/bench.toml", argv) for argv in runs.values()],), timeout=280,
              pg_timeout=120)
    order = {}
    for name, _, _ in topologies:
        rows = []
        for dp, pp, ep, M in layouts:
            res = run_results(tmp_path / f"{name}_{dp}{pp}{ep}")
            fastest = min(r["step_time_s"] for r in res["records"] if 2 < r["step"] <= 8)
            rows.append({"dp": dp, "pp": pp, "ep": ep, "schedule": "1f1b" if pp > 1 else "-", "M": M, "m": 2,
                         **summarise(res, (2, 8)), "step_time_s": fastest,
                         "peak_mem_per_rank": [r["peak_mem_bytes"] for r in res["ranks"]]})
        cfg = load_config("configs/bench.toml", data + emus[name])
        pred = emulated_predictions(rows, cfg, emulate.link_model(cfg), "cpu-gloo")["rows"]
        order[name] = ([r["pred_step_s"] for r in pred], [r["meas_step_s"] for r in pred])
    (p_dp, p_ep), (m_dp, m_ep) = order["nvlink"]
    assert p_dp < p_ep and m_dp < m_ep, f"NVLink: predicted {order['nvlink'][0]}, measured {order['nvlink'][1]}"
    (p_dp, p_ep), (m_dp, m_ep) = order["100g"]
    assert p_dp > p_ep and m_dp > m_ep, f"100 Gb/s: predicted {order['100g'][0]}, measured {order['100g'][1]}"
