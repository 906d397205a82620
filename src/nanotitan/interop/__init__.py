"""Hugging Face interop (docs/hf.md); `nanotitan.hf.load_pretrained` / `save_pretrained` are its public face.

    hf.py        Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3 checkpoints in and out
    deepseek.py  DeepSeek-V3's side of it: its names, its config.json, its rotary layout
"""
