"""Distributed global-norm clipping must equal torch's clip_grad_norm_ on the whole model in one process.

Each rank holds the gradients a (dp, pp, ep) rank would hold after the Reducer: the replicated params
of its stage (same on every dp/ep rank) and its stage's expert shard (same on every dp rank). The
reference builds every stage's and every shard's grads once and clips them together.
"""

import zlib

import torch
import torch.nn as nn

from nanotitan.parallel.clip import clip_grad_norm_
from nanotitan.parallel.dims import ParallelDims
from tests.helpers.mp import run_ranks

SHAPES = [(3, 5), (7,)]  # two replicated tensors per stage, and two expert tensors per shard


def _params(kind: str, pp_rank: int, ep_rank: int) -> list[nn.Parameter]:
    out = []
    for j, shape in enumerate(SHAPES):
        g = torch.Generator().manual_seed(zlib.crc32(f"{kind}/{pp_rank}/{ep_rank}/{j}".encode()))
        p = nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=g) * (3.0 if kind == "expert" else 1.0)
        out.append(p)
    return out


def _local(dims: ParallelDims):
    # replicated params depend on the stage only, expert shards on (stage, ep rank) — never on dp
    return _params("expert", dims.pp_rank, dims.ep_rank), _params("rep", dims.pp_rank, 0)


def _reference(dims: ParallelDims, max_norm: float):
    full = [p for s in range(dims.pp) for p in _params("rep", s, 0)]
    full += [p for s in range(dims.pp) for e in range(dims.ep) for p in _params("expert", s, e)]
    norm = torch.nn.utils.clip_grad_norm_(full, max_norm) if max_norm > 0 else \
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in full]))
    exp, rep = _local(dims)
    n_rep = len(SHAPES) * dims.pp
    rep_start = dims.pp_rank * len(SHAPES)
    exp_start = n_rep + (dims.pp_rank * dims.ep + dims.ep_rank) * len(SHAPES)
    return norm, full[exp_start:exp_start + len(SHAPES)], full[rep_start:rep_start + len(SHAPES)]


def _clip_ranks(rank, world):
    checked = []
    for dp, pp, ep in [(1, 2, 2), (2, 1, 2)]:
        dims = ParallelDims(dp, pp, ep, rank=rank).build_groups()
        for max_norm in (1.0, 1e6, 0.0):  # clips, under the limit (exact no-op), measure only
            exp, rep = _local(dims)
            before = [p.grad.clone() for p in exp + rep]
            norm = clip_grad_norm_(exp, rep, max_norm, dims.group("pp"), dims.group("ep"))
            ref_norm, ref_exp, ref_rep = _reference(dims, max_norm)
            torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
            for p, q in zip(exp + rep, ref_exp + ref_rep):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
            if max_norm in (0.0, 1e6):
                assert all(torch.equal(p.grad, b) for p, b in zip(exp + rep, before))
            else:
                assert norm > 1.0  # the case really clips
            checked.append((dp, pp, ep, max_norm, float(norm)))
    return checked


def test_clip_norm_matches_single_process():
    out = run_ranks(_clip_ranks, 4, timeout=90)
    for layout in range(2):  # every rank of a layout reports the same norm
        assert len({round(o[layout * 3][4], 6) for o in out}) == 1


def test_clip_single_rank_matches_torch():
    dims = ParallelDims(1, 1, 1)
    exp, rep = _local(dims)
    norm = clip_grad_norm_(exp, rep, 0.5, None, None)
    ref_norm, ref_exp, ref_rep = _reference(dims, 0.5)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    for p, q in zip(exp + rep, ref_exp + ref_rep):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
