"""train.fp8's config rules (config/fp8_rules.py): one line naming the field and the fix, before anything runs."""

import pytest

from nanotitan.config.config import ConfigError, load_config

BASE = ["--model.d_model", "32", "--model.n_heads", "4", "--model.ffn_dim", "48", "--train.fp8", "rowwise"]


def err(*args) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, *args])
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_fp8_accepts_the_default_model_and_its_skips():
    assert load_config(None, BASE).train.fp8_skip == ["tok_emb", "head", "router", "shared_expert_gate", "q_a_proj",
                                                      "kv_a_proj_with_mqa"]
    load_config(None, [*BASE, "--train.fp8", "tensorwise", "--parallel.dp", "2", "--parallel.zero", "3"])


def test_a_dimension_not_a_multiple_of_16_names_the_field_and_the_fixes():
    msg = err("--model.ffn_dim", "40")
    assert msg.startswith("model.ffn_dim gives an FP8 GEMM dimension 40, not a multiple of 16 (experts)")
    assert "--train.fp8_skip" in msg and "--train.fp8 off" in msg
    assert "model.dense_ffn_dim" in err("--model.dense_ffn_dim", "24", "--model.first_k_dense", "1")
    # skipped modules may take any width: the experts kept in high precision
    load_config(None, [*BASE, "--model.ffn_dim", "40", "--train.fp8_skip", "head,router,experts"])
    # MLA: a q latent of 12 feeds q_b_proj, which the default skips do not keep whole
    assert "model.q_lora_rank" in err("--model.kv_lora_rank", "16", "--model.q_lora_rank", "12",
                                      "--model.qk_nope_head_dim", "8", "--model.qk_rope_head_dim", "8",
                                      "--model.v_head_dim", "8")


def test_tp_and_cp_are_accepted_and_their_unscalable_gemms_refused():
    """TP and CP reduce each scale's amax over the ranks holding the tensor (parallel/tp.py `cut_fp8`); refused: a
    TP-split width that is no multiple of 16 per rank, KV projections replicated over TP (their output gradients
    are partial sums), MLA's kv_b_proj expanding each ring step's latent, and ep_overlap."""
    load_config(None, [*BASE, "--parallel.tp", "2", "--parallel.cp", "2", "--model.num_experts", "8",
                       "--parallel.ep", "2"])
    assert err("--parallel.tp", "4").startswith("model.head_dim gives an FP8 GEMM dimension 8 per TP rank (of 32)")
    msg = err("--parallel.tp", "2", "--model.n_kv_heads", "1", "--model.head_dim", "16")
    assert msg.startswith("train.fp8=rowwise with parallel.tp=2 not dividing model.n_kv_heads=1")
    assert "k_proj/v_proj" in msg
    load_config(None, [*BASE, "--parallel.tp", "2", "--model.n_kv_heads", "1", "--model.head_dim", "16",
                       "--train.fp8_skip", "head,k_proj,v_proj"])
    mla = ("--model.kv_lora_rank", "16", "--model.qk_nope_head_dim", "8", "--model.qk_rope_head_dim", "8",
           "--model.v_head_dim", "8")
    assert "kv_b_proj" in err("--parallel.cp", "2", *mla)
    load_config(None, [*BASE, "--parallel.cp", "2", "--parallel.cp_impl", "a2a", *mla])
    assert "parallel.ep_overlap" in err("--parallel.ep", "2", "--parallel.ep_overlap", "true")
    static = ("--parallel.ep", "2", "--parallel.ep_dispatch", "static", "--model.experts_impl", "grouped")
    assert err(*static).startswith("train.fp8=rowwise with parallel.ep_dispatch=static")
    load_config(None, [*BASE, *static, "--train.fp8_skip", "head,router,experts"])


def test_fp8_comm_at_zero3_is_accepted_and_refused_with_compile():
    """zero 3 all-gathers the FP8 weights as a tensor subclass (parallel/dp/fp8_gather.py), which the compiled
    blocks are not tested with."""
    zero3 = ("--parallel.dp", "2", "--parallel.zero", "3", "--parallel.fp8_comm", "true")
    load_config(None, [*BASE, *zero3])
    msg = err(*zero3, "--train.compile", "true")
    assert msg.startswith("parallel.fp8_comm=true at parallel.zero=3") and "--train.compile false" in msg


def test_mxfp8_takes_widths_and_token_runs_in_whole_blocks_of_32():
    """mxfp8's scales are per 32-element block along each GEMM's contraction dim, the weight gradient's along the
    tokens: every width (per TP rank) a multiple of 32, and each rank's tokens whole blocks of one process's."""
    mx = ("--train.fp8", "mxfp8", "--model.ffn_dim", "64", "--train.seq_len", "16")
    load_config(None, [*BASE, *mx, "--parallel.ep", "2", "--parallel.dp", "2", "--parallel.pp", "2"])
    assert err(*mx, "--model.ffn_dim", "48").startswith(
        "model.ffn_dim gives an FP8 GEMM dimension 48, not a multiple of 32 (MXFP8's block) (experts)")
    assert err(*mx, "--parallel.tp", "2").startswith("model.head_dim gives an FP8 GEMM dimension 16 per TP rank")
    wide = (*mx, "--model.d_model", "64")
    load_config(None, [*BASE, *wide, "--parallel.tp", "2"])  # no token split in FP8: heads of 32 a rank
    msg = err(*wide, "--parallel.tp", "2", "--model.shared_experts", "1")
    assert msg.startswith("train.fp8=mxfp8 with parallel.tp=2: shared experts run on each TP rank's 8 tokens")
    load_config(None, [*BASE, *wide, "--parallel.tp", "2", "--model.shared_experts", "1", "--train.seq_len", "64"])
    assert err(*mx, "--train.micro_batch", "1").startswith(
        "train.fp8=mxfp8 takes the weight gradients' blocks along a microbatch's 16 tokens a rank")
    assert err(*mx, "--parallel.cp", "2", "--train.seq_len", "64").startswith(
        "train.fp8=mxfp8 with parallel.cp=2: each CP chunk of train.seq_len=64 holds 16 tokens")
    load_config(None, [*BASE, *mx, "--parallel.cp", "2", "--train.seq_len", "128"])
    assert "--parallel.cp_split zigzag" in err(*mx, "--parallel.cp", "2", "--train.seq_len", "128",
                                               "--parallel.cp_split", "docs", "--model.attn_mask", "doc")
    assert "--parallel.fp8_comm false" in err(*mx, "--parallel.ep", "2", "--parallel.fp8_comm", "true")
