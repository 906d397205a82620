"""parallel.ep_overlap_microbatches' two lanes (parallel/lanes.py `two_lanes`): a forward really runs beside a
backward, each lane's EP collectives go on its own group, the gradients are bitwise the one-lane run's, a failure
in either lane reaches the caller, and the exposed EP wait counts only what no lane's compute hid."""

from __future__ import annotations

import threading

import pytest
import torch

from nanotitan.config.config import Config, ModelConfig, ParallelConfig
from nanotitan.model.spec import build_chunk_specs
from tests.helpers.specs import build_shard_spec
from nanotitan.model.transformer import Transformer, take_routing
from nanotitan.parallel.comm import collectives as comm
from nanotitan.parallel import ep
from nanotitan.parallel.pp import runner as pp_runner, schedules as pp_mod
from nanotitan.parallel.dims import ParallelDims
from nanotitan.parallel.ep import apply_ep
from nanotitan.parallel.lanes import exposed_ep_wait, lanes_overlap
from nanotitan.parallel.placement import expert_shards
from nanotitan.parallel.pp.facts import in_flight, warmup as pp_warmup
from nanotitan.parallel.pp.schedules import pipeline_forward_backward
from nanotitan.parallel.pp.chunks import StageChunks
from nanotitan.parallel.pp.comms import StageComms
from tests.helpers.mp import run_ranks

SEED, M_SEQ, SEQ, VOCAB, D, M = 7, 2, 16, 128, 32, 4


def _cfg(ep_size: int) -> Config:
    model = ModelConfig(vocab_size=VOCAB, d_model=D, n_layers=2, n_heads=4, ffn_dim=48, num_experts=4, top_k=2,
                        moe_every=1, max_seq_len=SEQ, capacity_factor=1.0, bias_update_rate=0.01)
    return Config(model=model, parallel=ParallelConfig(ep=ep_size, microbatches=M))


def _batches(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randint(0, VOCAB, (M_SEQ, SEQ), generator=g) for _ in range(M)]
    return xs, [(3 * x + 1) % VOCAB for x in xs]


def _step(model, dims, xs, ys, lanes: bool, timeline=None, schedule: str = "1f1b"):
    comms = StageComms(dims, (M_SEQ, SEQ, D), torch.float32, "cpu")
    stats = pipeline_forward_backward(model, dims, xs, ys, comms=comms, schedule=schedule, aux_weight=0.3,
                                      loss_scale=1.0 / len(xs), before_backward=None,
                                      ep_lanes=ep.lanes_of(model) if lanes else None,
                                      options=pp_mod.RunOptions(timeline=timeline))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return stats, grads


def _routing(model) -> list[torch.Tensor]:
    """The step's routing record, drained: each MoE layer's counts and router statistics per training forward, in
    forward order (a recompute's never), and what each forward's EP dispatch received."""
    r = take_routing(model)
    return [r.counts, r.stats, ep.take_received(model, r.keys)]


def _lanes_rank(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    cfg = _cfg(world)
    dims = ParallelDims(1, 1, world, rank=rank).build_groups(timeout_s=60).build_backward_ep_groups(timeout_s=60)
    fwd_group, bwd_group = dims.group("ep"), dims.group("ep_backward")
    calls = []  # (in a backward, the group) of every EP all-to-all
    plain = comm.all_to_all_single

    def spy(*args, group=None, **kw):
        calls.append((ep.in_backward(), group, threading.current_thread().name))
        async_posts.append((ep.in_backward(), kw.get("async_op", False)))
        return plain(*args, group=group, **kw)

    async_posts, fills = [], []  # (in a backward, posted async) per all-to-all; deferred W's run inside a backward
    plain_run = pp_runner.run_weights

    def run_spy(work):
        if work and ep.in_backward():  # inside autograd's backward: only the fill, while an all-to-all travels
            fills.append(len(work))
        return plain_run(work)

    comm.all_to_all_single = spy
    pp_runner.run_weights = run_spy
    out = {}
    try:
        for ac in (False, True):
            model = apply_ep(Transformer(cfg.model, build_shard_spec(cfg, 0, rank), SEED,
                                         experts=expert_shards(cfg, dims)), dims, lanes=True)
            model.activation_checkpointing = ac
            xs, ys = _batches(rank)
            one, g_one = _step(model, dims, xs, ys, lanes=False)
            load_one = _routing(model)
            calls.clear()
            async_posts.clear()
            fills.clear()
            timeline = []
            two, g_two = _step(model, dims, xs, ys, lanes=True, timeline=timeline)
            spans = {(k, i): (t0, t1) for k, _, i, t0, t1 in timeline}
            out[ac] = {
                "same_grads": all(torch.equal(g_one[n], g_two[n]) for n in g_one),
                "same_loss": torch.equal(one.ce_sum, two.ce_sum) and torch.equal(one.aux_sum, two.aux_sum),
                "same_load": all(torch.equal(a, b) for a, b in zip(load_one, _routing(model))),
                "one_overlap": one.lanes_overlap_s, "two_overlap": two.lanes_overlap_s,
                # F(j+1) started before B(j) ended and ended after B(j) started
                "pairs_overlapping": sum(spans[("F", j + 1)][0] < spans[("B", j)][1]
                                         and spans[("B", j)][0] < spans[("F", j + 1)][1] for j in range(M - 1)),
                "forward_threads": {t for b, _, t in calls if not b},
                "groups_ok": all(g is (bwd_group if b else fwd_group) for b, g, _ in calls),
                "backward_calls": sum(b for b, _, _ in calls),
                "exposed_le_wait": two.ep_exposed_s <= two.ep_wait_s + 1e-9,
                # the fill: every backward all-to-all posted async, deferred weight GEMMs run during their flight
                "backward_async": all(a for b, a in async_posts if b),
                "filled": len(fills),
            }
    finally:
        comm.all_to_all_single = plain
        pp_runner.run_weights = plain_run
    return out


@pytest.mark.timeout(120)
def test_lanes_overlap_a_forward_with_a_backward_bitwise():
    """EP2, M = 4, capacity and router bias on, activation checkpointing off and on: the two-lane step's gradients,
    losses and router counts equal the one-lane step's bit for bit (with the backward lane's weight-gradient GEMMs
    deferred and run while its all-to-alls travel: every backward one posted async, W's run inside the backward); a forward and a backward really ran at once
    (timestamps), the forwards on the lane's own thread; every forward all-to-all on the EP group and every
    backward one (the recompute's included) on the backward group."""
    for rank, res in enumerate(run_ranks(_lanes_rank, world=2, timeout=110)):
        for ac, r in res.items():
            name = f"rank {rank} activation checkpointing {ac}"
            assert r["same_grads"] and r["same_loss"] and r["same_load"], f"{name}: {r}"
            assert r["one_overlap"] == 0.0 and r["two_overlap"] > 0.0, f"{name}: {r}"
            assert r["pairs_overlapping"] >= 1, f"{name}: no F(j+1) overlapped B(j): {r}"
            assert r["forward_threads"] == {"nanotitan-forward-lane"}, f"{name}: {r}"
            assert r["groups_ok"] and r["backward_calls"] > 0, f"{name}: {r}"
            assert r["exposed_le_wait"], f"{name}: {r}"
            assert r["backward_async"] and r["filled"] >= M, f"{name}: the W's did not fill the trips: {r}"


def test_a_failing_lane_raises_in_the_caller():
    """An error in the forward lane (a token id past the vocabulary) or in the backward lane (a raising
    before_backward) reaches the caller, which returns instead of hanging."""
    cfg = _cfg(1)
    model = Transformer(cfg.model, seed=SEED)
    dims = ParallelDims(1, 1, 1)
    xs, ys = _batches(0)
    bad = list(xs)
    bad[2] = torch.full_like(xs[2], VOCAB + 5)
    comms = StageComms(dims, (M_SEQ, SEQ, D), torch.float32, "cpu")
    with pytest.raises(IndexError):
        pipeline_forward_backward(model, dims, bad, ys, comms=comms, schedule="1f1b", aux_weight=0.3,
                                  loss_scale=0.25, before_backward=None, ep_lanes=ep.lanes_of(model))

    def fail_second(is_last, n=[]):
        n.append(is_last)
        if len(n) == 2:
            raise RuntimeError("backward lane failed")

    with pytest.raises(RuntimeError, match="backward lane failed"):
        pipeline_forward_backward(model, dims, xs, ys, comms=comms, schedule="1f1b", aux_weight=0.3,
                                  loss_scale=0.25, before_backward=fail_second, ep_lanes=ep.lanes_of(model))
    assert not any(t.name == "nanotitan-forward-lane" for t in threading.enumerate())


def test_exposed_ep_wait_counts_only_what_no_lane_hides():
    """One lane: the summed waits. Two: a wait is exposed only while the other lane is blocked or idle."""
    # one lane: F 0-10 with a wait 2-5, B 10-20 with a wait 12-13
    assert exposed_ep_wait([("F", 0, 10), ("B", 10, 20)], [(0, 2, 5), (1, 12, 13)]) == pytest.approx(4.0)
    # two lanes: F 0-10 waits 2-5 while B 0-8 computes, then B waits 6-9 (F computes 6-9 except... F is done
    # waiting at 5): hidden except where both wait or one waits and the other has ended
    spans = [("F", 0, 10), ("B", 0, 8)]
    assert exposed_ep_wait(spans, [(0, 2, 5), (1, 6, 7)]) == pytest.approx(0.0)
    assert exposed_ep_wait(spans, [(0, 2, 5), (1, 4, 7)]) == pytest.approx(1.0)  # 4-5: both blocked
    assert exposed_ep_wait(spans, [(0, 7, 10), (1, 1, 2)]) == pytest.approx(2.0)  # 8-10: B lane idle
    assert lanes_overlap(spans) == pytest.approx(8.0)
    assert lanes_overlap([("F", 0, 1), ("B", 1, 2)]) == 0.0


def test_a_recompute_leaves_the_forwards_router_stats():
    """With the lanes, a checkpointed block's recompute (inside a backward) writes its router statistics to the
    backward's slot: what the forward lane reads after its block (Transformer.forward) is still its own."""
    cfg = _cfg(1)
    model = Transformer(cfg.model, seed=SEED)
    model.activation_checkpointing = True
    for moe in model.moe_layers():
        moe.lane_local_router_state = True  # what apply_ep(lanes=True) sets
    xs, ys = _batches(0)
    ce0, _ = model(xs[0], ys[0])
    model(xs[1], ys[1])
    after_second = [(m.last_counts_E.clone(), m.last_router_stats.clone()) for m in model.moe_layers()]
    ce0.backward()  # recomputes microbatch 0's blocks, routing included
    for m, (counts, stats) in zip(model.moe_layers(), after_second):
        assert torch.equal(m.last_counts_E, counts) and torch.equal(m.last_router_stats, stats)
    assert not torch.equal(after_second[0][0], model.moe_layers()[0].router_records[1]["counts_E"])


def test_the_forward_lane_keeps_the_callers_meters():
    """The trainer's meters of a logged step reach the forward lane's thread: its saved-tensor hooks (activations
    saved for backward) and its dispatch modes (the step-peak meter) see the forwards' tensors and ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.threads = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.threads.add(threading.current_thread().name)
            return func(*args, **(kwargs or {}))

    cfg = _cfg(1)
    model = Transformer(cfg.model, seed=SEED)
    dims = ParallelDims(1, 1, 1)
    xs, ys = _batches(0)
    packed = set()

    def pack(t):
        packed.add(threading.current_thread().name)
        return t

    comms = StageComms(dims, (M_SEQ, SEQ, D), torch.float32, "cpu")
    with Ops() as ops, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pipeline_forward_backward(model, dims, xs, ys, comms=comms, schedule="1f1b", aux_weight=0.3,
                                  loss_scale=0.25, before_backward=None, ep_lanes=ep.lanes_of(model))
    assert "nanotitan-forward-lane" in ops.threads and "nanotitan-forward-lane" in packed


# --- under a pipeline: PP2·EP2, 1f1b, zb1 and interleaved -------------------------------------------------------
def _pp_cfg(schedule: str, pp: int = 2, ep: int = 2, n_layers: int = 4) -> Config:
    model = ModelConfig(vocab_size=VOCAB, d_model=D, n_layers=n_layers, n_heads=4, ffn_dim=48, num_experts=4,
                        top_k=2, moe_every=1, max_seq_len=SEQ, capacity_factor=1.0, bias_update_rate=0.01)
    V = 2 if schedule == "interleaved" else 1
    return Config(model=model, parallel=ParallelConfig(pp=pp, ep=ep, microbatches=M, schedule=schedule,
                                                       virtual_stages=V))


def _stage(cfg: Config, dims: ParallelDims):
    """This rank's stage: one Transformer, or the interleaved schedule's V chunks."""
    chunks = [Transformer(cfg.model, s, SEED, experts=expert_shards(cfg, dims))
              for s in build_chunk_specs(cfg, dims.pp_rank, dims.ep_rank)]
    return chunks[0] if len(chunks) == 1 else StageChunks(chunks)


def _pp_lanes_rank(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    dims = ParallelDims(1, 2, 2, rank=rank).build_groups(timeout_s=60).build_backward_ep_groups(timeout_s=60)
    pp_f, pp_b = dims.group("pp"), dims.group("pp_backward")
    p2p = []  # (thread, group) of every PP send / receive
    plain = {k: getattr(comm, k) for k in ("send", "recv", "batch_isend_irecv", "all_to_all_single")}
    a2a = []  # (in a backward, thread) of every EP all-to-all

    def send(t, dst, group=None, axis="pp"):
        p2p.append((threading.current_thread().name, group))
        return plain["send"](t, dst, group, axis)

    def recv(t, src, group=None, axis="pp"):
        p2p.append((threading.current_thread().name, group))
        return plain["recv"](t, src, group, axis)

    def batch(ops, axis="pp", async_op=False):
        p2p.extend((threading.current_thread().name, op.group) for op in ops)
        return plain["batch_isend_irecv"](ops, axis, async_op)

    def all_to_all(*args, **kw):
        a2a.append((ep.in_backward(), threading.current_thread().name))
        return plain["all_to_all_single"](*args, **kw)

    comm.send, comm.recv, comm.batch_isend_irecv, comm.all_to_all_single = send, recv, batch, all_to_all
    out = {}
    try:
        # the other pairs: test_equivalence_ep_lanes
        for schedule, ac in (("1f1b", False), ("zb1", True), ("interleaved", True)):
            cfg = _pp_cfg(schedule)
            V = cfg.parallel.virtual_stages
            model = apply_ep(_stage(cfg, dims), dims, lanes=True)
            for chunk in pp_mod.stage_chunks(model):
                chunk.activation_checkpointing = ac
            xs, ys = _batches(dims.ep_rank)
            one, g_one = _step(model, dims, xs, ys, lanes=False, schedule=schedule)
            load_one = _routing(model)
            p2p.clear()
            a2a.clear()
            timeline = []
            two, g_two = _step(model, dims, xs, ys, lanes=True, timeline=timeline, schedule=schedule)
            spans = {(k, v, i): (t0, t1) for k, v, i, t0, t1 in timeline if k != "wait"}
            # the k-th forward is meant to run beside the (k - pair)-th backward
            w = pp_warmup(schedule, 2, dims.pp_rank, M, V)
            pair = 1 if dims.is_pp_last_stage and V == 1 else w
            f_ops, b_ops = pp_mod.lane_orders(schedule, 2, M, V)
            out[schedule, ac] = {
                "same_grads": all(torch.equal(g_one[n], g_two[n]) for n in g_one),
                "same_loss": (one.ce_sum is None and two.ce_sum is None or torch.equal(one.ce_sum, two.ce_sum))
                and torch.equal(one.aux_sum, two.aux_sum),
                "same_load": all(torch.equal(a, b) for a, b in zip(load_one, _routing(model))),
                "in_flight": (one.max_in_flight, in_flight(schedule, 2, dims.pp_rank, M, V), two.max_in_flight,
                              in_flight(schedule, 2, dims.pp_rank, M, V, lanes=True)),
                "one_overlap": one.lanes_overlap_s, "two_overlap": two.lanes_overlap_s,
                "pairs_overlapping": sum(spans[("F", *f_ops[j + pair])][0] < spans[("B", *b_ops[j])][1]
                                         and spans[("B", *b_ops[j])][0] < spans[("F", *f_ops[j + pair])][1]
                                         for j in range(M * V - pair)),
                # the forward lane's P2P on the PP group, the backward lane's on the backward PP group
                "p2p_ok": bool(p2p) and all(g is (pp_f if t == "nanotitan-forward-lane" else pp_b)
                                            for t, g in p2p),
                "p2p_lanes": {t for t, _ in p2p},
                "forward_a2a_threads": {t for b, t in a2a if not b},
                "exposed_le_wait": two.ep_exposed_s <= two.ep_wait_s + 1e-9,
                "W": sum(k == "W" for k, *_ in timeline),
                # zb1's split stages fill too: a due W ran inside a B, while that B's all-to-all travelled
                "W_in_B": sum(any(b0 < w0 and w1 < b1 for k, _, _, b0, b1 in timeline if k == "B")
                              for k, _, _, w0, w1 in timeline if k == "W"),
            }
    finally:
        for k, f in plain.items():
            setattr(comm, k, f)
    out["pp4"] = _pp4_cases(rank)
    return out


@pytest.mark.timeout(300)
def test_lanes_under_a_pipeline_overlap_bitwise():
    """PP2·EP2, M = 4, capacity and router bias on, 1f1b without and zb1 and interleaved (V = 2, the ring) with
    activation checkpointing: the two-lane step's gradients, losses and router counts equal the schedule's own step
    bit for bit; the forwards ran on the lane's thread and a stage's F(w+j) (the last stage's F(j+1)) really ran
    beside its B(j); each lane's P2P went on its own PP group (the backward lane's on "pp_backward"); no stage held
    more than `in_flight(lanes=True)`; zb1's later stage still ran its W's, each due one (all but the last) inside
    the next B (the fill). Then PP4 on the same processes (no EP), 1f1b with M = 3 < PP (no steady phase on the
    first stages) and zb1 with M = 8 (three stages defer W's): neighbours' sends and receives match at every phase
    boundary (no hang) and every stage's gradients are bitwise the schedule's own; likewise gpipe (M = 3) and
    interleaved on PP4's ring (V = 2, M = 8, a steady phase on every stage)."""
    results = run_ranks(_pp_lanes_rank, world=4, timeout=290)
    for rank, res in enumerate(results):
        for case, (same, held) in res.pop("pp4").items():
            assert same and held, f"PP4 rank {rank} {case}: same gradients {same}, within in_flight {held}"
        overlapping = 0
        for (schedule, ac), r in res.items():
            name = f"rank {rank} {schedule} activation checkpointing {ac}"
            assert r["same_grads"] and r["same_loss"] and r["same_load"], f"{name}: {r}"
            # held at once: the schedule's count without the lanes; with them, at most what the planner charges
            # (how many a stage reaches depends on the lanes' timing)
            plain, want_plain, lanes, bound = r["in_flight"]
            assert plain == want_plain and want_plain <= bound and 1 <= lanes <= bound, f"{name}: {r}"
            assert r["one_overlap"] == 0.0, f"{name}: {r}"
            assert r["p2p_ok"] and r["p2p_lanes"] == {"nanotitan-forward-lane", "MainThread"}, f"{name}: {r}"
            assert r["forward_a2a_threads"] == {"nanotitan-forward-lane"}, f"{name}: {r}"
            assert r["exposed_le_wait"], f"{name}: {r}"
            assert r["W"] == (M if schedule == "zb1" and rank >= 2 else 0), f"{name}: {r}"
            assert r["W_in_B"] == (M - 1 if schedule == "zb1" and rank >= 2 else 0), f"{name}: {r}"
            overlapping += r["pairs_overlapping"] > 0 and r["two_overlap"] > 0.0
        # timing decides each single pair; over two steps, every stage ran a forward beside a backward
        assert overlapping >= 1, f"rank {rank}: no F(w+j) overlapped B(j) in any case: {res}"


def _pp4_cases(rank: int) -> dict:
    """PP4 on the same 4 processes (no EP: the P2P pattern alone): the lanes' step against the schedule's own."""
    dims = ParallelDims(1, 4, 1, rank=rank).build_groups(timeout_s=60).build_backward_ep_groups(timeout_s=60)
    out = {}
    for schedule, n in (("1f1b", 3), ("zb1", 8), ("gpipe", 3), ("interleaved", 8)):
        cfg = _pp_cfg(schedule, pp=4, ep=1, n_layers=8 if schedule == "interleaved" else 4)
        model = _stage(cfg, dims)
        g = torch.Generator().manual_seed(5)
        xs = [torch.randint(0, VOCAB, (M_SEQ, SEQ), generator=g) for _ in range(n)]
        ys = [(3 * x + 1) % VOCAB for x in xs]
        one, g_one = _step(model, dims, xs, ys, lanes=False, schedule=schedule)
        two, g_two = _step(model, dims, xs, ys, lanes=True, schedule=schedule)
        out[schedule, n] = (all(torch.equal(g_one[k], g_two[k]) for k in g_one),
                            two.max_in_flight <= in_flight(schedule, 4, dims.pp_rank, n, cfg.parallel.virtual_stages,
                                                           lanes=True))
    return out



def test_the_breakdown_places_each_exposed_second():
    """bench overlap --breakdown on hand-made records: per lane, call, place (unpaired ends vs pairs), state, and
    the part before the peer rank's matching call."""
    from nanotitan.observe.runs import ep_wait_breakdown

    spans = [("F", 0, 0, 0.0, 10.0), ("F", 0, 1, 10.0, 14.0), ("B", 0, 0, 10.0, 20.0), ("B", 0, 1, 20.0, 30.0)]
    waits = [(0, 2.0, 5.0, "f:dispatch", 2.0),  # F(0) alone: exposed 3, the peer called at 4
             (1, 12.0, 13.0, "b:combine", 12.0),  # B(0) beside F(1) computing: hidden
             (0, 12.5, 13.5, "f:combine", 12.5),  # both blocked 12.5-13: split; 13-13.5 F alone blocked, B computes
             (1, 25.0, 27.0, "b:dispatch", 25.0)]  # B(M-1) alone: exposed 2
    peer = [(0, 0.0, 0.0, "f:dispatch", 4.0), (1, 0, 0, "b:combine", 12.0), (0, 0, 0, "f:combine", 12.5),
            (1, 0, 0, "b:dispatch", 25.0)]
    r = ep_wait_breakdown(spans, waits, peer, M=2)
    assert r["exposed"] == pytest.approx(exposed_ep_wait([s[:1] + s[3:] for s in spans], waits)) == pytest.approx(5.5)
    assert r["at:F0"] == pytest.approx(3.0) and r["at:B(M-1)"] == pytest.approx(2.0)
    assert r["at:pairs"] == pytest.approx(0.5)  # 12.5-13, split between B(0)'s and F(1)'s calls
    assert r["lane:F"] == pytest.approx(3.25) and r["lane:B"] == pytest.approx(2.25)
    assert r["state:both-blocked"] == pytest.approx(0.5) and r["state:other-idle"] == pytest.approx(5.0)
    assert r["peer:F"] == pytest.approx(2.0) and r.get("peer:B", 0.0) == 0.0
    assert r["kind:b:dispatch"] == pytest.approx(2.0) and r["wait:F"] == pytest.approx(4.0)
