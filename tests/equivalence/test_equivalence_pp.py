"""The equivalence matrix (DESIGN §4) for the schedules past 1F1B: interleaved 1F1B (V=2 virtual stages per rank)
and zero-bubble zb1 train the same model as one process, in every composition with DP and EP.

Same harness and bar as tests/helpers/equivalence.py (the real trainer on real gloo processes, 10 steps,
B = 16 sequences, m = 2): per-step loss to fp32 relative 1e-5 against the single process over the same 8
microbatches, final parameters (each rank against its slice), replicas bitwise identical. Interleaved with
PP=4 and V=2 needs 8 chunks, hence 8 layers, and its own 8-layer reference. The balance loss is on
(aux_coef 0.05), so a chunk whose aux term missed its own backward, or went into another chunk's, fails.
One launch per world size runs every case of that size.
"""

import pytest
import torch

from tests.helpers.mp import run_ranks
from tests.helpers.equivalence import _run_cases, check_case, one_process

V2 = ("--parallel.virtual_stages", "2")
L8 = ("--model.n_layers", "8")
ZERO = ("--train.ckpt_at_end", "false")  # sharded DP does not checkpoint (yet): config.validate refuses it
OV = ("--parallel.ep_overlap", "true")  # 4 experts over EP2: each trip in 2 groups of 1 expert
AC = ("--train.activation_checkpointing", "true")
GR = ("--model.experts_impl", "grouped")  # one grouped GEMM per projection (model/test_grouped.py), vs the loop's reference


@pytest.fixture(scope="module")
def reference_8_layers(corpus_dir, tmp_path_factory):
    return one_process(corpus_dir, tmp_path_factory, "ref8", L8)


def _matrix(world, cases, corpus_dir, tmp_path, refs, timeout, twins_expected=0):
    twins = []
    results = run_ranks(_run_cases, world, args=(cases, str(corpus_dir), str(tmp_path)), timeout=timeout,
                        pg_timeout=120)
    for i, case in enumerate(cases):
        ref = refs["8"] if L8[0] in case[-1] else refs["4"]
        check_case(f"{case}", [results[r][i] for r in range(world)], ref)
        extra = case[4]
        k = next((j for j in range(0, len(extra), 2) if extra[j] == OV[0]), None)
        twin = (*case[:4], extra[:k] + extra[k + 2:]) if k is not None else None  # the row without ep_overlap
        if twin in cases:  # the same run bit for bit (docs/ep.md)
            twins.append(case)
            for r in range(world):
                a, b = results[r][i], results[r][cases.index(twin)]
                assert a["losses"] == b["losses"], f"{case} rank {r}: losses differ from {twin}"
                for name, (t, _) in a["params"].items():
                    assert torch.equal(t, b["params"][name][0]), f"{case} rank {r}: {name} differs from {twin}"
    assert len(twins) == twins_expected, twins


def test_world2_interleaved_zb1(corpus_dir, tmp_path, reference):
    """PP2: interleaved V=2, zb1, zb1 with activation checkpointing (B recomputes the blocks, W reuses what B kept), zb1 with the
    cost-balanced split (pp_layers auto) and with a half-layer cut (block 2's attention on stage 0, its MoE on 1).
    EP2 (PP = 1) with parallel.ep_overlap, activation checkpointing off and on: bitwise its run without overlap."""
    ac = ("--train.activation_checkpointing", "true")
    cases = [(1, 2, 1, "interleaved", V2), (1, 2, 1, "zb1", ()), (1, 2, 1, "zb1", ac),
             (1, 2, 1, "zb1", ("--parallel.pp_layers", "auto")), (1, 2, 1, "zb1", ("--parallel.pp_layers", "2.5,1.5")),
             (1, 1, 2, "1f1b", ()), (1, 1, 2, "1f1b", OV), (1, 1, 2, "1f1b", AC), (1, 1, 2, "1f1b", AC + OV)]
    _matrix(2, cases, corpus_dir, tmp_path, {"4": reference}, timeout=300, twins_expected=2)


@pytest.mark.slow  # the longest launches: CI's second tier (make test-slow)
def test_world4_interleaved_zb1(corpus_dir, tmp_path, reference, reference_8_layers):
    """PP4 (interleaved on 8 layers), DP2·PP2 and PP2·EP2: both schedules (the Reducer's buckets see zb1's
    weight gradients arrive in W; EP's all-to-alls pair up in forward and B); DP2·PP2 zb1 with ZeRO-2 too (the
    ShardedReducer's reduce-scatters follow the Reducer's protocol, so its buckets also fill in W); PP2·EP2 with a
    half-layer cut 1.5+2.5 (block 1's MoE, with its all-to-alls, opens stage 1). PP2·EP2 with parallel.ep_overlap
    under every schedule, activation checkpointing off and on: bitwise the same run without it where it is here.
    PP2·EP2 zb1 with the grouped experts inside the chunked trips (deferred weight gradients as grouped GEMMs)."""
    cases = [(1, 4, 1, "interleaved", V2 + L8), (1, 4, 1, "zb1", ()),
             (2, 2, 1, "interleaved", V2), (2, 2, 1, "zb1", ()),
             (2, 2, 1, "zb1", ZERO + ("--parallel.zero", "2")),
             (1, 2, 2, "interleaved", V2), (1, 2, 2, "zb1", ()),
             (1, 2, 2, "1f1b", ("--parallel.pp_layers", "1.5,2.5")),
             (1, 2, 2, "1f1b", ()), (1, 2, 2, "1f1b", OV), (1, 2, 2, "zb1", OV), (1, 2, 2, "1f1b", AC + OV),
             (1, 2, 2, "zb1", AC), (1, 2, 2, "zb1", AC + OV), (1, 2, 2, "interleaved", V2 + OV),
             (1, 2, 2, "gpipe", OV), (1, 2, 2, "zb1", GR + OV)]
    _matrix(4, cases, corpus_dir, tmp_path, {"4": reference, "8": reference_8_layers}, timeout=420,
            twins_expected=4)


@pytest.mark.slow  # the longest launches: CI's second tier (make test-slow)
def test_world8_interleaved_zb1(corpus_dir, tmp_path, reference):
    """DP2·PP2·EP2 (M=2: interleaved runs every forward in its warmup), and zb1 cut at 2.5,1.5 (what
    `pp_layers auto` gives the default job: block 2's MoE, with its all-to-alls, opens stage 1); with
    parallel.ep_overlap: zb1 (bitwise its run without), and 1F1B with activation checkpointing and ZeRO-2."""
    cases = [(2, 2, 2, "interleaved", V2), (2, 2, 2, "zb1", ()),
             (2, 2, 2, "zb1", ("--parallel.pp_layers", "2.5,1.5")),
             (2, 2, 2, "zb1", OV), (2, 2, 2, "1f1b", AC + OV + ZERO + ("--parallel.zero", "2"))]
    _matrix(8, cases, corpus_dir, tmp_path, {"4": reference}, timeout=420, twins_expected=1)
