"""Hugging Face interop test helpers: tensors of a safetensors checkpoint, weights moved off their init, logits
compared, greedy decoding without a cache, and DeepSeek-V3's tiny config."""

from pathlib import Path

import torch

from nanotitan.config.config import load_config
from nanotitan.interop.hf import read_tensors


def _randomise(params, seed: int) -> None:
    """Every weight away from its init (norms around 1, biases non-zero) so a mis-mapped tensor shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if p.dim() == 1 else 0.2) + (p.dim() == 1))


def greedy_full_forward(model, x, n: int):
    """x (B, T) and n greedy tokens after it, each from a full forward over the whole context (no cache)."""
    for _ in range(n):
        logits, _ = model(x)
        x = torch.cat([x, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return x


def _assert_logits_close(got, want):
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), f"max |diff| {err} vs logit scale {want.abs().max().item()}"


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    return read_tensors(d)


def tiny_config(vocab: int, num_experts: int, max_seq_len: int, *extra: str):
    """A 3-layer, d-32 model of `num_experts` experts (seq 16) plus `extra` flags: the tests' tiny DeepSeek shapes."""
    return load_config(None, ["--model.d_model", "32", "--model.n_heads", "4", "--model.n_layers", "3",
                              "--model.num_experts", str(num_experts), "--model.ffn_dim", "16",
                              "--model.vocab_size", str(vocab), "--model.max_seq_len", str(max_seq_len),
                              "--data.vocab_size", str(vocab), "--train.seq_len", "16", *extra])


DS_OPTIONS = ["--model.kv_lora_rank", "16", "--model.q_lora_rank", "12", "--model.qk_nope_head_dim", "8",
              "--model.qk_rope_head_dim", "4", "--model.v_head_dim", "8", "--model.n_group", "2",
              "--model.topk_group", "1", "--model.router_score", "sigmoid", "--model.routed_scale", "2.5",
              "--model.bias_update_rate", "0.01", "--model.first_k_dense", "1", "--model.shared_experts", "1",
              "--model.aux_scope", "sequence", "--model.rope_scaling", "yarn", "--model.rope_factor", "2",
              "--model.rope_original_max_len", "8", "--model.rope_mscale_all_dim", "1"]
