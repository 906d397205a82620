"""The bucketed Reducer must give the same gradients as one all-reduce per parameter (DataParallelNaive).

Covered on real gloo processes: bucket sizes from one param per bucket to one bucket for all, several
microbatches per step (no dp communication before the final one), params with no gradient (never
used, used only on one rank, used only in a non-final microbatch), scale != 1/world, grads that stay
views of the flat buffers, bitwise-identical replicas after AdamW, torch DDP as a second reference,
and the parameter broadcast / replica check of parallel/init.py.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from nanotitan.config.config import Config, ParallelConfig
from nanotitan.parallel.comm.collectives import COMM
from nanotitan.parallel.dims import ParallelDims
from nanotitan.parallel.dp.reducer import Reducer
from nanotitan.parallel.init import broadcast_params, check_replicas
from nanotitan.parallel.parallelize import parallelize
from nanotitan.parallel.step import finish_grads, forward_backward, split_microbatches
from tests.helpers.mp import run_ranks
from tests.helpers.oracle import DataParallelNaive
from tests.helpers.dp import TINY, _build, _loss

ONE_PER_BUCKET, ONE_BUCKET = 1e-9, 1000.0


def _flat_numpy(model: nn.Module):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def _reducer_vs_naive(rank, world):
    group = dist.group.WORLD
    cases = [("transformer", ONE_PER_BUCKET, 3, 1.0 / world), ("transformer", ONE_BUCKET, 1, 0.37),
             ("transformer", 0.002, 2, 0.37), ("tinynet", ONE_PER_BUCKET, 3, 0.37), ("tinynet", ONE_BUCKET, 2, 1.0 / world)]
    for kind, bucket_mb, M, scale in cases:
        a, b = _build(kind), _build(kind)
        reducer = Reducer(list(a.named_parameters()), group, bucket_mb, scale)
        naive = DataParallelNaive(list(b.named_parameters()), group, scale)
        n_buckets, n_params = len(reducer.buckets), len(list(a.parameters()))
        if bucket_mb == ONE_PER_BUCKET:
            assert n_buckets == n_params
        if bucket_mb == ONE_BUCKET:
            assert n_buckets == 1
        ptrs = [p.grad.data_ptr() for p in a.parameters()]
        opt_a, opt_b = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
        for step in range(2):
            reducer.zero_grad()
            b.zero_grad(set_to_none=True)
            COMM.reset()
            for mb in range(M):
                reducer.prepare(sync=mb == M - 1)
                _loss(a, kind, rank, step, mb, M).backward()
                _loss(b, kind, rank, step, mb, M).backward()
                if mb < M - 1:
                    assert COMM.calls["dp"] == 0, "dp communication before the final microbatch"
            if kind == "transformer":
                # every param got its grad: all buckets must have launched during backward (overlap)
                assert COMM.calls["dp"] == n_buckets, (COMM.calls["dp"], n_buckets)
            else:
                assert COMM.calls["dp"] == 0  # `dead` is in bucket 0: nothing may jump ahead of it
            reducer.finish()
            assert COMM.calls["dp"] == n_buckets
            naive.finish()
            for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
                torch.testing.assert_close(pa.grad, pb.grad, atol=1e-6, rtol=1e-6, msg=f"{kind} {name}")
            assert [p.grad.data_ptr() for p in a.parameters()] == ptrs, "grads must stay bucket views"
            if kind == "tinynet":
                assert torch.count_nonzero(a.dead.grad) == 0 and torch.count_nonzero(a.rank0_only.weight.grad) > 0
            opt_a.step()
            opt_b.step()
        assert check_replicas(list(a.named_parameters()), group)
    return _flat_numpy(a)  # numpy pickles by value; a tensor would travel as a shared-memory handle


def _ddp_and_init(rank, world):
    group = dist.group.WORLD
    # torch DDP (averages over the group) against our bucketed Reducer (scale 1/world), M=2: each through the
    # product's own step (parallel/step.py: DDP's no_sync loop, the Reducer's hooks in the final backward).
    dims = ParallelDims(world, 1, 1, rank).build_groups()
    tok = torch.randint(0, TINY.vocab_size, (4, 9), generator=torch.Generator().manual_seed(1000 * rank))
    xs, ys, _ = split_microbatches(tok[:, :-1], tok[:, 1:], 2, torch.device("cpu"))
    grads = {}
    for impl in ("bucketed", "torch_ddp"):
        shard = parallelize(Config(model=TINY, parallel=ParallelConfig(dp=world, dp_impl=impl, bucket_mb=0.01)),
                            dims, torch.device("cpu"))
        forward_backward(shard, xs, ys, schedule="1f1b", aux_weight=0.01, device=torch.device("cpu"))
        finish_grads(shard)
        grads[impl] = {n: p.grad.clone() for n, p in shard.model.named_parameters()}
        shard.close()  # drops the DDP wrapper before the process group goes (SIGABRT at exit otherwise)
    for name, want in grads["bucketed"].items():
        torch.testing.assert_close(grads["torch_ddp"][name], want, atol=1e-6, rtol=1e-6, msg=f"ddp {name}")

    # broadcast_params: rank-dependent values become rank 0's; check_replicas sees the difference.
    torch.manual_seed(rank)
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    named = list(net.named_parameters())
    before = check_replicas(named, group)
    broadcast_params(named, src_global_rank=0, group=group)
    after = check_replicas(named, group)
    with torch.no_grad():
        if rank == world - 1:
            net[1].bias[0] = torch.nextafter(net[1].bias[0], torch.tensor(1.0))  # one ulp on one rank
    perturbed = check_replicas(named, group)
    return before, after, perturbed, _flat_numpy(net)


def _world2(rank, world):
    return _reducer_vs_naive(rank, world), _ddp_and_init(rank, world)  # one launch: start-up dominates


def test_reducer_matches_naive_world4():
    flat = run_ranks(_reducer_vs_naive, 4, timeout=90)
    for other in flat[1:]:
        assert np.array_equal(flat[0], other), "replicas differ after the optimizer step"


def test_reducer_ddp_and_init_world2():
    out = run_ranks(_world2, 2, timeout=90)
    assert np.array_equal(out[0][0], out[1][0]), "replicas differ after the optimizer step"
    init = [o[1] for o in out]
    assert [o[0] for o in init] == [False, False]  # rank-seeded params differ before the broadcast
    assert [o[1] for o in init] == [True, True]
    assert [o[2] for o in init] == [False, False]  # one ulp on one rank: every rank gets the same verdict
    assert not np.array_equal(init[0][3], init[1][3]) and np.array_equal(init[0][3][:-3], init[1][3][:-3])


def test_single_rank_scales_and_accumulates_in_place():
    """group None: no communication, grads = scale * local sum over microbatches, in the flat buffer."""
    a, b = _build("tinynet"), _build("tinynet")
    reducer = Reducer(list(a.named_parameters()), None, bucket_mb=0.001, scale=0.25)
    ptrs = [p.grad.data_ptr() for p in a.parameters()]
    COMM.reset()
    for step in range(2):
        reducer.zero_grad()
        b.zero_grad(set_to_none=True)
        for mb in range(3):
            reducer.prepare(sync=mb == 2)
            _loss(a, "tinynet", 0, step, mb, 3).backward()
            _loss(b, "tinynet", 0, step, mb, 3).backward()
        reducer.finish()
        for pa, pb in zip(a.parameters(), b.parameters()):
            expect = torch.zeros_like(pa) if pb.grad is None else 0.25 * pb.grad
            torch.testing.assert_close(pa.grad, expect, atol=0, rtol=0)
        assert [p.grad.data_ptr() for p in a.parameters()] == ptrs
    assert COMM.calls["dp"] == 0


def test_grads_reset_to_none_are_rebound():
    """optimizer.zero_grad(set_to_none=True) by mistake: prepare() binds the grads to the bucket again (as zeros)."""
    a = _build("tinynet")
    reducer = Reducer(list(a.named_parameters()), None, bucket_mb=1.0, scale=1.0)
    ptr = a.out.weight.grad.data_ptr()
    a.zero_grad(set_to_none=True)
    reducer.prepare(sync=True)
    _loss(a, "tinynet", 0, 0, 0, 1).backward()
    reducer.finish()
    assert a.out.weight.grad.data_ptr() == ptr and torch.count_nonzero(a.out.weight.grad) > 0
    assert reducer.buckets[0].flat.abs().sum() > 0


def test_finish_without_sync_fails():
    reducer = Reducer(list(_build("tinynet").named_parameters()), None, bucket_mb=1.0, scale=1.0)
    reducer.prepare(sync=False)
    with pytest.raises(RuntimeError, match="prepare\\(sync=True\\)"):
        reducer.finish()
