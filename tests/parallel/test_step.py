"""parallel/step.py's StepEnd: what follows every update, from the step's routing counts, and every small collective a
step issues for its figures. On DP2·EP2 with everything that reduces a figure at once (the router bias, a balanced
placement whose window closes every step, QK-clip, capacity, a metered step peak, the stop flag): a record's step
issues at most four small all-reduces, all from parallel/step.py (report.py formats, qk_clip.py and rebalance.py's
window reduce nothing of their own), and the record's fields are the ones metrics.jsonl always had."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from tests.helpers.equivalence import base_args, layout_args
from tests.helpers.mp import run_ranks

ARGS = ("--train.steps", "4", "--run.log_every", "3", "--run.peak_every", "1", "--model.num_experts", "8",
        "--model.bias_update_rate", "1e-3", "--model.capacity_factor", "1.0", "--train.qk_clip", "5",
        "--parallel.expert_placement", "balanced", "--parallel.rebalance_every", "1", "--parallel.expert_replicas", "2",
        "--train.ckpt_on_signal", "true", "--train.ckpt_at_end", "false")
# metrics.jsonl's fields for this run (the same before the step reduced the figures itself, and after)
RECORD_KEYS = {
    "step", "loss", "ce_loss", "aux_loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s", "mfu", "peak_mem_bytes",
    "dp", "pp", "ep", "tp", "cp", "microbatches", "schedule", "tokens", "cpu_step_s", "expert_load", "expert_load_min",
    "expert_load_max", "expert_imbalance", "expert_max_mean", "balance_loss", "z_loss", "dropped_frac", "router_bias",
    "expert_cv", "ep_recv_max_mean", "ep_placed_max_mean", "skipped", "skipped_steps", "qk_max", "act_peak_bytes",
    "peak_tensor_bytes", "host_syncs", *(f"comm_{a}_{k}" for a in ("dp", "ep", "pp", "tp", "cp", "other")
                           for k in ("calls", "bytes", "wait_s"))}
# what issues a small collective outside the figures: the clip's norm and a placement move's gathers (rebalance.py)
MECHANICS = ("parallel/clip.py", "parallel/rebalance.py")


def _count_small_collectives(rank, world, args):
    """Train with every small all-reduce (axis "other") recorded per step: (step, file of its caller)."""
    from nanotitan.config.config import load_config
    from nanotitan.parallel.comm import collectives as comm
    from nanotitan.train import Trainer

    calls, at = [], [None]
    plain = comm.all_reduce

    def spy(t, group=None, axis="dp", **kw):
        if axis == "other" and at[0] is not None:
            caller = inspect.stack()[1].filename
            calls.append((at[0], caller[caller.index("nanotitan/") + len("nanotitan/"):]))
        return plain(t, group=group, axis=axis, **kw)

    comm.all_reduce = spy
    trainer = Trainer(load_config(None, args))
    step = trainer.train_step

    def counted(s):
        at[0] = s
        try:
            return step(s)
        finally:
            at[0] = None

    trainer.train_step = counted
    try:
        trainer.train()
    finally:
        trainer.shard.close()
        comm.all_reduce = plain
    return calls


def test_a_record_step_reduces_its_figures_in_at_most_four_small_collectives(corpus_dir, tmp_path):
    outs = run_ranks(_count_small_collectives, 4, (base_args(corpus_dir, tmp_path) + list(ARGS)
                                                   + layout_args(2, 1, 2),), timeout=240)
    records = [json.loads(line) for line in Path(tmp_path, "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 3, 4]
    for r in records:
        assert set(r) == RECORD_KEYS, (sorted(set(r) - RECORD_KEYS), sorted(RECORD_KEYS - set(r)))
        assert r["ep_recv_max_mean"] >= 1 and r["ep_placed_max_mean"] >= 1 and r["qk_max"] > 0
    for rank, calls in enumerate(outs):
        figures = [(s, f) for s, f in calls if f not in MECHANICS]
        assert {f for _, f in figures} == {"parallel/step.py"}, (rank, figures)
        per_step = [sum(1 for s, _ in figures if s == step) for step in range(4)]
        # a record's step: the stop flag, the losses' SUM, the packed SUM (biases, window, figures) and the packed
        # MAX (QK-clip's table, the biases after their update, the peak); step 2 writes no record: no losses' SUM
        assert per_step == [4, 3, 4, 4], (rank, per_step, calls)


def test_sft_loss_is_the_global_batchs_target_sum_over_their_count(tmp_path):
    """data.format=sft: the first step's loss is the sum of CE over every unmasked target of the global batch over
    their count (not a mean of microbatch means), read off the model the step starts from; microbatches of 1 make the
    counts uneven. A global batch without a target is refused in one line (parallel/step.py `target_weights`)."""
    import pytest
    import torch

    from nanotitan.config.config import ConfigError, load_config
    from nanotitan.model.docs import doc_starts
    from nanotitan.model.tokens import IGNORE, MASKED, cross_entropy, loss_targets
    from nanotitan.model.transformer import Transformer
    from nanotitan.parallel.dims import ParallelDims
    from nanotitan.parallel.step import target_weights
    from nanotitan.train import Trainer
    from tests.helpers.data import write_sft

    src = write_sft(tmp_path / "sft.jsonl", n=80)
    args = base_args(tmp_path, tmp_path / "run") + layout_args(1, 1, 1) + [
        "--data.source", str(src), "--data.format", "sft", "--model.attn_mask", "doc", "--train.steps", "1",
        "--train.micro_batch", "1", "--parallel.microbatches", "16", "--train.grad_clip", "0"]
    trainer = Trainer(load_config(None, args))
    try:
        x, y = trainer.data.train.global_batch(0, 16)
        cfg = trainer.cfg
        model = Transformer(cfg.model, seed=cfg.train.seed).eval()
        with torch.no_grad():
            logits, _ = model(x, docs=doc_starts(x, trainer.data.eot))
        y = loss_targets(y)  # the prompts' targets: token + MASKED, read by no loss
        counts = (y != IGNORE).sum(1)
        assert counts.min() < counts.max()  # uneven: a mean of the 16 means would differ
        want = (cross_entropy(logits, y) * counts.sum()).item() / counts.sum().item()
        mean_of_means = torch.stack([cross_entropy(logits[i], y[i]) for i in range(16)]).mean().item()
        got = trainer.train()["history"][0]["ce_loss"]
    finally:
        trainer.shard.close()
    assert abs(got - want) <= 1e-5 * want and abs(mean_of_means - want) > 1e-4 * want
    with pytest.raises(ConfigError, match="no target token") as err:
        target_weights(ParallelDims(1, 1, 1), [torch.full((1, 4), 7 + MASKED)] * 2)
    assert "\n" not in str(err.value)
