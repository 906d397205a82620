"""Static EP dispatch (parallel.ep_dispatch static, docs/ep.md "A step that never waits on the host"): every layout
trains what one process trains (fp32: losses per step to relative 1e-5, parameters), with a capacity small enough that
buffers overflow (a skewed router: no aux loss, a high learning rate), so the replay is exercised in every row; and
the step reads the host once (host_syncs: the finiteness verdict), twice on a replayed step (each try's verdict).
One launch of 4 ranks runs every 4-rank row; one of 2 the EP2 row; one of 8 the two 8-rank layouts."""

import pytest
import torch

from tests.helpers.equivalence import base_args, layout_args, tp_layout
from tests.helpers.mp import run_ranks

STEPS, LR = 4, 1e-2
SKEWED = ("--model.num_experts", "8", "--model.aux_coef", "0", "--train.lr", str(LR), "--train.steps", str(STEPS),
          "--model.n_layers", "2", "--model.experts_impl", "grouped", "--run.peak_every", "1",
          "--train.ckpt_at_end", "false",
          "--train.eval_every", str(STEPS), "--train.eval_batches", "1")  # an eval's buffers hold all: no overflow
STATIC = ("--parallel.ep_dispatch", "static", "--parallel.ep_capacity", "1")  # overflows: the replay's rows
# DeepSeek-V3's shapes in small (test_equivalence_placement.py's): MLA, sigmoid group-limited routing, a dense first
# layer, a shared expert, MTP, and capacity (dropped assignments never enter a buffer)
DEEPSEEK = ("--model.n_layers", "3", "--model.kv_lora_rank", "16", "--model.q_lora_rank", "12",
            "--model.qk_nope_head_dim", "8", "--model.qk_rope_head_dim", "4", "--model.v_head_dim", "6",
            "--model.router_score", "sigmoid", "--model.n_group", "2", "--model.topk_group", "1",
            "--model.aux_scope", "sequence", "--model.first_k_dense", "1", "--model.shared_experts", "1",
            "--model.mtp_layers", "1")  # dropless: every assignment reaches the dispatch, so the skew overflows it
BALANCED = ("--parallel.expert_placement", "balanced", "--parallel.rebalance_every", "1",  # slots move every step
            "--parallel.expert_replicas", "2")  # hot experts get a second copy: their tokens cut over both


def train_static(args: list[str]) -> dict:
    """The trainer's losses, host_syncs and cumulative ep_replays per step (rank 0's), this rank's whole params with
    their TP dims, each expert tensor's slot -> expert table."""
    from nanotitan.config.config import load_config
    from nanotitan.model.transformer import is_expert_param
    from nanotitan.parallel.tp import tp_shard_dim
    from nanotitan.parallel.where import global_experts
    from nanotitan.train import Trainer
    from tests.helpers.whole_state import whole_state

    trainer = Trainer(load_config(None, args))
    try:
        records = trainer.train()["history"]
        full, _ = whole_state(trainer.shard.sync)
        live = dict(trainer.shard.model.named_parameters())
        slots = {n: list(global_experts(trainer.shard.model, n)) for n in live if is_expert_param(n)}
        params = {n: (t.detach().clone(), tp_shard_dim(live[n])) for n, t in full.items()}
    finally:
        trainer.shard.close()
    return {"losses": [r["loss"] for r in records], "syncs": [r.get("host_syncs") for r in records],
            "val": next((r["val_loss"] for r in records if "val_loss" in r), None),
            "replays": [r.get("ep_replays") for r in records], "params": params, "slots": slots,
            "tp": (trainer.dims.tp_rank, trainer.dims.tp)}


def _run_cases(rank, world, cases, corpus_dir, run_root):
    return [train_static(base_args(corpus_dir, f"{run_root}/{world}_{i}") + list(case))
            for i, case in enumerate(cases)]


def reference(corpus_dir, tmp_path_factory, name: str, extra=()) -> dict:
    torch.set_num_threads(1)
    return train_static(base_args(corpus_dir, tmp_path_factory.mktemp(name)) + list(SKEWED) + list(extra)
                        + layout_args(1, 1, 1))


def check_static(name: str, ranks: list[dict], ref: dict, overflow: bool = True) -> str:
    """Losses and params against `ref`; host_syncs 1 a step, 2 on a replayed one; with `overflow`, some replay."""
    r0 = ranks[0]
    assert len(r0["losses"]) == STEPS, f"{name}: rank 0 logged {r0['losses']}"
    worst = max(abs(a - b) / abs(b) for a, b in zip(r0["losses"], ref["losses"]))
    assert worst <= 1e-5, f"{name}: losses {r0['losses']} vs reference {ref['losses']}"
    assert abs(r0["val"] - ref["val"]) <= 1e-5 * ref["val"], f"{name}: val loss {r0['val']} vs {ref['val']}"
    worst_p = 0.0
    for r in ranks:
        t_rank, n = r["tp"]
        for pname, (t, dim) in r["params"].items():
            want = ref["params"][pname][0]
            if pname in r["slots"]:  # each slot against the expert it holds (a spare one may be empty: -1)
                held = [(s, e) for s, e in enumerate(r["slots"][pname]) if e >= 0]
                t, want = t[[s for s, _ in held]], want[[e for _, e in held]]
            if dim is not None:
                want = want.chunk(n, dim=dim)[t_rank]
            worst_p = max(worst_p, (t - want).abs().max().item())
            torch.testing.assert_close(t, want, rtol=1e-4, atol=1e-3 * LR * STEPS, msg=lambda m: f"{name}: {pname} {m}")
    replayed = [b - a for a, b in zip([0] + r0["replays"], r0["replays"])]
    assert r0["syncs"] == [1 + x for x in replayed], f"{name}: host_syncs {r0['syncs']}, replays {r0['replays']}"
    assert not overflow or r0["replays"][-1] > 0, f"{name}: no step overflowed at capacity 1"
    line = (f"{name}: worst loss rel {worst:.1e}, worst param diff {worst_p:.1e}, host_syncs {r0['syncs']}, "
            f"replayed steps {r0['replays'][-1]}/{STEPS}")
    print(line)
    return line


def test_static_world4(corpus_dir, tmp_path_factory, tmp_path):
    """EP4, DP2·EP2 at zero 1, PP2·EP2 under zb1 with the EP lanes, TP2·EP2, CP2·EP2 (the experts over EP x CP),
    DeepSeek-V3-shaped EP4 and CP2·EP2 (MTP's tail on one CP rank) and a balanced placement with replicas on EP4, each overflowing at capacity 1; then EP2."""
    ref = reference(corpus_dir, tmp_path_factory, "static_ref")
    ref_ds = reference(corpus_dir, tmp_path_factory, "static_ref_ds", DEEPSEEK)
    cases = {
        "EP4": (*SKEWED, *STATIC, *layout_args(1, 1, 4)),
        "DP2·EP2 zero 1": (*SKEWED, *STATIC, *layout_args(2, 1, 2, extra=("--parallel.zero", "1"))),
        "PP2·EP2 zb1 lanes": (*SKEWED, *STATIC, *layout_args(1, 2, 2, "zb1",
                                                            ("--parallel.ep_overlap_microbatches", "true"))),
        "TP2·EP2": (*SKEWED, *STATIC, *tp_layout(1, 1, 2, 2)),
        "CP2·EP2": (*SKEWED, *STATIC, *layout_args(1, 1, 2), "--parallel.cp", "2"),
        "DeepSeek-V3 EP4": (*SKEWED, *DEEPSEEK, *STATIC, *layout_args(1, 1, 4)),
        # MTP's tail leaves the last CP chunk fewer positions to route: the buffers are sized by positions
        "DeepSeek-V3 CP2·EP2": (*SKEWED, *DEEPSEEK, *STATIC, *layout_args(1, 1, 2), "--parallel.cp", "2"),
        "balanced EP4 with replicas": (*SKEWED, *BALANCED, *STATIC, *layout_args(1, 1, 4)),
    }
    outs = run_ranks(_run_cases, 4, args=(list(cases.values()), corpus_dir, tmp_path), timeout=900)
    for i, name in enumerate(cases):
        check_static(name, [o[i] for o in outs], ref_ds if "DeepSeek" in name else ref)
    outs = run_ranks(_run_cases, 2, args=([(*SKEWED, *STATIC, *layout_args(1, 1, 2))], corpus_dir, tmp_path / "2"),
                     timeout=600)
    check_static("EP2", [o[0] for o in outs], ref)


@pytest.mark.slow
def test_static_reads_the_host_once_a_step_on_8_ranks(corpus_dir, tmp_path_factory, tmp_path):
    """DP2·PP2·EP2 and TP2·CP2·EP2 (the experts over 8 ranks) with buffers no routing overflows (capacity = the EP
    ranks): host_syncs 1 every step, the finiteness verdict, and the one process's training."""
    ref = reference(corpus_dir, tmp_path_factory, "static_ref8")
    roomy = ("--parallel.ep_dispatch", "static", "--parallel.ep_capacity", "8")
    cases = {
        "DP2·PP2·EP2": (*SKEWED, *roomy, *layout_args(2, 2, 2)),
        "TP2·CP2·EP2": (*SKEWED, *roomy, *tp_layout(1, 1, 2, 2), "--parallel.cp", "2"),
    }
    outs = run_ranks(_run_cases, 8, args=(list(cases.values()), corpus_dir, tmp_path), timeout=900)
    for i, name in enumerate(cases):
        check_static(name, [o[i] for o in outs], ref, overflow=False)
        assert outs[0][i]["syncs"] == [1] * STEPS
