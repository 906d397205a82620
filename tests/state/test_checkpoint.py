"""Checkpoints are layout-independent: state saved in any (dp, pp, ep) layout loads into any other and
equals, exactly, the single-process full model carried through the same updates; saves are atomic
(a crash never leaves a checkpoint that looks complete), pruned to keep_last, and a checkpoint that
does not fit the model fails with one line naming the tensor."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from nanotitan.state import checkpoint as ckpt

from nanotitan.state import manifest
from nanotitan.state.metadata import SafeReader
from nanotitan.config.config import Config
from nanotitan.model.spec import ModelShardSpec
from tests.helpers.specs import build_shard_spec
from nanotitan.model.transformer import Transformer, is_expert_param
from nanotitan.parallel.dims import ParallelDims
from tests.helpers.mp import run_ranks
from tests.helpers.checkpoint import SAVE_KS, build, perturb, tiny_cfg


def mismatches(cfg: Config, model: Transformer, opt) -> list[str]:
    """Compare a shard's params and AdamW state with the full model after SAVE_KS, by plain slicing."""
    full, full_opt = build(cfg, ModelShardSpec.full(cfg.model))
    perturb(full, full_opt, SAVE_KS)
    ref = dict(full.named_parameters())
    e0, e1 = model.spec.expert_start, model.spec.expert_end
    bad = []
    for name, p in model.named_parameters():
        rp = ref[name]
        pairs = [("param", p, rp)] + [(k, opt.state[p][k], full_opt.state[rp][k]) for k in ("exp_avg", "exp_avg_sq")]
        for what, got, want in pairs:
            want = want[e0:e1] if is_expert_param(name) else want
            if not torch.equal(got, want):
                bad.append(f"{name} {what}: max diff {(got - want).abs().max().item():.3g}")
        st, rst = opt.state[p]["step"], full_opt.state[rp]["step"]
        if not (torch.equal(st, rst) and st.dtype == rst.dtype and st.device == rst.device):
            bad.append(f"{name} step {st!r} != {rst!r}")
    return bad


# --- rank functions (module level: spawned processes import them) ----------------------------------

def _chain_rank(rank, world, layout, run_dir, load_step, save_step, pre_step):
    """Build this layout's shard; either perturb it (first link) or load step `load_step` (optionally
    into an optimizer that has already stepped, whose state must be overwritten); then save."""
    dims = ParallelDims(*layout[:3], rank).build_groups()
    cfg = tiny_cfg(layout)
    model, opt = build(cfg, build_shard_spec(cfg, dims.pp_rank, dims.ep_rank))
    bad, extra = [], None
    if load_step is None:
        perturb(model, opt, SAVE_KS)
    else:
        if pre_step:
            perturb(model, opt, (99,))
        extra = ckpt.load_checkpoint(manifest.checkpoint_dir(run_dir) / f"step_{load_step}", model, opt, dims)
        bad = mismatches(cfg, model, opt)
    path = None
    if save_step is not None:
        path = str(ckpt.save_checkpoint(run_dir, save_step, model, opt, dims, cfg,
                                        {"samples_consumed": 32 * save_step}, keep_last=0))
    return bad, extra, path


def _crash_rank(rank, world, run_dir):
    """Save step 1, then die on rank 0 after step 2's data is written but before it is committed."""
    layout = (1, 1, 2)
    dims = ParallelDims(*layout, rank).build_groups()
    cfg = tiny_cfg(layout)
    model, opt = build(cfg, build_shard_spec(cfg, dims.pp_rank, dims.ep_rank))
    perturb(model, opt, SAVE_KS)
    torch.manual_seed(1000 + rank)  # the per-rank CPU RNG state that step 1 records
    ckpt.save_checkpoint(run_dir, 1, model, opt, dims, cfg, {"samples_consumed": 32}, keep_last=2)
    if rank == 0:
        ckpt.fsync_dir = lambda p: os._exit(9)  # first call is just before the rename
    ckpt.save_checkpoint(run_dir, 2, model, opt, dims, cfg, {"samples_consumed": 64}, keep_last=2)


def _resume_rank(rank, world, run_dir):
    """Resume from the newest complete checkpoint, then save 2, 3, 4 with keep_last=2."""
    layout = (1, 1, 2)
    dims = ParallelDims(*layout, rank).build_groups()
    cfg = tiny_cfg(layout)
    model, opt = build(cfg, build_shard_spec(cfg, dims.pp_rank, dims.ep_rank))
    extra = ckpt.load_checkpoint(manifest.resolve_resume("auto", run_dir), model, opt, dims)
    rng_ok = torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(1000 + rank)))
    bad = mismatches(cfg, model, opt) + ([] if rng_ok else [f"rank {rank}: CPU RNG not restored in the same layout"])
    for step in (2, 3, 4):
        ckpt.save_checkpoint(run_dir, step, model, opt, dims, cfg, {"samples_consumed": 32 * step}, keep_last=2)
    return bad, extra


def _mismatch_rank(rank, world, path):
    """Load a (4 layers, vocab 512) checkpoint into models that do not fit it; return the errors."""
    layout = (1, 2, 1)
    dims = ParallelDims(*layout, rank).build_groups()
    errors = []
    for model_over in ({"vocab_size": 320}, {"n_layers": 6}, {"n_layers": 3}, {"pos_emb": "learned"}):
        cfg = tiny_cfg(layout, **model_over)
        model, opt = build(cfg, build_shard_spec(cfg, dims.pp_rank, dims.ep_rank))
        try:
            ckpt.load_checkpoint(path, model, opt, dims)
            errors.append("")
        except ckpt.CheckpointError as e:
            errors.append(str(e))
    return errors


# --- tests -------------------------------------------------------------------------------------------

# Each link loads the previous link's checkpoint in a new layout, checks it against the full model and
# saves it again: (2,2,2)->(1,2,2), (1,2,2)->(2,2,1), (2,2,1)->(1,1,1), (1,1,1)->(2,1,2) in 5 launches.
# (Same layout, (1,1,2)->(1,1,2), is test_interrupted_save_keeps_previous_and_prunes' resume.)
# (dp, pp, ep[, layers per stage]): the first two links cut block 2 (then block 1) between attention and MoE,
# so one block's tensors come from two stages' files and go back to two (other) stages, then to whole layers.
CHAIN = [(2, 2, 2, (2.5, 1.5)), (1, 2, 2, (1.5, 2.5)), (2, 2, 1), (1, 1, 1), (2, 1, 2)]


def _world(layout) -> int:
    return layout[0] * layout[1] * layout[2]


def test_reshard_chain_equals_full_model(tmp_path):
    """Saved in one layout, loaded in another: every param and AdamW moment/step equals the full model's."""
    state_bytes = []
    for i, layout in enumerate(CHAIN):
        load_step = i if i > 0 else None
        save_step = i + 1 if i + 1 < len(CHAIN) else None
        results = run_ranks(_chain_rank, _world(layout), (layout, str(tmp_path), load_step, save_step, i == 2),
                            timeout=90)
        for rank, (bad, extra, _) in enumerate(results):
            assert bad == [], f"{CHAIN[i - 1]}->{layout} rank {rank}: {bad[:5]}"
            if load_step is not None:
                assert extra == {"samples_consumed": 32 * load_step, "step": load_step}
        if save_step is None:
            continue
        path = Path(results[0][2])
        assert {r[2] for r in results} == {str(path)} and path.name == f"step_{save_step}"
        assert (path / manifest.COMPLETE).is_file() and (path / "config.toml").is_file()
        # Replicated keys are written once: the shard files hold exactly the bytes the metadata points
        # at (a second copy written by a DP/EP replica would be unreferenced bytes)...
        meta = SafeReader(path).read_metadata()  # the product's reader: every layout's metadata passes its allow-list
        written = sum(f.stat().st_size for f in path.glob("*.distcp"))
        assert written == sum(s.length for s in meta.storage_data.values())
        # ... and the model/optimizer bytes are the same in every layout (8 ranks write what 1 writes).
        state_bytes.append(sum(s.length for i, s in meta.storage_data.items() if not i.fqn.startswith("rng.")))
    assert len(set(state_bytes)) == 1, state_bytes


def test_interrupted_save_keeps_previous_and_prunes(tmp_path):
    """A save killed before its commit leaves the previous checkpoint the newest complete one; the next
    run resumes from it, overwrites the stale tmp dir and keep_last prunes old checkpoints."""
    with pytest.raises(RuntimeError, match="died|failed"):
        run_ranks(_crash_rank, 2, (str(tmp_path),), timeout=60)
    root = manifest.checkpoint_dir(tmp_path)
    assert (root / "step_2.tmp").is_dir() and not (root / "step_2").exists()
    assert manifest.latest_checkpoint(tmp_path) == root / "step_1"
    results = run_ranks(_resume_rank, 2, (str(tmp_path),), timeout=60)
    for bad, extra in results:
        assert bad == [] and extra == {"samples_consumed": 32, "step": 1}
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4"]
    assert manifest.latest_checkpoint(tmp_path) == root / "step_4"
    state = json.loads((root / "step_4" / manifest.STATE_FILE).read_text())
    assert state["step"] == 4 and state["extra"] == {"samples_consumed": 128}


def test_latest_ignores_incomplete(tmp_path):
    """Only directories named step_N with a COMPLETE marker count; the highest N wins. (These empty dirs
    have no manifest, so resolve_resume runs with verification off; tests/state/test_ckpt_verify.py verifies.)"""
    root = manifest.checkpoint_dir(tmp_path)
    assert manifest.latest_checkpoint(tmp_path) is None and manifest.resolve_resume("auto", tmp_path) is None
    for name, complete in (("step_5", True), ("step_12", True), ("step_30", False), ("step_40.tmp", True)):
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / manifest.COMPLETE).write_text("")
    assert manifest.latest_checkpoint(tmp_path) == root / "step_12"
    assert manifest.resolve_resume("", tmp_path) is None
    assert manifest.resolve_resume(str(root / "step_5"), "elsewhere", verify=False) == root / "step_5"
    lines = []
    assert manifest.resolve_resume(str(tmp_path), "elsewhere", verify=False, log=lines.append) == root / "step_12"
    assert lines == [("resume: skipped step_40.tmp: unfinished save; step_30: incomplete (no COMPLETE marker: "
                      "its save did not finish); using step_12")]
    with pytest.raises(ckpt.CheckpointError, match="train.resume"):
        manifest.resolve_resume(str(root / "step_30"), tmp_path)


def test_mismatch_names_the_tensor(tmp_path):
    """A checkpoint that does not fit the config fails on every rank with one line naming the tensor."""
    ((_, _, path),) = run_ranks(_chain_rank, 1, ((1, 1, 1), str(tmp_path), None, 1, False), timeout=60)
    per_rank = run_ranks(_mismatch_rank, 2, (path,), timeout=60)
    (vocab0, more0, fewer0, pos0), (vocab1, more1, fewer1, pos1) = per_rank
    assert "'model.tok_emb.weight' has shape [512, 32] but this model's is [320, 32]" in vocab0
    assert "'model.head.weight' has shape [512, 32]" in vocab1
    assert "no tensor 'model.layers.4." in more1 and "has 4 layers but model.n_layers=6" in more0
    assert fewer0 == fewer1 and "has 4 layers but model.n_layers=3" in fewer0
    # Only stage 0 owns the learned position table; stage 1 fits but must stop too (not hang in load).
    assert "no tensor 'model.pos_emb.weight'" in pos0 and "see rank 0's error" in pos1
    assert all("\n" not in e and e for r in per_rank for e in r)
