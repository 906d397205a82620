"""The planner reads the runtime's memory rules instead of restating them (issue 38 item 3): each rule has one public
home in parallel/, the runtime follows it, and so does `predict`, so changing the rule where the runtime keeps it
moves the prediction with no second edit. Restating a rule as it is gives the same prediction bit for bit."""

import dataclasses

import pytest
import torch

from nanotitan.parallel.dp import reducer as dp_rules, fsdp, zero as zero_rules
from nanotitan.plan import Layout, layout_config, predict
from tests.helpers.mp import run_ranks
from tests.helpers.plan import CPU, tiny


def _numbers(cfg, lay) -> tuple:
    """Everything a prediction says, as exact floats."""
    p = predict(cfg, lay, CPU)
    return (p.step_time_s, p.tokens_per_sec, p.mem_by_stage, p.mem_limit, p.fits, dataclasses.asdict(p)["costs"],
            p.mem_parts_by_stage, p.ckpt_by_stage)


def _zero2_shard():
    lay = Layout(2, 1, 1, "1f1b", 2, 8, 2)  # M = 2: a backward starts with the previous one's buckets in flight
    cfg = layout_config(tiny(n_layers=4, dp=2, M=2, m=8), lay)
    cfg.parallel.bucket_mb, cfg.parallel.zero_accumulate = 0.05, "shard"
    return cfg, lay


def _zero3_always():
    lay = Layout(2, 1, 1, "1f1b", 2, 8, 3)  # no PP: zero3_reshard auto is "always" (sync.zero_memory_choices)
    return layout_config(tiny(n_layers=4, dp=2, M=2, m=8), lay), lay


def test_restating_a_rule_as_it_is_keeps_the_prediction_bit_for_bit(monkeypatch):
    """Each rule replaced by a copy of itself (the same answers through a new function): the same numbers."""
    cases = [_zero2_shard(), _zero3_always()]
    before = [_numbers(cfg, lay) for cfg, lay in cases]
    monkeypatch.setattr(zero_rules, "IN_FLIGHT_BUCKETS", 1)
    monkeypatch.setattr(dp_rules, "bucket_bytes", lambda mb: mb * 2**20)
    monkeypatch.setattr(fsdp, "kept_gathered", lambda n, pp: [n - 1] if pp == 1 and n > 0 else [])
    monkeypatch.setattr(fsdp, "experts_in_block_unit", lambda dp, ep: dp > 1 and ep == 1)
    monkeypatch.setattr(fsdp, "shards_experts", lambda dp: dp > 1)
    assert [_numbers(cfg, lay) for cfg, lay in cases] == before


def test_zero2_in_flight_buckets_moves_the_prediction(monkeypatch):
    """zero 2 "shard" keeps `zero.IN_FLIGHT_BUCKETS` reduce-scatters in flight; a microbatch's backward starts with
    the previous one's (M > 1), each with its exchange scratch on gloo ((N-1)/N of a bucket): the planner's
    gradient-bucket bytes are that many buckets, whatever the count is set to."""
    cfg, lay = _zero2_shard()
    bucket = dp_rules.bucket_bytes(cfg.parallel.bucket_mb)
    for n in (1, 2, 3):
        monkeypatch.setattr(zero_rules, "IN_FLIGHT_BUCKETS", n)
        p = predict(cfg, lay, CPU)
        assert p.mem_parts["grad_buckets"] == pytest.approx(n * bucket * (1 + 1 / 2), rel=1e-12), n
        assert p.step_time_s == predict(cfg, lay, CPU).step_time_s  # memory only


def test_bucket_size_rule_moves_the_prediction(monkeypatch):
    """`dp.bucket_bytes` sizes the Reducer's and ZeRO's buckets and the planner's: doubling it doubles the zero 2
    "shard" carry."""
    cfg, lay = _zero2_shard()
    base = predict(cfg, lay, CPU).mem_parts["grad_buckets"]
    rule = dp_rules.bucket_bytes
    monkeypatch.setattr(dp_rules, "bucket_bytes", lambda mb: 2 * rule(mb))
    assert predict(cfg, lay, CPU).mem_parts["grad_buckets"] == pytest.approx(2 * base, rel=1e-12)


def test_zero3_kept_gathered_moves_the_prediction(monkeypatch):
    """Without PP zero 3 "always" keeps the last block gathered from its forward to its backward (M all-gathers of
    it, not 2M: `fsdp.kept_gathered`). A runtime that keeps none gathers more: the predicted DP time grows, and
    nothing else about the step's compute moves."""
    cfg, lay = _zero3_always()
    base = predict(cfg, lay, CPU)
    monkeypatch.setattr(fsdp, "kept_gathered", lambda n, pp: [])
    after = predict(cfg, lay, CPU)
    assert after.costs["dp_allreduce"] > base.costs["dp_allreduce"]
    assert after.step_time_s > base.step_time_s
    assert after.costs["compute"] == base.costs["compute"]
    # keeping every block gathered: fewer all-gathers than the default, and the head's moment holds a block more
    monkeypatch.setattr(fsdp, "kept_gathered", lambda n, pp: list(range(n)))
    every = predict(cfg, lay, CPU)
    assert every.costs["dp_allreduce"] < base.costs["dp_allreduce"]


def _runtime_follows_the_rules(rank, world):
    """In each rank: zero 2 "shard" under IN_FLIGHT_BUCKETS = 1 and 2 (the most reduce-scatters in flight, and the
    params after one step), and zero 3 "always" under the default kept_gathered and under none kept (which blocks
    stay gathered after a forward outside backward)."""
    from torch.distributed.tensor import DTensor

    from nanotitan.config.config import Config
    from tests.helpers.specs import build_shard_spec
    from nanotitan.model.transformer import Transformer, is_expert_param
    from nanotitan.parallel.dims import ParallelDims
    from nanotitan.parallel.ep import apply_ep
    from nanotitan.parallel.dp.zero import ShardedReducer
    from tests.helpers.dp import _build, _loss

    out = {"in_flight": {}, "grads": {}, "gathered": {}}
    for n in (1, 2):
        zero_rules.IN_FLIGHT_BUCKETS = n
        model = _build("transformer")
        rb = ShardedReducer(list(model.named_parameters()), torch.distributed.group.WORLD, 0.002, 0.5, 2)
        most = []
        for q in model.parameters():
            q.register_post_accumulate_grad_hook(lambda q: most.append(len(rb._in_flight)))
        for mb in range(2):
            rb.prepare(sync=mb == 1)
            _loss(model, "transformer", rank, 0, mb, 2).backward()
        rb.finish()
        out["in_flight"][n] = max(most)
        out["grads"][n] = [b.shard_grad.clone() for b in rb.buckets]
    zero_rules.IN_FLIGHT_BUCKETS = 1

    cfg = Config()
    cfg.model.vocab_size, cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads = 64, 16, 3, 2
    cfg.model.ffn_dim, cfg.model.num_experts, cfg.parallel.dp = 32, 4, 2
    dims = ParallelDims(2, 1, 1, rank=rank).build_groups()
    rule = fsdp.kept_gathered
    for name, kept in (("default", rule), ("none", lambda n, pp: [])):
        fsdp.kept_gathered = kept
        model = apply_ep(Transformer(cfg.model, build_shard_spec(cfg, 0, 0), seed=0), dims)
        named = list(model.named_parameters())
        fsdp.FSDPSync(model, dims, [(n, p) for n, p in named if is_expert_param(n)],
                      [(n, p) for n, p in named if not is_expert_param(n)], 0.002, 0.5, "shard", "always")
        with torch.no_grad():
            model(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)))
        out["gathered"][name] = [i for i, blk in enumerate(model.layers.values())
                                 if not isinstance(next(blk.parameters()), DTensor)]
    fsdp.kept_gathered = rule
    return out


def test_the_runtime_follows_the_same_rules():
    """The other half: the runtime reads the very names the planner reads. zero 2 "shard" never holds more than
    `IN_FLIGHT_BUCKETS` reduce-scatters in flight and reaches it (the same gradients either way: they land in launch
    order); zero 3 "always" leaves gathered after a forward exactly the blocks `kept_gathered` names."""
    for r in run_ranks(_runtime_follows_the_rules, 2, timeout=240):
        assert r["in_flight"] == {1: 1, 2: 2}, r["in_flight"]
        assert all(torch.equal(a, b) for a, b in zip(r["grads"][1], r["grads"][2]))
        assert r["gathered"] == {"default": [2], "none": []}, r["gathered"]
