"""Shared test helpers (moved from tests/test_train.py)."""




TINY = ["--model.d_model", "32", "--model.n_heads", "4", "--model.ffn_dim", "48", "--model.n_layers", "2",
        "--model.num_experts", "4", "--data.vocab_size", "300", "--train.seq_len", "16", "--train.micro_batch", "2",
        "--run.progress", "false", "--run.tensorboard", "false", "--train.sample_tokens", "0"]
