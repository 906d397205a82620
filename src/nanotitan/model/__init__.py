"""The model: a decoder-only MoE transformer, built whole or as one rank's shard.

    transformer.py  the Transformer, built from a ModelShardSpec (full model or one stage/expert shard)
    spec.py         ModelShardSpec: which embeddings, layers and experts a rank owns
    moe.py          the mixture-of-experts FFN: fp32 router, top-k, SwiGLU experts, dropless by default
    experts.py      ExpertShard: which global expert each slot of a layer's experts holds (handed in at build)
    mla.py          multi-head latent attention (DeepSeek-V2/V3)
    mtp.py          multi-token prediction (DeepSeek-V3 §2.2)
    rope.py         rotary position embeddings (plain RoPE or YaRN-scaled)
    norm.py         RMSNorm, with a deferrable weight gradient
    tokens.py       TokenShard: what the model needs from the ranks that share its tokens (LOCAL on one device)
    families.py     which parameters Muon takes: each parameter's family tag
    qk_max.py       QK-clip's observation: each head's largest attention logit over a step
    kv_cache.py     the inference-only KV cache (`Transformer.decode`)
    docs.py         packed documents: each token's document start, its position in it, attention kept inside it
    fp8.py          FP8 GEMMs (train.fp8): torchao's float8 linear for dense projections, our scaled expert GEMM
    fp8_weight.py   an FP8 weight gathered as its GEMM's operand (bits and scales; parallel/dp/fp8_gather.py)
    mxfp8.py        train.fp8 mxfp8: torchao's MXFP8 linear and grouped expert GEMMs (blocks of 32, e8m0 scales)
    wgrad.py        deferred weight gradients: the input gradient now, the weight GEMMs later (zb1's B / W split)
    grouped_mm.py   the grouped experts' GEMM as a traced graph holds it in any dtype (compiled whole blocks)
"""
