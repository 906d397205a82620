"""train.compile keeps the equivalence rule (DESIGN §4): compiled blocks train what one UNcompiled process trains.

One process with compiled blocks, then one 8-rank launch of DP2·PP2·EP2 with compiled blocks under 1F1B with zero 3
(FSDP2 over compiled blocks) and activation checkpointing, and under zb1 (deferred weight gradients) with two EP
lanes, each held to
tests/helpers/equivalence.py's bar (losses per step to fp32 relative 1e-5, final parameters, replicas bitwise) against
one uncompiled process. Two blocks (one per stage), so each rank compiles one block's graphs; inductor's on-disk
cache serves the ranks and cases after the first. Rank 0's first record carries the compile time (`compile_s`).
"""

import pytest
import torch

from tests.helpers.mp import run_ranks, train_once
from tests.helpers.equivalence import base_args, check_case, layout_args, one_process

TWO = ("--model.n_layers", "2")
COMPILE = (*TWO, "--train.compile", "true", "--train.ckpt_at_end", "false")


@pytest.fixture(scope="module")
def reference_2(corpus_dir, tmp_path_factory):
    """One uncompiled process, two blocks, accumulating over all 8 microbatches."""
    return one_process(corpus_dir, tmp_path_factory, "ref2", extra=TWO)


def _run(rank, world, cases, corpus_dir, run_root):
    return [train_once(base_args(corpus_dir, f"{run_root}/{world}_{i}") + layout_args(*case))
            for i, case in enumerate(cases)]


@pytest.mark.slow  # the longest launches: CI's second tier (make test-slow)
def test_compiled_blocks_dp2_pp2_ep2(corpus_dir, tmp_path, tmp_path_factory, reference_2):
    # One process first: its row is the tightest check, and it fills inductor's on-disk cache with the block's
    # graphs, which the 8 ranks (one block each, the same shapes) then load instead of compiling them 8 times.
    check_case("compiled (1, 1, 1)", [one_process(corpus_dir, tmp_path_factory, "c1", extra=COMPILE)], reference_2)
    cases = [(2, 2, 2, "1f1b", (*COMPILE, "--parallel.zero", "3", "--train.activation_checkpointing", "true")),
             (2, 2, 2, "zb1", (*COMPILE, "--parallel.ep_overlap_microbatches", "true"))]
    results = run_ranks(_run, 8, args=(cases, str(corpus_dir), str(tmp_path)), timeout=600, pg_timeout=300)
    for i, case in enumerate(cases):
        ranks = [results[r][i] for r in range(8)]
        check_case(f"compiled {case}", ranks, reference_2)
        records = ranks[0]["records"]
        assert records[0]["compile_s"] > 0, f"{case}: nothing was compiled"
        assert all("compile_s" not in r for r in records[1:]), "compile_s belongs to the first record"


# --- parallel.ep_dispatch static: each block compiled whole (fullgraph), its MoE and both all-to-alls inside ---------
def test_whole_blocks_only_where_nothing_needs_the_host():
    """train.compile compiles a block whole only with static dispatch and nothing that reads in_backward() or holds a
    side effect in a backward (parallel/compile.py whole_blocks); elsewhere the MoE stays eager, as before."""
    from nanotitan.config.config import Config
    from nanotitan.parallel.compile import whole_blocks

    def cfg(**kw):
        c = Config()
        c.train.compile, c.parallel.ep, c.parallel.ep_dispatch = True, 2, "static"
        for k, v in kw.items():
            section, name = k.split("__")
            setattr(getattr(c, section), name, v)
        return c
    assert whole_blocks(cfg())
    assert not whole_blocks(cfg(train__compile=False))
    assert not whole_blocks(cfg(parallel__ep_dispatch="dynamic"))
    for kw in ({"train__activation_checkpointing": True}, {"parallel__schedule": "zb1"}, {"parallel__zero": 3},
               {"parallel__ep_overlap_microbatches": True}, {"parallel__tp": 2}, {"parallel__cp": 2}):
        assert not whole_blocks(cfg(**kw)), kw


def _whole_block_rank(rank: int, world: int) -> dict:
    """Two shards of one tiny MoE Transformer (every layer MoE, EP over the world, static dispatch), one eager and one
    with every block compiled whole; three steps of forward and backward on this rank's sequences, the third under a
    capacity that overflows (NaN): each buffer size a graph of its own, the same size never a second."""
    from torch._dynamo.utils import counters

    from nanotitan.config.config import Config, ModelConfig, ParallelConfig
    from nanotitan.model.transformer import Transformer
    from nanotitan.parallel.compile import compile_blocks
    from nanotitan.parallel.dims import ParallelDims
    from nanotitan.parallel.ep import apply_ep
    from nanotitan.parallel.placement import expert_shards
    from tests.helpers.specs import build_shard_spec

    torch.set_num_threads(1)
    model = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, ffn_dim=24, num_experts=4, top_k=2,
                        moe_every=1, max_seq_len=16, experts_impl="grouped")
    cfg = Config(model=model, parallel=ParallelConfig(ep=world, ep_dispatch="static", ep_capacity=1.25))
    dims = ParallelDims(1, 1, world, rank=rank).build_groups(timeout_s=60)
    shards = [apply_ep(Transformer(cfg.model, build_shard_spec(cfg, 0, rank), seed=3, experts=expert_shards(cfg, dims)),
                       dims, capacity=cfg.parallel.ep_capacity) for _ in range(2)]
    counters.clear()
    compile_blocks(shards[1], whole=True, backend="aot_eager")  # fullgraph: any break raises
    out = {"breaks": 0, "nan": [], "max_err": 0.0}
    for step, capacity in enumerate((None, None, 0.25)):  # as configured twice (no recompile), too small (< 1)
        toks = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(5 + step + rank))
        results = []
        for shard in shards:
            shard.zero_grad()
            for m in shard.moe_layers():
                m.dispatcher.capacity = capacity or cfg.parallel.ep_capacity
            logits, _ = shard(toks)
            logits.float().square().mean().backward()
            results.append([logits.detach()] + [p.grad for p in shard.parameters()])
        out["nan"].append([bool(torch.isnan(r[0]).any()) for r in results])
        if not any(out["nan"][-1]):
            for a, b in zip(*results):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
                out["max_err"] = max(out["max_err"], float((a - b).abs().max()))
    out["breaks"] = sum(counters["graph_break"].values())
    out["frames"] = counters["stats"]["unique_graphs"]
    out["received"] = [len(m.dispatcher.received) for shard in shards for m in shard.moe_layers()]
    return out


@pytest.mark.timeout(300)
def test_static_ep_block_compiles_whole_and_matches_eager():
    """EP2 on gloo, static dispatch: each block (attention, router, both functional all-to-alls, grouped experts,
    combine) is one graph forward and backward, 0 breaks (fullgraph=True would raise on one; dynamo's counter says
    0); outputs and every gradient equal the eager shard's, an overflow still turns the step NaN (the verdict's
    replay), a new buffer size is a graph of its own, and each forward records its routing once."""
    results = run_ranks(_whole_block_rank, 2, timeout=280, pg_timeout=120)
    for r in results:
        assert r["breaks"] == 0, r
        assert r["nan"] == [[False, False]] * 2 + [[True, True]], r  # eager and compiled alike
        assert r["received"] == [3] * 4, r  # 2 layers x (eager, compiled): one record per forward, as eagerly
        assert r["frames"] == 2, r  # a graph per buffer size (both blocks share it), never a break's second frame


@pytest.mark.slow  # inductor compiles the whole blocks of every rank
@pytest.mark.timeout(900)
def test_whole_blocks_dp2_ep2_and_pp2_ep2_static(corpus_dir, tmp_path, reference_2):
    """The trainer with train.compile and static dispatch (each block compiled whole: parallel/compile.py whole_blocks)
    trains what one uncompiled process trains, DP2·EP2 at zero 1 and PP2·EP2 under 1F1B, a capacity of 1 forcing
    overflows (each replayed at the worst case: a second graph per block)."""
    static = ("--parallel.ep_dispatch", "static", "--parallel.ep_capacity", "1", "--model.experts_impl", "grouped")
    cases = [(2, 1, 2, "1f1b", (*COMPILE, *static, "--parallel.zero", "1")), (1, 2, 2, "1f1b", (*COMPILE, *static))]
    results = run_ranks(_run, 4, args=(cases, str(corpus_dir), str(tmp_path)), timeout=900, pg_timeout=600)
    for i, case in enumerate(cases):
        ranks = [results[r][i] for r in range(4)]
        check_case(f"whole blocks {case}", ranks, reference_2)
        assert ranks[0]["records"][0]["compile_s"] > 0, f"{case}: nothing was compiled"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="train.cuda_graphs records CUDA graphs: a GPU check")
def test_cuda_graphs_train_what_eager_trains(corpus_dir, tmp_path_factory):
    """One process on CUDA, 8 microbatches a step: every compiled block's forward and backward replayed as CUDA graphs
    (no graph skipped by inductor) trains what the eager run on the same GPU trains, to the house's bar."""
    from torch._dynamo.utils import counters

    cuda = (*TWO, "--train.device", "cuda", "--train.ckpt_at_end", "false")
    eager = one_process(corpus_dir, tmp_path_factory, "cuda_eager", extra=cuda)
    counters.clear()
    graphs = one_process(corpus_dir, tmp_path_factory, "cuda_graphs",
                         extra=(*cuda, "--train.compile", "true", "--train.cuda_graphs", "true"))
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    check_case("cuda graphs (1, 1, 1)", [graphs], eager)
