"""DeepSeek-V3's side of the HF interop (hf.py calls these): its names, its config.json, its rotary layout.

    DEEPSEEK_RULES                        our names -> DeepseekV3ForCausalLM's, where they differ from hf.py's
    rope_parameters(m)                    config.json's rope_parameters (default or yarn), every family
    deepseek_config(m, common, ...)       config.json for an MLA model (one line refusing what it cannot hold)
    rope_rows(m, name, t, to_hf)          a q / kv_a weight with its rotary rows in the other layout
    ignored_key(m, key)                   a checkpoint tensor our model does not hold, on purpose
    mtp_shared_copies(m)                  the MTP layers' copies of the embedding and the head (model/mtp.py)

DeepSeek's rotary dims are interleaved pairs (x0, x1), (x2, x3), ... (transformers' rope_interleave, on by
default); our rope (model/rope.py) rotates halves. A rotation of pairs equals a rotation of halves after the
dims are reordered evens-then-odds, and q.k is the same sum over the reordered dims, so importing reorders the
rotary output rows of q_b_proj (q_proj) per head and of kv_a_proj_with_mqa's shared rope key; export undoes it.
The logits are transformers' and the round trip is bit-exact.

Multi-token prediction (model/mtp.py): DeepSeek stores MTP module k as decoder layer num_hidden_layers + k - 1, with
enorm, hnorm, eh_proj, shared_head.norm beside the block, and its own copies of the embedding (embed_tokens) and
the head (shared_head.head). Ours are `layers.{i}.*` and `mtp.{i}.*` (the rule below), and the copies are the
model's own tensors: export writes them, import checks that they equal the main ones (`mtp_shared_copies`).
Without model.mtp_layers the layers are skipped (`ignored_key`).
"""

from __future__ import annotations

import re

import torch

from ..config.config import ModelConfig

DEEPSEEK_RULES = [(r"^mtp\.(\d+)\.", r"model.layers.\1."),
                  (r"^layers\.(\d+)\.moe\.shared_expert\.", r"model.layers.\1.mlp.shared_experts."),
                  (r"^layers\.(\d+)\.moe\.router_bias$", r"model.layers.\1.mlp.gate.e_score_correction_bias")]
_LAYER = re.compile(r"model\.layers\.([0-9]+)\.")


def rope_parameters(m: ModelConfig) -> dict:
    p = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "yarn":
        p.update(rope_type="yarn", factor=m.rope_factor,
                 original_max_position_embeddings=m.rope_original_max_len or m.max_seq_len,
                 beta_fast=m.rope_beta_fast, beta_slow=m.rope_beta_slow)
        p.update({k: v for k, v in (("mscale", m.rope_mscale), ("mscale_all_dim", m.rope_mscale_all_dim)) if v})
    return p


def deepseek_config(m: ModelConfig, common: dict, dense: list[int], refuse) -> dict:
    """config.json of the DeepseekV3ForCausalLM that computes our MLA model; `refuse(bad, option, why)` fails."""
    why = "DeepseekV3ForCausalLM (the only family with MLA) has no such option"
    refuse(m.router_score != "sigmoid", f"MLA with model.router_score={m.router_score}",
           "DeepseekV3ForCausalLM routes with sigmoid scores")
    refuse(m.qk_norm != "none", f"MLA with model.qk_norm={m.qk_norm}", why)
    refuse(m.shared_expert_gate, "MLA with model.shared_expert_gate=true", why)
    refuse(not m.shared_experts, "MLA without model.shared_experts", "DeepseekV3ForCausalLM always has them")
    refuse((m.shared_ffn_dim or m.ffn_dim) != m.ffn_dim, f"model.shared_ffn_dim={m.shared_ffn_dim} with MLA",
           "DeepseekV3ForCausalLM's shared experts are moe_intermediate_size wide")
    refuse(dense != list(range(m.first_k_dense)), f"dense layers {dense} with MLA (moe_every/dense_layers)",
           "DeepseekV3ForCausalLM's dense layers are its first first_k_dense_replace")
    return dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", **common,
                num_key_value_heads=m.n_heads, head_dim=m.qk_rope_head_dim,
                intermediate_size=m.dense_ffn_dim or m.ffn_dim, moe_intermediate_size=m.ffn_dim,
                n_routed_experts=m.num_experts, n_shared_experts=m.shared_experts,
                routed_scaling_factor=m.routed_scale, norm_topk_prob=m.norm_topk, n_group=m.n_group,
                topk_group=m.topk_group, first_k_dense_replace=m.first_k_dense, q_lora_rank=m.q_lora_rank or None,
                kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, rope_interleave=True,
                attention_bias=m.attn_bias, num_nextn_predict_layers=m.mtp_layers)


def rope_rows(m: ModelConfig, name: str, t: torch.Tensor, to_hf: bool) -> torch.Tensor:
    """`t` (parameter `name`) with its rotary output rows reordered: interleaved -> halves (import) or back."""
    Dr = m.qk_rope_head_dim
    perm = torch.cat([torch.arange(0, Dr, 2), torch.arange(1, Dr, 2)])  # ours[j] = interleaved[perm[j]]
    if to_hf:
        perm = perm.argsort()
    if name.endswith(("attn.q_b_proj.weight", "attn.q_proj.weight")):
        heads = t.view(-1, m.qk_nope_head_dim + Dr, t.shape[-1])  # (H, Dn + Dr, in); a TP slice: its H/N heads
        return torch.cat([heads[:, :m.qk_nope_head_dim], heads[:, m.qk_nope_head_dim:][:, perm]], 1).view_as(t)
    if ".attn.kv_a_proj_with_mqa." in name:  # rows: the latent (kv_lora_rank), then the shared rope key
        return torch.cat([t[:m.kv_lora_rank], t[m.kv_lora_rank:][perm]])
    return t


def ignored_key(m: ModelConfig, key: str) -> bool:
    """A tensor of the checkpoint our model leaves out: rotary caches, and MTP layers beyond model.mtp_layers."""
    layer = _LAYER.match(key)
    return key.endswith("rotary_emb.inv_freq") or (layer is not None and int(layer[1]) >= m.n_layers + m.mtp_layers)


def mtp_shared_copies(m: ModelConfig) -> list[tuple[str, str]]:
    """(checkpoint key, our parameter it copies) of each MTP layer's embedding and head."""
    ids = range(m.n_layers, m.n_layers + m.mtp_layers)
    return [(f"model.layers.{i}.{part}.weight", ours) for i in ids
            for part, ours in (("embed_tokens", "tok_emb.weight"), ("shared_head.head", "head.weight"))]

