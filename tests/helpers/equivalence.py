"""The equivalence matrix's runs and bar (DESIGN §4): the base arguments every row trains with, a layout's
arguments, the single-process reference, check_case's per-step loss and parameter checks, and the bf16 bound."""

import math

import torch

from tests.helpers.mp import train_once

B, m, STEPS, LR = 16, 2, 10, 3e-3


def base_args(corpus_dir, run_dir) -> list[str]:
    return ["--data.source", str(corpus_dir), "--data.vocab_size", "300",
            "--model.d_model", "32", "--model.n_heads", "4", "--model.ffn_dim", "48", "--model.n_layers", "4",
            "--model.num_experts", "4", "--model.top_k", "2", "--model.aux_coef", "0.05",
            "--train.steps", str(STEPS), "--train.lr", str(LR), "--train.warmup_steps", "2", "--train.seq_len", "16",
            "--train.micro_batch", str(m), "--train.grad_clip", "0.5", "--train.eval_every", "0",
            "--train.sample_tokens", "0", "--train.threads", "1",
            "--run.dir", str(run_dir), "--run.log_every", "1", "--run.progress", "false",
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


S, D = 16, 32  # base_args' seq_len, d_model (m: its micro_batch)

U_BF16 = 2.0**-8

EVAL = ["--train.eval_every", "10", "--train.eval_batches", "1", "--train.ckpt_at_end", "false"]


def bf16_bound(tokens: int = B * S) -> float:
    """Relative loss tolerance of a bf16 layout against the single-process bf16 run: u / sqrt(T)."""
    return U_BF16 / math.sqrt(tokens)


def max_rel_dev(losses: list[float], ref: list[float]) -> float:
    assert len(losses) == len(ref) and ref, f"{len(losses)} losses vs {len(ref)} reference steps"
    return max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
