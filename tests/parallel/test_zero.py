"""ZeRO-1/2 (`ShardedReducer`) must train what the replicated Reducer trains, and what one process trains.

On real gloo processes (2 and 4 ranks), each case runs the same 3 steps three ways: the Reducer with a
full AdamW, the ShardedReducer with AdamW on the shard params, and a single process accumulating every
rank's microbatches (computed on each rank). Clipping uses the product's clip_grad_norm_. Checked: the
shard grad is this rank's slice of the Reducer's averaged gradient; zero 1 and zero 2 "full": no dp traffic
before the final microbatch and every bucket launched during backward; zero 2 "shard": every bucket launched
during every backward, never more than three full buffers alive at once, none after finish(); the global norm;
params after the all-gather (bitwise equal to the Reducer's at 2 ranks without clipping, on the transformer
whose tensors are whole SIMD vectors: sums of two are exact and nothing else differs; zero 2 "shard" with M > 1
sums in another order, so to rounding); replicas bitwise identical; optimizer/gradient bytes per rank 1/N of replicated; the
per-parameter optimizer state (each bucket's slices all-gathered and cut per param) equal to the replicated
optimizer's, the checkpoint form's boxes (`sharded_state`) the matching regions of it, and that state written back
through those boxes (as a checkpoint load does) the state the optimizer had. A second part checks the norm of sharded grads (ZeRO shards, EP and PP) against torch on the
whole model in one process.
"""

import contextlib
import math
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from nanotitan.parallel.comm import collectives as comm
from nanotitan.parallel.clip import clip_grad_norm_
from nanotitan.parallel.comm.collectives import COMM
from nanotitan.parallel.dims import ParallelDims
from nanotitan.observe.memory import PeakTensorBytes, live_tensor_bytes
from nanotitan.parallel.dp.reducer import Reducer
from nanotitan.model.families import MATRIX
from nanotitan.optim.adamw import AdamW, decay_groups
from nanotitan.parallel.dp.sync import ReplicatedSync, flat_range_boxes
from nanotitan.parallel.dp.zero import ShardedReducer, ZeroSync
from tests.helpers.mp import run_ranks
from tests.helpers.dp import _build, _loss
from tests.helpers.whole_state import whole_state

LR, WD, STEPS = 1e-2, 0.1, 3


def _adamw(groups):
    return AdamW(groups, lr=LR, fused=True)


def _decay_groups(model: nn.Module):
    """The trainer's rule (optim/adamw.py: decay_groups), written out: decay on matrices only."""
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": WD},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def _close(a, b, msg):
    # AdamW normalises each coordinate's update, so float reassociation in a ~0 gradient can move a
    # coordinate by up to ~lr: atol is 1e-3 of the largest possible movement (as tests/helpers/equivalence.py).
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-3 * LR * STEPS, msg=msg)


@torch.no_grad()
def _gathered_state(rb: ShardedReducer, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    """{param name: {state key: tensor}} as a replicated optimizer holds it: each bucket's state slices all-gathered
    over its group and cut per param (a scalar such as AdamW's `step` is shared by every param of the bucket).
    Collective; independent of `sharded_state`, whose boxes are checked against it."""
    out: dict[str, dict] = {}
    for b in rb.buckets:
        state = optimizer.state_of(b.shard)
        for key in sorted(state):  # same collective order on every rank
            v = state[key]
            if v.dim() == 0:
                for name in b.names:
                    out.setdefault(name, {})[key] = v.detach().clone()
                continue
            full = v.new_empty(b.padded)
            if rb.group is not None:
                comm.all_gather(full, v, rb.group).wait()
            else:
                full.copy_(v)
            for name, p, o in zip(b.names, b.params, b.offsets):
                out.setdefault(name, {})[key] = full[o:o + p.numel()].view_as(p)
    return out


def _gather(rb: ShardedReducer) -> None:
    """After the optimizer step: the full updated params again on every rank."""
    rb.start_gather()
    rb.wait_gather()


def _full_buffers(rb: ShardedReducer) -> int:
    """Full-size gradient buffers alive: buckets being filled plus reduce-scatters in flight."""
    return sum(b.flat is not None for b in rb.buckets) + len(rb._in_flight)


def _one_case(rank, world, kind, zero, accumulate, bucket_mb, M, max_norm):
    group = dist.group.WORLD
    name = f"{kind} zero={zero} {accumulate} bucket={bucket_mb} M={M} clip={max_norm} world={world}"
    a, b, c = _build(kind), _build(kind), _build(kind)  # Reducer, ShardedReducer, one process
    ra = Reducer(list(a.named_parameters()), group, bucket_mb, 1.0 / world)
    rb = ShardedReducer(list(b.named_parameters()), group, bucket_mb, 1.0 / world, zero, accumulate=accumulate)
    every = zero == 2 and accumulate == "shard"
    assert rb.every_backward == every, name
    oa, ob, oc = _adamw(_decay_groups(a)), _adamw(decay_groups(rb.param_groups(), WD)), _adamw(_decay_groups(c))
    # one group per tag, each bucket's shard in its tag's group, matrices (and only they) decayed
    assert sorted((g["tag"], len(g["params"])) for g in ob.param_groups) == \
        sorted((t, sum(x.tag == t for x in rb.buckets)) for t in {x.tag for x in rb.buckets})
    assert all((g["weight_decay"] == WD) == (g["tag"] == MATRIX) for g in ob.param_groups)
    most_buffers = []  # every=True: full buffers alive, sampled as each param's gradient lands
    for q in b.parameters():
        q.register_post_accumulate_grad_hook(lambda q: most_buffers.append(_full_buffers(rb)))
    for step in range(STEPS):
        for mb in range(M):
            ra.prepare(sync=mb == M - 1)
            _loss(a, kind, rank, step, mb, M).backward()
            COMM.reset()
            rb.prepare(sync=mb == M - 1)
            _loss(b, kind, rank, step, mb, M).backward()
            if every and kind == "transformer":  # every param got a grad: every bucket launched in each backward
                # one dp call per reduce-scatter, on gloo too (a direct exchange: comm.SHARDED_BY_EXCHANGE)
                assert COMM.calls["dp"] == len(rb.buckets), f"{name}: microbatch {mb}"
            elif not every and mb < M - 1:
                assert COMM.calls["dp"] == 0, f"{name}: dp communication before the final microbatch"
            elif kind == "transformer":
                assert COMM.calls["dp"] == len(rb.buckets), name
        ra.finish()
        rb.finish()
        if every and kind == "transformer":
            # never a full gradient: at most IN_FLIGHT_BUCKETS buckets on the wire plus the ones backward is filling
            # (the tinynet's never-used param holds every launch back to the next prepare(), by design)
            assert max(most_buffers) <= 3 and len(rb.buckets) > 6, (name, max(most_buffers), len(rb.buckets))
        if every:
            assert _full_buffers(rb) == 0, name
        for r in range(world):  # the single process: every rank's microbatches, mean over world * M
            for mb in range(M):
                (_loss(c, kind, r, step, mb, M) / world).backward()
        # the shard grad is this rank's slice of the averaged gradient (padding: zeros)
        for bkt in rb.buckets:
            full = torch.cat([dict(a.named_parameters())[n].grad.reshape(-1) for n in bkt.names])
            full = torch.cat([full, full.new_zeros(bkt.padded - full.numel())])
            S = bkt.padded // world
            torch.testing.assert_close(bkt.shard.grad, full[rank * S:(rank + 1) * S], rtol=1e-6, atol=1e-7,
                                       msg=f"{name}: shard grad of {bkt.names}")
            if zero == 2:
                assert all(p.grad is None for p in bkt.params), f"{name}: zero 2 kept full grads after finish"
        if step == 0:
            sa, sb = live_tensor_bytes(a, oa), live_tensor_bytes(b, ob)
            if zero == 2:  # grads: 1/N plus padding (< 16 fp32 per rank and bucket)
                assert sb["grad_bytes"] <= sa["grad_bytes"] / world + 64 * len(rb.buckets), (name, sa, sb)
        norm_a = clip_grad_norm_([], list(a.parameters()), max_norm, None, None)
        norm_b = clip_grad_norm_([], [], max_norm, None, None, rb.shard_params, group)
        norm_c = clip_grad_norm_([], list(c.parameters()), max_norm, None, None)
        torch.testing.assert_close(norm_b, norm_a, rtol=1e-6, atol=0, msg=f"{name}: norm")
        torch.testing.assert_close(norm_b, norm_c, rtol=1e-5, atol=0, msg=f"{name}: norm vs one process")
        oa.step()
        ob.step()
        oc.step()
        _gather(rb)
        for (pname, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
            if world == 2 and max_norm == 0 and kind == "transformer" and (M == 1 or not every):
                # x + y is exact in any order and AdamW is elementwise. (Only where every tensor is a whole
                # number of SIMD vectors: fused AdamW's scalar tail may round differently from its vector body.)
                # Not for zero 2 "shard" with M > 1: it sums (r0 mb0 + r1 mb0) + (r0 mb1 + r1 mb1), the Reducer
                # (r0 mb0 + r0 mb1) + (r1 mb0 + r1 mb1): the same terms in another order, equal up to rounding.
                assert torch.equal(pa, pb), f"{name}: {pname} differs from the Reducer's (step {step})"
            _close(pb, pa, f"{name}: {pname} vs Reducer, step {step}")
            _close(pb, pc, f"{name}: {pname} vs one process, step {step}")
        ra.zero_grad()
        rb.zero_grad()
        oc.zero_grad()

    # optimizer state: 1/N per rank; in per-parameter form it is the replicated optimizer's state
    sa, sb = live_tensor_bytes(a, oa), live_tensor_bytes(b, ob)
    assert sb["optim_bytes"] <= sa["optim_bytes"] / world + (2 * 64 + 4) * len(rb.buckets), (name, sa, sb)
    full = _gathered_state(rb, ob)
    for pname, pa in a.named_parameters():
        st = oa.state[pa]
        assert set(full[pname]) == set(st), name
        for k in st:
            tol = dict(rtol=0, atol=0) if k == "step" else dict(rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(full[pname][k], st[k], **tol, msg=f"{name}: optim {pname}.{k}")
    # the checkpoint form: this rank's boxes of each param's state are the matching regions of the whole state
    _, boxes = ZeroSync.sharded_state(SimpleNamespace(reducers=[rb], model=b), ob)
    for pname, st in boxes.items():
        for k, pieces in st.items():
            assert pieces.size == full[pname][k].shape, (name, pname, k)
            for off, t in pieces.boxes:
                region = full[pname][k][tuple(slice(o, o + z) for o, z in zip(off, t.shape))]
                assert torch.equal(t, region), f"{name}: box {off} of {pname}.{k}"
    # ... and back: the whole state written into those boxes (what a checkpoint load does) is the state it was
    before = {(i, k): v.clone() for i, bkt in enumerate(rb.buckets) for k, v in ob.state[bkt.shard].items() if v.dim()}
    for bkt in rb.buckets:
        for v in ob.state[bkt.shard].values():
            v.zero_()
    _, boxes = ZeroSync.sharded_state(SimpleNamespace(reducers=[rb], model=b), ob)
    for pname, st in boxes.items():
        for k, pieces in st.items():
            for off, t in pieces.boxes:
                t.copy_(full[pname][k][tuple(slice(o, o + z) for o, z in zip(off, t.shape))])
    after = {(i, k): v for i, bkt in enumerate(rb.buckets) for k, v in ob.state[bkt.shard].items() if v.dim()}
    assert all(torch.equal(before[k], after[k]) for k in before), f"{name}: state round trip"
    assert all(float(ob.state[bkt.shard]["step"]) == STEPS for bkt in rb.buckets), name
    return torch.cat([p.detach().reshape(-1) for p in b.parameters()]).numpy()


# (kind, zero, zero_accumulate, bucket MB, M, clip): zero 2 both ways; "shard" with M = 1 (bitwise the Reducer's),
# M = 3, and the tinynet's params that get no gradient on one rank or in one microbatch (reduced as zeros).
CASES = [("transformer", 1, "full", 0.002, 2, 0.5), ("transformer", 2, "full", 0.002, 2, 0.0),
         ("transformer", 2, "shard", 0.002, 3, 0.0), ("transformer", 2, "shard", 0.002, 1, 0.5),
         ("tinynet", 1, "full", 1000.0, 3, 0.0), ("tinynet", 2, "shard", 1e-9, 2, 0.5)]


def _zero_ranks(rank, world):
    return [_one_case(rank, world, *case) for case in CASES]


# --- clipping over sharded gradients -----------------------------------------------------------------

def _full_grads(kind: str, pp_rank: int, ep_rank: int) -> list[torch.Tensor]:
    out = []
    for j, n in enumerate((15, 7)):
        g = torch.Generator().manual_seed(zlib.crc32(f"{kind}/{pp_rank}/{ep_rank}/{j}".encode()))
        out.append(torch.randn(n, generator=g) * (3.0 if kind == "expert" else 1.0))
    return out


def _slice(grads: list[torch.Tensor], n_slices: int, i: int) -> nn.Parameter:
    """One rank's slice of the flat, padded concatenation of `grads` (what a ShardedReducer bucket holds)."""
    flat = torch.cat(grads)
    S = -(-flat.numel() // n_slices)
    flat = torch.cat([flat, flat.new_zeros(S * n_slices - flat.numel())])
    p = nn.Parameter(torch.zeros(S))
    p.grad = flat[i * S:(i + 1) * S].clone()
    return p


def _sharded_clip_ranks(rank, world):
    out = []
    for dp, pp, ep in [(2, 1, 2), (2, 2, 1), (1, 2, 2), (4, 1, 1)]:
        dims = ParallelDims(dp, pp, ep, rank=rank).build_groups()
        d, p, e = dims.coords()
        for max_norm in (1.0, 0.0):
            # replicated params of stage p sharded over non-expert-DP (dp*ep ranks), experts of (p, e) over dp
            rep = _slice(_full_grads("rep", p, 0), dp * ep, d * ep + e)
            exp = _slice(_full_grads("expert", p, e), dp, d)
            norm = clip_grad_norm_([], [], max_norm, dims.group("pp"), None, [rep, exp], dims.group("non_expert_dp"))
            full = [nn.Parameter(torch.zeros(1)) for _ in range(2 * pp + 2 * pp * ep)]
            grads = [g for s in range(pp) for g in _full_grads("rep", s, 0)]
            grads += [g for s in range(pp) for x in range(ep) for g in _full_grads("expert", s, x)]
            for q, g in zip(full, grads):
                q.data, q.grad = torch.zeros_like(g), g.clone()
            ref = torch.nn.utils.clip_grad_norm_(full, max_norm if max_norm else float("inf"))
            torch.testing.assert_close(norm, ref, rtol=1e-6, atol=0)
            clipped = [q.grad for q in full]
            ref_rep = _slice(clipped[2 * p:2 * p + 2], dp * ep, d * ep + e)
            k = 2 * pp + 2 * (p * ep + e)
            ref_exp = _slice(clipped[k:k + 2], dp, d)
            torch.testing.assert_close(rep.grad, ref_rep.grad, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(exp.grad, ref_exp.grad, rtol=1e-6, atol=1e-7)
            if max_norm:
                assert norm > max_norm  # the case really clips
            out.append(float(norm))
    return out


def _world4(rank, world):
    return _zero_ranks(rank, world), _sharded_clip_ranks(rank, world)  # one launch: start-up dominates


def test_zero_matches_reducer_and_one_process_world2():
    flat = run_ranks(_zero_ranks, 2, timeout=120)
    for i in range(len(CASES)):
        assert np.array_equal(flat[0][i], flat[1][i]), f"{CASES[i]}: replicas differ after the all-gather"


def test_zero_and_sharded_clip_world4():
    out = run_ranks(_world4, 4, timeout=180)
    for i in range(len(CASES)):
        assert all(np.array_equal(out[0][0][i], o[0][i]) for o in out), f"{CASES[i]}: replicas differ"
    norms = [o[1] for o in out]
    assert all(n == norms[0] for n in norms), "ranks disagree on the global norm"


@pytest.mark.parametrize("zero,accumulate", [(1, "full"), (2, "full"), (2, "shard")])
def test_single_rank_shard_is_whole_bucket(zero, accumulate):
    """group None: the shard is the whole bucket; scale only, no communication, the same AdamW update."""
    a, b = _build("tinynet"), _build("tinynet")
    ra, rb = Reducer(list(a.named_parameters()), None, 0.001, 0.25), \
        ShardedReducer(list(b.named_parameters()), None, 0.001, 0.25, zero, accumulate=accumulate)
    oa, ob = _adamw(_decay_groups(a)), _adamw(decay_groups(rb.param_groups(), WD))
    COMM.reset()
    for step in range(2):
        for r, m in ((ra, a), (rb, b)):
            r.prepare(sync=True)
            _loss(m, "tinynet", 0, step, 0, 1).backward()
            r.finish()
        oa.step()
        ob.step()
        _gather(rb)
        ra.zero_grad()
        rb.zero_grad()
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)
    assert COMM.calls["dp"] == 0


def test_flat_range_boxes_tile_a_flat_range_with_contiguous_boxes():
    """Every flat range [a, b) of every shape: boxes in order, each contiguous in row-major memory, tiling it."""
    for shape in [(7,), (3, 5), (2, 3, 4), (4, 1, 6)]:
        flat = torch.arange(math.prod(shape)).view(shape)
        for a in range(flat.numel() + 1):
            for b in range(a, flat.numel() + 1):
                pos = a
                boxes = flat_range_boxes(shape, a, b)
                assert len(boxes) <= 2 * len(shape) - 1
                for off, size in boxes:
                    box = flat[tuple(slice(o, o + z) for o, z in zip(off, size))].reshape(-1)
                    assert box.tolist() == list(range(pos, pos + box.numel())) and box.numel(), (shape, a, b)
                    pos += box.numel()
                assert pos == b, (shape, a, b)


def test_rejects_zero_3():
    with pytest.raises(ValueError, match="zero 3 is fsdp.py"):
        ShardedReducer(list(_build("tinynet").named_parameters()), None, 1.0, 1.0, zero=3)


# --- ZeRO-3: FSDP2 on our meshes ----------------------------------------------------------------------

def _fsdp_vs_reducer(rank, world, dp, ep, max_norm, accumulate="full", reshard="never"):
    """The same layout trained twice: zero 0 (Reducers) and zero 3 (apply_fsdp + FSDPSync). Also returns the
    high-water mark of live tensor bytes over zero 3's forwards and backwards of the last step."""
    from nanotitan.config.config import Config
    from tests.helpers.specs import build_shard_spec
    from nanotitan.model.transformer import Transformer, is_expert_param
    from nanotitan.parallel.ep import apply_ep
    from nanotitan.parallel.dp.fsdp import FSDPSync

    cfg = Config()
    cfg.model.vocab_size, cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads = 64, 16, 2, 2
    cfg.model.ffn_dim, cfg.model.num_experts, cfg.parallel.dp, cfg.parallel.ep = 32, 4, dp, ep
    dims = ParallelDims(dp, 1, ep, rank=rank).build_groups()
    name = f"zero3 dp={dp} ep={ep} clip={max_norm} {accumulate} {reshard}"
    models = []
    for _ in range(2):
        m = Transformer(cfg.model, build_shard_spec(cfg, 0, dims.ep_rank), seed=0)
        models.append(apply_ep(m, dims))
    a, b = models
    scale = 1.0 / dims.data_world

    def by_group(model):
        named = list(model.named_parameters())
        return [(n, p) for n, p in named if is_expert_param(n)], [(n, p) for n, p in named if not is_expert_param(n)]

    sync_a = ReplicatedSync(a, dims, *by_group(a), 0.002, scale)
    sync_b = FSDPSync(b, dims, *by_group(b), 0.002, scale, accumulate, reshard)
    # experts are left to a Reducer only when expert-DP is one rank
    assert bool(sync_b.unsharded) == (dp == 1), name
    oa, ob = _adamw(decay_groups(sync_a.param_groups(), WD)), _adamw(decay_groups(sync_b.param_groups(), WD))
    M, meter, held = 2, PeakTensorBytes(torch.device("cpu")), []
    for step in range(STEPS):
        for model, sync in ((a, sync_a), (b, sync_b)):
            metered = model is b and step == STEPS - 1
            with meter if metered else contextlib.nullcontext():
                for mb in range(M):
                    g = torch.Generator().manual_seed(1000 * dims.data_rank + 10 * step + mb)
                    tok = torch.randint(0, 64, (2, 9), generator=g)
                    ce, aux = model(tok[:, :-1], tok[:, 1:])
                    if metered and mb == 0:  # what the first forward left live beyond the step's start
                        held.append(meter.live() - meter.start)
                    sync.prepare(sync=mb == M - 1)
                    ((ce + 0.01 * aux) / M).backward()
                    if metered and mb == 0:  # ... and the first backward
                        held.append(meter.live() - meter.start)
                sync.finish()
        norm_a, norm_b = sync_a.clip(max_norm), sync_b.clip(max_norm)
        torch.testing.assert_close(norm_b, norm_a, rtol=1e-6, atol=0, msg=f"{name}: norm")
        oa.step()
        ob.step()
        if step == 0:
            sa, sb = live_tensor_bytes(a, oa), live_tensor_bytes(b, ob)
        for sync in (sync_a, sync_b):
            sync.zero_grad()
        full_b, optim_b = whole_state(sync_b, ob)
        for pname, pa in a.named_parameters():
            # sums of two, exact power-of-two scales, elementwise AdamW; "shard" adds the ranks' sums of each
            # microbatch instead (the same terms in another order: equal up to rounding)
            if world == 2 and max_norm == 0 and accumulate == "full":
                assert torch.equal(full_b[pname], pa), f"{name}: {pname} differs (step {step})"
            _close(full_b[pname], pa, f"{name}: {pname} step {step}")
    for pname, pa in a.named_parameters():
        for k, v in oa.state[pa].items():
            torch.testing.assert_close(optim_b[pname][k], v, rtol=1e-4, atol=1e-6, msg=f"{name}: {pname}.{k}")
    # a forward outside backward (eval) leaves gathered the modules that keep their params after a forward
    # ("never"; without PP the last block under "always"): the state read after it is still the shards and theirs
    with torch.no_grad():
        b(tok[:, :-1], tok[:, 1:])
    model_state, optim_state = sync_b.sharded_state(ob)
    assert all(optim_state[n] for n in model_state), f"{name}: AdamW state after an eval forward"
    # loading whole per-parameter state as a checkpoint load does (each rank copies the regions of its boxes into
    # them) gives every rank its shards of exactly that state
    model_a = dict(a.named_parameters())
    whole_a = {n: (p.detach(), {k: oa.state[p][k] for k in optim_state[n]}) for n, p in model_a.items()}
    with torch.no_grad():
        for n, (p, st) in whole_a.items():
            for pieces, src in [(model_state[n], p)] + [(optim_state[n][k], v) for k, v in st.items()]:
                for off, t in pieces.boxes:
                    t.copy_(src[tuple(slice(o, o + z) for o, z in zip(off, t.shape))])
    full_b, optim_b = whole_state(sync_b, ob)
    for pname, pa in model_a.items():
        assert torch.equal(full_b[pname], pa), f"{name}: {pname} after loading into its pieces"
        assert all(torch.equal(optim_b[pname][k], v) for k, v in oa.state[pa].items()), f"{name}: {pname} state"
    full_bytes = sum(4 * p.numel() for p in a.parameters())
    last_bytes = sum(4 * p.numel() for p in list(a.layers.values())[-1].parameters())
    return sa, sb, (meter.peak, *held, full_bytes, last_bytes)


def test_zero3_fsdp_matches_reducer_world2():
    """Both memory behaviours of zero 3 train what zero 0 trains; freeing what it gathers lowers the peak."""
    out = run_ranks(_fsdp_world2, 2, timeout=240)
    for never, always, ep_case in out:
        for sa, sb, _ in (never, always):  # sharded over dp*ep = 2: params and optimizer state halve (+ padding)
            for k in ("param_bytes", "optim_bytes"):
                assert sb[k] <= 0.55 * sa[k], (k, sa, sb)
        # (peak, live after the first forward, live after its backward, the whole model's bytes, the last block's),
        # live counted from the step's start. "always" frees each module's gathered params after its forward (and
        # backward), except without PP the last block's until its backward; "shard" reduce-scatters each
        # microbatch's gradients at once; "never" + "full" keep the gathered params (the whole model: every rank's
        # shard) and the unsharded gradients (the same again) between microbatches.
        (_, fwd_n, bwd_n, full, last), (_, fwd_a, bwd_a, _, _) = never[2], always[2]
        assert fwd_n - fwd_a >= 0.9 * (full - last), (fwd_n, fwd_a, full, last)
        assert bwd_n - bwd_a >= 1.8 * full, (bwd_n, bwd_a, full)


def _fsdp_world2(rank, world):
    return (_fsdp_vs_reducer(rank, world, 2, 1, 0.0), _fsdp_vs_reducer(rank, world, 2, 1, 0.0, "shard", "always"),
            _fsdp_vs_reducer(rank, world, 1, 2, 0.5, "shard", "always"))


def _gather_overlap_ranks(rank, world):
    """ZeroSync.after_step posts the all-gathers and returns; the next forward waits per block, in use order."""
    from nanotitan.config.config import ModelConfig
    from nanotitan.model.transformer import Transformer, is_expert_param

    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=4, n_heads=2, ffn_dim=24, num_experts=2, top_k=1,
                      max_seq_len=8)
    model = Transformer(cfg, seed=0)
    dims = ParallelDims(2, 1, 1, rank=rank).build_groups(timeout_s=60)
    named = list(model.named_parameters())
    sync = ZeroSync(model, dims, [(n, p) for n, p in named if is_expert_param(n)],
                    [(n, p) for n, p in named if not is_expert_param(n)], bucket_mb=1e-3, scale=0.5, zero=1)
    opt = AdamW(sync.param_groups(), lr=1e-2)
    buckets = [b for r in sync.reducers for b in r.buckets]
    block = {k: [id(p) for p in blk.parameters()] for k, blk in model.layers.items()}
    seen = {}

    def spy(key):  # registered after ZeroSync's waiter: runs once this block's buckets have landed
        def hook(module, args):
            mine = [b for b in buckets if any(id(p) in block[key] for p in b.params)]
            seen[key] = (all(b.gather is None for b in mine), sum(b.gather is not None for b in buckets))
        return hook

    for k, blk in model.layers.items():
        blk.register_forward_pre_hook(spy(k))
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    for step in range(2):
        sync.prepare(True)
        logits, _ = model(x)
        logits.float().square().mean().backward()
        sync.finish()
        opt.step()
        sync.after_step()
        pending_after_step = sum(b.gather is not None for b in buckets)
        sync.zero_grad()
    with torch.no_grad():
        model(x)
    full, _ = whole_state(sync)
    sync.close()
    return {"pending": pending_after_step, "seen": seen, "n_buckets": len(buckets),
            "params": {n: t.clone() for n, t in full.items()}}


def test_zero1_param_gather_overlaps_the_next_forward():
    out = run_ranks(_gather_overlap_ranks, 2, timeout=120)
    for r in out:
        assert r["pending"] == r["n_buckets"] > 4, r["pending"]  # after_step returned with every gather in flight
        waits = [r["seen"][k] for k in sorted(r["seen"], key=int)]
        assert all(own for own, _ in waits), waits  # a block never runs before its own buckets landed
        assert waits[0][1] > 0 and waits[-1][1] < waits[0][1], waits  # later blocks' gathers still travelling
    for n, t in out[0]["params"].items():
        assert torch.equal(t, out[1]["params"][n]), f"replicas of {n} differ"


def _native_vs_exchange_ranks(rank, world):
    """The same cases with gloo's own reduce-scatter / all-gather (what NCCL runs) and as direct exchanges (what
    gloo runs by default, comm.SHARDED_BY_EXCHANGE: comm._exchange_reduce_scatter / _exchange_all_gather); each is
    checked against the Reducer inside _one_case and _fsdp_vs_reducer (zero 3: FSDP2 with and without the custom
    comms)."""
    from nanotitan.parallel.comm import collectives as comm
    out = {}
    for native in (True, False):
        comm.SHARDED_BY_EXCHANGE = () if native else ("gloo",)
        out[native] = [_one_case(rank, world, *case) for case in CASES[:3]]
        _fsdp_vs_reducer(rank, world, 2, 1, 0.0, "shard", "always")
    return out


def test_zero_on_gloo_exchange_path_gives_the_native_collectives_bits():
    """On gloo, ZeRO's reduce-scatter and all-gather run as direct send/recv exchanges (a ring's bytes; gloo's own
    collectives cost about twice its all-reduce): at 2 ranks every sum has two terms, so both paths give the same
    bits; the native one stays tested because NCCL runs it."""
    out = run_ranks(_native_vs_exchange_ranks, 2, timeout=240)
    for ranks_out in out:
        for i, (a, b) in enumerate(zip(ranks_out[True], ranks_out[False])):
            assert np.array_equal(a, b), f"{CASES[i]}: the exchange path differs from gloo's own collectives"
