"""`nanotitan.hf.load_pretrained` / `save_pretrained`, where users import them; the code is interop/hf.py."""

from .interop.hf import load_pretrained, save_pretrained

__all__ = ["load_pretrained", "save_pretrained"]
