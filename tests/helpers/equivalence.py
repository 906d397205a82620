"""The equivalence matrix's runs and bar (DESIGN §4): the base arguments every row trains with, a layout's
arguments, the single-process reference, check_case's per-step loss and parameter checks, and the bf16 bound."""

import math

import torch

from tests.helpers.mp import train_once

B, m, STEPS, LR = 16, 2, 10, 3e-3


def base_args(corpus_dir, run_dir) -> list[str]:
    """A tiny model, 10 steps, a record each. No memory meters (run.peak_every 0): a metered step costs ~10x a plain
    one here, and these runs compare numbers; a test of the meters' figures passes `--run.peak_every 1` after these."""
    return ["--data.source", str(corpus_dir), "--data.vocab_size", "300",
            "--model.d_model", "32", "--model.n_heads", "4", "--model.ffn_dim", "48", "--model.n_layers", "4",
            "--model.num_experts", "4", "--model.top_k", "2", "--model.aux_coef", "0.05",
            "--train.steps", str(STEPS), "--train.lr", str(LR), "--train.warmup_steps", "2", "--train.seq_len", "16",
            "--train.micro_batch", str(m), "--train.grad_clip", "0.5", "--train.eval_every", "0",
            "--train.sample_tokens", "0", "--train.threads", "1",
            "--run.dir", str(run_dir), "--run.log_every", "1", "--run.peak_every", "0", "--run.progress", "false",
            "--run.tensorboard", "false"]


def layout_args(dp, pp, ep, schedule="1f1b", extra=()) -> list[str]:
    M = B // (dp * ep * m)
    return ["--parallel.dp", str(dp), "--parallel.pp", str(pp), "--parallel.ep", str(ep),
            "--parallel.microbatches", str(M), "--parallel.schedule", schedule, *extra]


def _run_cases(rank, world, cases, corpus_dir, run_root):
    return [train_once(base_args(corpus_dir, f"{run_root}/{world}_{i}") + layout_args(*case))
            for i, case in enumerate(cases)]


def one_process(corpus_dir, tmp_path_factory, name: str, extra=()) -> dict:
    """The single-process run (layout 1,1,1) of base_args + `extra`: the reference a matrix's rows are held to."""
    torch.set_num_threads(1)
    return train_once(base_args(corpus_dir, tmp_path_factory.mktemp(name)) + layout_args(1, 1, 1, "1f1b", extra))


def check_case(name, ranks: list[dict], ref: dict):
    for r in ranks:
        d, p, e = r["coords"]
        losses = r["losses"]
        if losses:  # only rank 0 keeps the history
            assert len(losses) == STEPS
            for step, (a, b) in enumerate(zip(losses, ref["losses"])):
                assert abs(a - b) <= 1e-5 * abs(b), f"{name}: step {step + 1} loss {a} vs reference {b}"
        for pname, (t, expert_start) in r["params"].items():
            want = ref["params"][pname][0]
            if expert_start is not None:
                want = want[expert_start:expert_start + t.shape[0]]
            # AdamW normalises each coordinate's update, so a coordinate whose gradient is ~0 turns float
            # reassociation into up to ~lr-sized moves: atol is 1e-3 of the largest possible movement (lr*steps).
            torch.testing.assert_close(t, want, rtol=1e-4, atol=1e-3 * LR * STEPS,
                                       msg=lambda s: f"{name}: {pname} {s}")
    # replicas of the same shard are bitwise identical
    by_shard = {}
    for r in ranks:
        d, p, e = r["coords"]
        for pname, (t, expert_start) in r["params"].items():
            key = (pname, p, e if expert_start is not None else None)
            if key in by_shard:
                assert torch.equal(by_shard[key], t), f"{name}: replicas of {pname} differ"
            else:
                by_shard[key] = t
    assert ranks[0]["losses"], f"{name}: rank 0 logged nothing"


def tp_layout(dp=1, pp=1, ep=1, tp=2, extra=(), micro_batch=m) -> list[str]:
    """The main matrix's layout flags (B sequences a step in microbatches of `micro_batch`) with TP."""
    return ["--parallel.dp", str(dp), "--parallel.pp", str(pp), "--parallel.ep", str(ep), "--parallel.tp", str(tp),
            "--parallel.microbatches", str(B // (dp * ep * micro_batch)), *extra]


# Shorter than the main matrix (4 steps, microbatches of 4: 4 per step in one process), so the ~20 TP rows and the CP
# rows fit the suite's time; every TP (CP) collective still runs forward and backward in each microbatch of each step.
SHORT_STEPS, SHORT_M = 4, 4
SHORT = ("--train.steps", str(SHORT_STEPS), "--train.micro_batch", str(SHORT_M), "--train.ckpt_at_end", "false")
SHORT_REF = (*SHORT, "--parallel.microbatches", str(B // SHORT_M))  # the one-process reference: the same B a step


def short_layout(dp=1, pp=1, ep=1, tp=2, extra=()) -> list[str]:
    """A short matrix's row (TP's, CP's: CP rides in `extra`)."""
    return tp_layout(dp, pp, ep, tp, (*SHORT, *extra), micro_batch=SHORT_M)


# A second model exercising what the plain one does not: GQA (2 KV heads: split over TP2, replicated over TP4),
# per-head q/k norms, a gated shared expert, the router bias (buffer updated from the TP-summed counts).
OPTIONS = ("--model.n_kv_heads", "2", "--model.qk_norm", "head", "--model.shared_experts", "1",
           "--model.shared_ffn_dim", "16", "--model.shared_expert_gate", "true", "--model.bias_update_rate", "1e-3")
# DeepSeek-V3's shapes in small: MLA with a q latent, sigmoid group-limited routing with the sequence-wise balance
# loss, a dense first layer, a shared expert, one MTP module (model/mtp.py: its MoE block leaves out the padded last
# position; 3 layers + the MTP block cost what the others' 4 layers do); with capacity, so the ranking across TP
# ranks meets that tail too.
DEEPSEEK = ("--model.n_layers", "3", "--model.kv_lora_rank", "16", "--model.q_lora_rank", "12", "--model.qk_nope_head_dim", "8",
            "--model.qk_rope_head_dim", "4", "--model.v_head_dim", "6", "--model.router_score", "sigmoid",
            "--model.n_group", "2", "--model.topk_group", "1", "--model.aux_scope", "sequence",
            "--model.first_k_dense", "1", "--model.shared_experts", "1", "--model.mtp_layers", "1",
            "--model.capacity_factor", "1.0")
# Capacity (model/moe.py): 1.0 on the plain model drops assignments in every step (asserted: `tp_matrix`)
CAP = ("--model.capacity_factor", "1.0")

def short_refs(corpus_dir, tmp_path_factory, models: dict, prefix: str):
    """get(name): the one-process reference of a short matrix's model `models[name]`, run once, when first asked."""
    done = {}

    def get(name: str) -> dict:
        if name not in done:
            done[name] = one_process(corpus_dir, tmp_path_factory, f"ref_{prefix}_{name}", (*SHORT_REF, *models[name]))
        return done[name]
    return get


S, D = 16, 32  # base_args' seq_len, d_model (m: its micro_batch)

U_BF16 = 2.0**-8

EVAL = ["--train.eval_every", "10", "--train.eval_batches", "1", "--train.ckpt_at_end", "false"]
BF16 = ("--train.dtype", "bf16", *EVAL, "--train.eval_every", str(SHORT_STEPS))  # a short matrix's bf16 rows


def bf16_bound(tokens: int = B * S) -> float:
    """Relative loss tolerance of a bf16 layout against the single-process bf16 run: u / sqrt(T)."""
    return U_BF16 / math.sqrt(tokens)


def max_rel_dev(losses: list[float], ref: list[float]) -> float:
    assert len(losses) == len(ref) and ref, f"{len(losses)} losses vs {len(ref)} reference steps"
    return max(abs(a - b) / abs(b) for a, b in zip(losses, ref))


def train_tp(args: list[str]) -> dict:
    """train_once's result (helpers/mp.py) plus, per param, the dim its TP slice is cut along and the rank's tp place."""
    from nanotitan.config.config import load_config
    from nanotitan.model.transformer import is_expert_param
    from nanotitan.parallel.tp import tp_shard_dim
    from nanotitan.train import Trainer
    from tests.helpers.whole_state import whole_state

    trainer = Trainer(load_config(None, args))
    try:
        records = trainer.train()["history"]
        full, _ = whole_state(trainer.shard.sync)
        start = trainer.shard.spec.expert_start
        live = dict(trainer.shard.model.named_parameters())
        params = {n: (t.detach().clone(), start if is_expert_param(n) else None, tp_shard_dim(live[n]))
                  for n, t in full.items()}
    finally:
        trainer.shard.close()
    d = trainer.dims
    val = next((r["val_loss"] for r in records if "val_loss" in r), None)  # rank 0's final eval, if any
    return {"losses": [r["loss"] for r in records], "val": val, "params": params, "tp": (d.tp_rank, d.tp),
            "dropped": [r.get("dropped_frac") for r in records]}


def check_tp_case(name, ranks: list[dict], ref: dict, rel: float = 1e-5, steps: int = 4):
    """A row of a short matrix (TP's, CP's): every rank's losses (rank 0's history) within `rel` of the reference, and
    each rank's parameters (its TP slice, its folded experts) the reference's."""
    for r in ranks:
        for step, (a, b) in enumerate(zip(r["losses"], ref["losses"])):
            assert abs(a - b) <= rel * abs(b), f"{name}: step {step + 1} loss {a} vs reference {b}"
        assert not r["losses"] or len(r["losses"]) == steps
        t_rank, n = r["tp"]
        for pname, (t, expert_start, dim) in r["params"].items():
            want = ref["params"][pname][0]
            if expert_start is not None:
                want = want[expert_start:expert_start + t.shape[0]]
            if dim is not None:
                want = want.chunk(n, dim=dim)[t_rank]
            torch.testing.assert_close(t, want, rtol=1e-4, atol=1e-3 * LR * steps,
                                       msg=lambda s: f"{name}: {pname} {s}")
        assert n == 1 or any(dim is not None for _, _, dim in r["params"].values()), f"{name}: nothing TP-split"
    assert ranks[0]["losses"], f"{name}: rank 0 logged nothing"
